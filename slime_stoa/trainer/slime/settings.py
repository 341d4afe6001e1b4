"""The plugin's settings: `StoaSettings`, read once from slime's `args`.

slime sets every key of the `--custom-config-path` YAML as an attribute of `args`, in every
process. `StoaSettings` describes every key stoa reads there: its own fields (the bucket, the
run, the rollout function's and the publisher's knobs) and three nested configs, the rollout
consumer's (`ConsumerConfig`), the publisher's (`PublisherConfig`) and the DPPO loss's
(`DPPOConfig`). Every field is a `setting` (`slime_stoa.protocol.cli_fields`): its help and how it is read in its
metadata. `StoaSettings.from_args` walks the fields (into nested dataclasses too; settings_walk.py)
and parses each key by the field's type or its `parse` (settings_parsers.py):

- a field `x` of StoaSettings, of the consumer or of the publisher config is the key `stoa_x`,
  a field `x` of the DPPO config `dppo_x`; a field `y` of a dataclass nested in those under the
  name `x` is `<prefix>x_y` (`ConsumerConfig.quarantine.min_samples`: `stoa_quarantine_min_samples`);
- a key that is not set keeps the field's default (or the one its `default_from` derives
  from slime's flags); a YAML null means None, or the default in a `Section(null_is_default)`;
- every error is a ValueError naming the key.

Everything else derives from it: the reference table of docs/slime.md (settings_table.py;
`python -m slime_stoa.trainer.slime.settings_table docs/slime.md` rewrites it), preflight's
checks and its list of known keys (`StoaSettings.keys`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from slime_stoa.protocol.cli_fields import setting
from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.pulse.retry import DEFAULT_BACKOFF_S, DEFAULT_RETRIES
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.trainer.consumer.config import ConsumerConfig
from slime_stoa.trainer.loss_config import DPPOConfig

from .settings_parsers import as_float, as_int, as_key_file, as_run_name, as_store_url, at_least, optional
from .settings_walk import (
    DEFAULT_FROM,
    DERIVED,
    MISSING,
    SHOWN_DEFAULT,
    Leaf,
    Section,
    SettingError,
    build,
    hints,
    leaves_of,
    read,
    section_of,
)

T = TypeVar("T")

PREFIX = "stoa_"
DPPO_PREFIX = "dppo_"
DEFAULT_PUBLISH_GRACE_S = 120.0

TOP = Section(prefix=PREFIX, null_is_default=True)
"""How StoaSettings' own fields are read."""


# -- the settings -----------------------------------------------------------------------------------
def _extras_default(args: Any, _read: Mapping[str, Any]) -> Path | None:
    hf = getattr(args, "hf_checkpoint", None)
    return Path(hf) if isinstance(hf, str) and hf and Path(hf).is_dir() else None


KEPT_FOLDER = "stoa-kept"  # under slime's --save: the trainer's own copies of what it signed
KEEP_SHOWN = f"<--save>/{KEPT_FOLDER}, if --save is set"


def _keep_default(args: Any, _read: Mapping[str, Any]) -> Path | None:
    # Beside slime's checkpoints: a trainer that can resume has copies to put back what a bucket
    # writer deleted or replaced while it ran or was down (single-bucket mode: any worker token).
    save = getattr(args, "save", None)
    return Path(save) / KEPT_FOLDER if isinstance(save, str) and save else None


def _consumer_keep_default(args: Any, read: Mapping[str, Any]) -> str | None:
    folder = _keep_default(args, read)
    return None if folder is None else str(folder)


def _reduction_default(args: Any, _read: Mapping[str, Any]) -> str:
    return "token_mean" if getattr(args, "calculate_per_token_loss", False) else "seq_mean"


def _drgrpo_default(args: Any, read: Mapping[str, Any]) -> Any:
    return getattr(args, "rollout_max_response_len", None) if read.get("reduction") == "drgrpo" else None


def _worker_metrics_default(args: Any, _read: Mapping[str, Any]) -> bool:
    return bool(getattr(args, "use_wandb", False) or getattr(args, "use_tensorboard", False))


# slime's own flags some default is derived from (part of the cache key of `settings_from_args`).
SLIME_FLAGS_READ = (
    "hf_checkpoint", "calculate_per_token_loss", "rollout_max_response_len", "use_wandb", "use_tensorboard", "save",
)

