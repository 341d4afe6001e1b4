"""Do a run's published bits equal the trainer's weights? A check that trusts no publisher claim.

    python -m slime_stoa.trainer.slime.published_bits --store URL --run RUN --trainer-hf DIR
        [--version N] [--run-key TEXT] [--json PATH]

Two sides, each from its own source:

- published: the version rebuilt from the bucket the way a worker gets it, a fresh `Subscriber`
  synced from an anchor along the chain of patches, every object's digest checked
  (`pulse.rebuild`); the current version unless `--version`;
- the trainer's: an HF folder holding the trainer's own weights that stoa's publisher never
  touched, for slime the last Megatron checkpoint (Megatron's own save) converted to HF names
  (`checkpoint_to_hf`). Each tensor is taken as bf16 bits as the publisher casts them (F32 rounded
  to nearest even, `folders.load_hf_state`).

It passes when both hold the same tensor names with the same bits, and the trainer's state
digest (`StateDigest`, computed here from the trainer's bits) equals the one the version's
manifest states. A tied output head is compared as the publisher plans it (`hf_names.head_plan`):
a head the published state leaves out must equal the trainer's embedding, a head it carries must
equal the trainer's (or its embedding when the checkpoint holds none).

Exit status 0 when they match, 1 when they do not (the first differing tensors are named), 2 on
bad input (one line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.pulse.digest import StateDigest

from .hf_names import EMBEDDING, TIED_HEAD

#: Names listed per kind of difference in the report (the counts are exact).
SHOWN = 5


@dataclass(frozen=True)
class BitsReport:
    """Published state vs the trainer's, tensor by tensor, and the digests."""

    version: int
    tensors: int  # the published state's
    differing: list[str]  # names whose shape or bits differ
    only_published: list[str]  # names the trainer's weights do not hold
    only_trainer: list[str]  # names the published state does not hold
    manifest_digest: str  # what the version's manifest states
    trainer_digest: str  # computed here from the trainer's bits (head aligned)

    @property
    def equal(self) -> bool:
        return (not self.differing and not self.only_published and not self.only_trainer
                and self.trainer_digest == self.manifest_digest)

    def line(self) -> str:
        if self.equal:
            return (f"v{self.version}: the published state equals the trainer's weights bit for bit "
                    f"({self.tensors} tensors; state digest {self.trainer_digest})")
        parts = [f"v{self.version}: the published state differs from the trainer's weights"]
        for what, names in (("bits or shape differ", self.differing), ("only published", self.only_published),
                            ("only in the trainer's", self.only_trainer)):
            if names:
                parts.append(f"{what}: {len(names)} ({', '.join(names[:SHOWN])})")
        if self.trainer_digest != self.manifest_digest:
            parts.append(f"digest of the trainer's {self.trainer_digest} != the manifest's {self.manifest_digest}")
        return "; ".join(parts)


def align_head(published: Mapping[str, np.ndarray], trainer: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The trainer's state with its tied output head as the publisher plans it: dropped where the
    published state carries none, and the embedding's bits where it carries one the trainer's
    weights do not hold (Megatron keeps no separate head when it ties it). Pure; the bits of a
    dropped head must equal the embedding's, else it is kept (and reported as a difference)."""
    out = dict(trainer)
    head, embedding = out.get(TIED_HEAD), out.get(EMBEDDING)
    if TIED_HEAD not in published and head is not None and embedding is not None and _same(head, embedding):
        del out[TIED_HEAD]
    elif TIED_HEAD in published and head is None and embedding is not None:
        out[TIED_HEAD] = embedding
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)


def compare(version: int, published: Mapping[str, np.ndarray], manifest_digest: str,
            trainer: Mapping[str, np.ndarray]) -> BitsReport:
    """Published bf16 bits vs the trainer's (both uint16 by HF name). Pure."""
    ours = align_head(published, trainer)
    return BitsReport(
        version=version,
        tensors=len(published),
        differing=sorted(n for n in published.keys() & ours.keys() if not _same(published[n], ours[n])),
        only_published=sorted(published.keys() - ours.keys()),
        only_trainer=sorted(ours.keys() - published.keys()),
        manifest_digest=manifest_digest,
        trainer_digest=StateDigest.of(ours).root(),
    )


async def check(url: str, run: str, trainer_hf: Path, *, version: int | None = None,
                run_key: str | None = None) -> BitsReport:
    """Rebuild `version` (the current one by default) of `run` from the bucket at `url` and compare
    it with the weights in `trainer_hf`. Signatures are checked against `run_key`, else a signed
    run's own key (`run_trust.weights_trust`). HistoryError when the version cannot be rebuilt,
    ValueError when the folder cannot be read."""
    from slime_stoa.protocol.pulse.rebuild import rebuild
    from slime_stoa.protocol.run_trust import weights_trust
    from slime_stoa.protocol.store import open_store

    trainer = load_hf_state(trainer_hf)
    async with open_store(url) as store:
        trust = await weights_trust(store, run, run_key)
        if trust is not None:
            print(f"checking signatures against run key {trust.pinned.key_id} ({'given' if run_key else 'the run manifest'})")
        rebuilt = await rebuild(store, run, version, trust=trust)
    return compare(rebuilt.manifest.version, rebuilt.state, rebuilt.manifest.state_digest, trainer)


def main(argv: Sequence[str] | None = None) -> int:
    from slime_stoa.protocol.pulse.history import HistoryError
    from slime_stoa.protocol.store import StoreError

    parser = argparse.ArgumentParser(prog="python -m slime_stoa.trainer.slime.published_bits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the run's bucket URL (file://, s3://)")
    parser.add_argument("--run", required=True, help="the run's name")
    parser.add_argument("--trainer-hf", type=Path, required=True, help="HF folder of the trainer's weights")
    parser.add_argument("--version", type=int, default=None, help="the version to compare (default: the current one)")
    parser.add_argument("--run-key", default=None, help="check signatures against this run key (ed25519:...)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        report = asyncio.run(check(args.store, args.run, args.trainer_hf, version=args.version, run_key=args.run_key))
    except (HistoryError, StoreError, ValueError, OSError) as exc:
        print(f"published_bits: error: {exc}", file=sys.stderr)
        return 2
    print(report.line())
    if args.json is not None:
        args.json.write_text(json.dumps({**asdict(report), "equal": report.equal}, indent=2) + "\n")
    return 0 if report.equal else 1


if __name__ == "__main__":
    sys.exit(main())
