"""`StoaDataSource`: slime's `--data-source-path` class for stoa runs.

    --data-source-path slime_stoa.StoaDataSource    (= slime_stoa.trainer.slime.data_source.StoaDataSource)

slime builds it as `cls(args)` in its RolloutManager and hands it to the rollout function as
`data_source`. It does two jobs:

- **Sample ids.** `get_samples(n)` hands out `n` groups of `--n-samples-per-prompt` blank
  samples carrying fresh `group_index` and `index` values, as slime's own data source does
  without `--prompt-data` (prompts come from the bucket). `add_samples` is refused (a read-only
  source, like slime's `RolloutDataSource`); `__len__` is 0 (use `--num-rollout`, not
  `--num-epoch`).
- **The consumer's state, next to slime's checkpoint.** After every batch, before the batch goes
  back to slime, `slime_stoa.generate_rollout` calls `commit(state)`: the consumer state (cursor,
  seen keys, pending queue, reuse ledger, counters) and the two id counters are written to
  `<--save>/rollout/stoa_consumer_state.json` in one atomic, durable step
  (`slime_stoa.protocol.fsutil.atomic_write`). A trainer killed at any moment (SIGKILL, a lost
  node) and restarted finds the state of the last batch it handed out: no group is used twice,
  none is skipped. `load` (slime calls it once at start-up) reads the file from `--load`
  (else `--save`); `save(rollout_id)` (next to every Megatron checkpoint) writes it again.

The bucket copy (`runs/<run>/trainer/consumer.json`, with `stoa_state_in_bucket`, the default)
is kept as well: on resume the rollout function takes the newer of the two, so a trainer on a
fresh machine without the checkpoint folder still resumes from the bucket.

It never imports slime at module level: `get_samples` imports slime's `Sample` when called.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from slime_stoa.protocol.fsutil import atomic_write

log = logging.getLogger(__name__)

STATE_FILE = "stoa_consumer_state.json"
FORMAT = "stoa.slime_data_source/1"


def state_path(folder: str | os.PathLike[str]) -> Path:
    """Where the state lives under a slime checkpoint folder (`--save` / `--load`)."""
    return Path(folder) / "rollout" / STATE_FILE


def _counter(doc: dict[str, Any], name: str, path: Path) -> int:
    value = doc.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{path}: {name} must be an int >= 0, got {value!r}")
    return value


class StoaDataSource:
    """slime's data-source interface (`get_samples`, `add_samples`, `save`, `load`, `__len__`),
    plus `consumer_state` / `commit` for stoa's rollout function (module doc)."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.sample_group_index = 0
        self.sample_index = 0
        self._consumer: dict[str, Any] | None = None  # the consumer state last loaded or committed
        self._loaded = False
        self.loaded_from: Path | None = None

    # -- slime's interface ------------------------------------------------------------------------
    def get_samples(self, num_samples: int) -> list[list[Any]]:
        """`num_samples` groups of `n_samples_per_prompt` blank samples with fresh ids."""
        from slime.utils.types import Sample

        n = getattr(self.args, "n_samples_per_prompt", None) or 1  # no args (slime's contract checks): 1
        groups = []
        for _ in range(num_samples):
            group = []
            for _ in range(n):
                sample = Sample()
                sample.group_index = self.sample_group_index
                sample.index = self.sample_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def add_samples(self, samples: list[list[Any]]) -> None:
        raise RuntimeError(
            f"Cannot add samples to {type(self).__name__}: rollout groups come from the stoa bucket "
            "(use --rollout-function-path slime_stoa.generate_rollout with it)"
        )

    def save(self, rollout_id: int) -> None:
        """Write the state again next to checkpoint `rollout_id` (it is written after every batch
        anyway); nothing before the first batch."""
        if self._consumer is not None:
            self._write()

    def load(self, rollout_id: int | None = None) -> None:
        """Read the state from `--load` (else `--save`), if it is there."""
        self._load()

    def __len__(self) -> int:
        return 0

    # -- stoa's rollout function ---------------------------------------------------------------
    @property
    def save_path(self) -> Path | None:
        folder = getattr(self.args, "save", None)
        return state_path(folder) if folder else None

    @property
    def load_path(self) -> Path | None:
        folder = getattr(self.args, "load", None) or getattr(self.args, "save", None)
        return state_path(folder) if folder else None

    def consumer_state(self, run: str) -> dict[str, Any] | None:
        """The consumer state of `run` from the checkpoint folder (loaded once), or None."""
        self._load()
        if self._consumer is not None and self._consumer.get("run") != run:
            log.warning(
                "stoa: %s holds the consumer state of run %r, not %r: ignored",
                self.loaded_from, self._consumer.get("run"), run,
            )
            return None
        return self._consumer

    def commit(self, consumer_state: dict[str, Any]) -> Path | None:
        """Make `consumer_state` (and the id counters) durable; returns the file, or None when
        slime has no `--save` (then only the bucket copy holds the state)."""
        self._loaded = True  # a later load() must not go back to an older file
        self._consumer = consumer_state
        return self._write()

    def _write(self) -> Path | None:
        path = self.save_path
        if path is None:
            return None
        doc = {
            "format": FORMAT,
            "run": (self._consumer or {}).get("run"),
            "sample_group_index": self.sample_group_index,
            "sample_index": self.sample_index,
            "consumer": self._consumer,
        }
        data = json.dumps(doc, separators=(",", ":")).encode()
        return atomic_write(path, data, parents_mode=0o755)

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        path = self.load_path
        if path is None or not path.is_file():
            return
        try:
            doc = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the stoa consumer state {path}: {exc} (move it away to start afresh)") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("consumer"), dict):
            raise ValueError(f"{path} is not a {FORMAT} file (move it away to start afresh)")
        self.sample_group_index = _counter(doc, "sample_group_index", path)
        self.sample_index = _counter(doc, "sample_index", path)
        self._consumer = doc["consumer"]
        self.loaded_from = path
        log.info("stoa: loaded the consumer state from %s", path)