_CONSUMER = Section(
    prefix=PREFIX,
    null_is_default=True,
    part="rollout",
    what="stoa rollout",
    skip=("record_limits",),
    reads=("bucket", "run", "rollouts_bucket", "run_key"),
    fields={
        "store_url": {DERIVED: lambda top: top["bucket"]},
        "run": {DERIVED: lambda top: top["run"]},
        "rollouts_url": {DERIVED: lambda top: top.get("rollouts_bucket")},
        # the trainer's own run key: the run manifest must name its public half
        "run_key": {DERIVED: lambda top: top["run_key"].public.to_text() if top.get("run_key") else None},
        "keep_dir": {DEFAULT_FROM: _consumer_keep_default, SHOWN_DEFAULT: KEEP_SHOWN},
    },
)
_PUBLISHER = Section(
    prefix=PREFIX,
    null_is_default=True,  # as the rollout's: `stoa_keep_dir: null` means the same to both ("" means none)
    part="publisher",
    what="stoa publisher",
    fields={
        "extras_dir": {DEFAULT_FROM: _extras_default, SHOWN_DEFAULT: "--hf-checkpoint, if a local folder"},
        "keep_dir": {DEFAULT_FROM: _keep_default, SHOWN_DEFAULT: KEEP_SHOWN},
    },
)
_DPPO = Section(
    prefix=DPPO_PREFIX,
    part="loss",
    what="DPPO loss",
    fields={
        "reduction": {
            DEFAULT_FROM: _reduction_default,
            SHOWN_DEFAULT: "token_mean with --calculate-per-token-loss, else seq_mean",
        },
        "drgrpo_max_len": {DEFAULT_FROM: _drgrpo_default, SHOWN_DEFAULT: "--rollout-max-response-len for drgrpo"},
    },
)


@dataclass(frozen=True, kw_only=True)
class StoaSettings:
    """Every setting of the slime plugin (the `--custom-config-path` YAML keys), parsed."""

    bucket: str = setting(
        "Required: the store URL of the run's bucket (`file://`, `s3://...?endpoint=...`, `r2://`); "
        "credentials come from the environment.",
        parse=as_store_url, part="shared",
    )
    run: str = setting("Required: the run's name in the bucket.", parse=as_run_name, part="shared")
    rollouts_bucket: str | None = setting(
        "Least privilege: the workers' records and heartbeats in a second bucket (their token writes only "
        "there).",
        None, parse=optional(as_store_url), part="shared",
    )
    run_key: SigningKey | None = setting(
        "A signed run: the run key file (mode 0600, `stoa keys create`). Every version is signed with it, "
        "the run manifest must name its public half, records need registered worker keys.",
        None, parse=optional(as_key_file), shown_default="null (unsigned)", part="shared",
    )

    tokenizer_dir: Path | None = setting(
        "A local folder with tokenizer.json the completions are re-scored with.",
        None, shown_default="null (the anchor's)", part="rollout",
    )
    state_in_bucket: bool = setting(
        "Also write the consumer state to the bucket after every batch "
        "(`runs/<run>/trainer/consumer.json`, compare-and-swap).",
        True, part="rollout",
    )
    check_publishing: bool = setting(
        "Publisher liveness: fail a rollout when the weight pointer did not move after the previous train "
        "step (section 9). false for slime's train_async.py or --update-weights-interval > 1.",
        True, part="rollout",
    )
    publish_grace_s: float = setting(
        "How long a rollout waits for the previous step's version before it fails.",
        DEFAULT_PUBLISH_GRACE_S, parse=at_least(as_float, 0), part="rollout",
    )
    worker_metrics: bool = setting(
        "Add each worker's heartbeat (`worker/<id>/*`) and the fleet's totals to each rollout's metrics.",
        default_from=_worker_metrics_default, shown_default="on with --use-wandb or --use-tensorboard", part="rollout",
    )
    eval_prompts: int | None = setting(
        "An eval (`--eval-interval`) covers the split's first N prompts.",
        None, shown_default="null (all)", part="rollout",
    )
    consumer: ConsumerConfig = setting("The rollout consumer's settings.", section=_CONSUMER)

    publish: bool = setting(
        "Read by stoa's slime patch: the YAML boolean true makes `update_weights` publish the weights.",
        False, part="publisher",
    )
    publish_retries: int = setting(
        "Retries of a failed publish (store errors; never a conflict with another publisher; an outage is "
        "waited out).",
        DEFAULT_RETRIES, parse=at_least(as_int, 0), part="publisher",
    )
    publish_backoff_s: float = setting(
        "The pause before the first retry, doubled after each.",
        DEFAULT_BACKOFF_S, parse=at_least(as_float, 0), part="publisher",
    )
    background_publish: bool = setting(
        "Diff, encode and upload the weights on a background thread while training goes on (false: inside "
        "`update_weights`).",
        True, part="publisher",
    )
    device_budget_bytes: int | None = setting(
        "The device path: diff and quantize the weights where they live against a copy of the last "
        "published version kept beside them (this many bytes of it on the GPU, the rest in pinned host "
        "memory); the host keeps no copy of the state and gets the patches, plus each changed tensor "
        "once for the digest. null: copy every weight to the host and diff there.",
        None, parse=optional(at_least(as_int, 0)), shown_default="null (diff on the host)", part="publisher",
    )
    publisher: PublisherConfig = setting("The weight publisher's settings.", PublisherConfig(), section=_PUBLISHER)

    dppo: DPPOConfig = setting(
        "The DPPO loss's settings (slime flags only its built-in loss honours are refused by the loss).",
        DPPOConfig(), section=_DPPO,
    )

    @classmethod
    def from_args(cls, args: Any) -> StoaSettings:
        """The settings from slime's `args`; SettingError (a ValueError) naming a bad key."""
        values, errors = read(cls, args, TOP)
        if errors:
            raise errors[0]
        return cls(**values)

    @classmethod
    def check(cls, args: Any) -> list[SettingError]:
        """Every setting that does not parse (a field whose inputs failed is not read)."""
        return read(cls, args, TOP)[1]

    @classmethod
    def keys(cls) -> frozenset[str]:
        """Every key the plugin reads."""
        return frozenset(leaf.key for leaf in leaves_of(cls, TOP))


def leaves(cls: type = StoaSettings, parent: Section = TOP) -> Iterator[Leaf]:
    """Every key of `cls` (StoaSettings' own by default), in field order."""
    return leaves_of(cls, parent)


def read_fields(args: Any, *names: str) -> dict[str, Any]:
    """StoaSettings' own fields `names` read from `args` alone (no bucket needed), defaults filled in."""
    values, errors = read(StoaSettings, args, TOP, only=names)
    if errors:
        raise errors[0]
    defaults = {f.name: f.default for f in dataclasses.fields(StoaSettings)}
    return {name: values.get(name, defaults[name]) for name in names}


def read_section(args: Any, name: str) -> Any:
    """The nested config `name` of StoaSettings (one that derives nothing from the shared fields)."""
    f = next(f for f in dataclasses.fields(StoaSettings) if f.name == name)
    cls, sec = hints(StoaSettings)[name], section_of(f, TOP)
    assert not any(DERIVED in rules for rules in sec.fields.values()), f"{name} needs the shared settings"
    values, errors = read(cls, args, sec)
    if errors:
        raise errors[0]
    return build(cls, values, sec)


# -- one parse per process ----------------------------------------------------------------------------
class SettingsCache:
    """The last value built from args whose relevant attributes were equal (single entry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[tuple[Any, ...], Any] | None = None

    def get(self, args: Any, names: tuple[str, ...], build: Callable[[], T]) -> T:
        seen = tuple(getattr(args, n, MISSING) for n in names)
        with self._lock:
            entry = self._entry
            if entry is not None and _same(entry[0], seen):
                return entry[1]
        value = build()
        with self._lock:
            self._entry = (seen, value)
        return value


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    try:
        return len(a) == len(b) and all(x is y or (type(x) is type(y) and bool(x == y)) for x, y in zip(a, b, strict=True))
    except Exception:  # a value that does not compare: not the same
        return False


_SETTINGS = SettingsCache()


def cached(cache: SettingsCache, args: Any, names: Collection[str], build: Callable[[], T]) -> T:
    """`build()`, once per distinct values of the attributes `names` of `args`."""
    return cache.get(args, tuple(names), build)


def settings_from_args(args: Any) -> StoaSettings:
    """`StoaSettings.from_args(args)`, parsed once and reused while the settings stay the same."""
    if args is None:
        return StoaSettings.from_args(args)
    return cached(_SETTINGS, args, _READS, lambda: StoaSettings.from_args(args))


_READS = tuple(sorted(StoaSettings.keys() | set(SLIME_FLAGS_READ)))
