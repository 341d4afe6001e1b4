"""The security report: the hostile corpora for records, names and weight objects, run against the
real code and tallied.

    STOA_SECURITY_JSON=security.json python -m pytest -q tests/test_security_report.py

writes {"records_tried", "records_admitted_invalid", "crashes", "names_tried", "names_escaped",
"weights_forged_tried", "weights_forged_applied", "oversize_tried", "max_bytes_read_over_limit"}
(plus per-category breakdowns) to that path; the test fails unless every second figure of a pair,
and `crashes`, is 0.

- records: the hand-made hostile corpora (invalid by construction), several hundred seeded
  mutations of valid v1/v2 payloads and framed records, judged by the independent reference
  decoder of `test_record_hostile`, and the signed-envelope attacks through the consumer's
  admission (`judge_record` with a worker registry and a replay ledger). A record the real code
  admits that the reference calls invalid (or reads differently) is `admitted_invalid`; any
  exception but a documented RecordError is a crash.
- names: every name of `HOSTILE_NAMES` thrown at every reader that takes a name from the bucket;
  a probe escapes when the reader accepts it or a file appears outside its folder.
- weights: every case of `forged_weights` on both store backends.
- oversize: every small document a reader takes from the bucket, written a megabyte past its
  limit (`oversize_reads`), on both backends: each must be refused after at most limit + 1 bytes
  (`max_bytes_read_over_limit`: the most any read took past that).
- freshness (`rollback_tried`/`rollback_accepted`, `downgrade_tried`/`downgrade_accepted`,
  `registry_rollback_accepted`, `state_rollback_accepted`): old genuine objects put back into the
  bucket — an older signed pointer against a running and a restarted reader and a resuming
  publisher (`test_trust_rollback`, both backends), an unsigned or re-keyed run manifest against
  workers (`test_trust_downgrade`), the registry from before a revocation against a fresh trainer
  and an old consumer state against a restarted one (`test_trust_consumer_state`). An attack is
  accepted when the refusal its test asserts does not happen.
- a worker token's writes in single-bucket mode (`writer_tried`, `writer_stops_trainer`,
  `honest_rejected_for_missing_object`): the run manifest, pointer, a version manifest, the
  registry, the consumer state and its heads deleted or overwritten under a trainer with its own
  copies (`test_trust_writer`), and a patch, a version manifest or an anchor shard of the live
  weight chain spoiled under a live publisher, or an anchor shard deleted while no trainer runs
  (`test_chain_keeper`: a worker joining after one keeper round, or the restart, and the next
  version must reach the head); one stops the trainer when it raises,
  does not put the object back (or, for an anchor shard, publish a fresh anchor) or admits a
  revoked worker's record.
- delivery (`junk_list_ratio`, `junk_state_bytes`, `skew_rejected`, `slow_answer_admitted_ratio`):
  LIST requests per poll with 20,000 junk keys of each kind against a clean control and the
  saved state's growth (`test_discovery_junk`), records of Macs whose clocks are 10 minutes
  ahead, 10 and 40 minutes behind refused by the trainer (`test_worker_clock`: 0 within the
  tolerance), the share of 12 honest records admitted when one GET trickles (`test_slow_download`).
- task data (`task_forged_tried`/`task_forged_accepted`): a signed run's split replaced or grown,
  its signed task manifest deleted, re-signed by another key or another task's: read by the trainer.
- heartbeats (`heartbeat_forged_tried`/`heartbeat_forged_shown_healthy`): unsigned, unknown-key,
  revoked, other-worker, other-run and tampered heartbeats beside an honest one, read the way
  `stoa fleet` and the trainer's metrics read them (`test_trust_heartbeats`).

The mutations are seeded (`$STOA_TEST_SEED` replays another seed) so the figures repeat.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import xxhash
import zstandard

from slime_stoa.judging.scoring import Rescorer
from slime_stoa.protocol.heartbeat import Heartbeat, shown_status
from slime_stoa.protocol.hf.folders import INDEX_NAME, load_hf_state, safe_child
from slime_stoa.protocol.layout import RolloutKey, RunLayout, check_name, check_worker_id
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.manifests import AnchorFile, AnchorManifest, Pointer, VersionManifest
from slime_stoa.protocol.records import MAGIC, RecordError, RolloutGroup, encode_group, frame_payload
from slime_stoa.protocol.registry import Registry, WorkerEntry, add_worker, load_registry, revoke_worker
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust, rotation_document
from slime_stoa.protocol.signed_record import HEADER_LEN, sign_record
from slime_stoa.protocol.signing import SigningKey, sign_document
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.protocol.validate import REJECT_REASONS, RecordLimits, load_record
from slime_stoa.tasks import generate_items, make_task
from slime_stoa.tasks.search.bundle import (
    INDEX_FILES,
    Chunk,
    IndexFile,
    IndexManifest,
    chunk_name,
    encode_manifest,
    parse_manifest,
)
from slime_stoa.trainer.consumer.admission import ALL_REASONS, judge_record
from slime_stoa.trainer.consumer.state import ReplayLedger
from tests.s3server import LocalS3Server

from . import oversize_reads as ov
from . import test_discovery_junk as junk
from . import test_hostile_names as hn
from . import test_record_hostile as rh
from . import test_records as tr
from . import test_slow_download as slow
from . import test_trust_consumer_state as tcs
from . import test_trust_downgrade as tdg
from . import test_trust_heartbeats as thb
from . import test_trust_rollback as trb
from . import test_trust_writer as tw
from . import test_worker_clock as clock
from .conftest import s3_url
from .forged_weights import CASES, honest_run, run_case, tally
from .test_chain_keeper import ATTACKS as CHAIN_ATTACKS
from .test_consumer import Tiny, tiny

__all__ = ["tiny"]  # the session fixture

REPORT_ENV = "STOA_SECURITY_JSON"
SEED = int(os.environ.get("STOA_TEST_SEED") or 20_240_601)
WEIGHT_KINDS = {"pointer", "version manifest", "anchor manifest", "patch", "anchor file"}

RecordOutcome = Literal["refused", "admitted", "admitted_invalid", "crash"]
NameOutcome = Literal["refused", "escaped", "crash"]


# -- records -----------------------------------------------------------------------------------------


def classify_record(
    load: Callable[[], RolloutGroup],
    reference: Callable[[], RolloutGroup | None],
    reasons: Collection[str] = REJECT_REASONS,
) -> RecordOutcome:
    """What the real code (`load`) did with one record. `reference` (called only when `load`
    admits) is the group the record truly holds, or None when it holds none; a refusal must
    give one of the documented `reasons`."""
    try:
        got = load()
    except RecordError as exc:
        return "refused" if exc.reason in reasons else "crash"
    except Exception:
        return "crash"
    return "admitted" if got == reference() else "admitted_invalid"


def mutate(base: bytes, donors: Sequence[bytes], rng: random.Random) -> bytes:
    """`base` after 1-4 edits: bit flips, byte writes, truncations, insertions, deletions, and
    splices or overwrites with a slice of a donor (another valid encoding)."""
    data = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(("flip", "put", "cut", "insert", "delete", "splice", "overwrite"))
        i = rng.randint(0, len(data))
        if op == "flip" and i < len(data):
            data[i] ^= 1 << rng.randint(0, 7)
        elif op == "put" and i < len(data):
            data[i] = rng.randint(0, 255)
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == "delete":
            del data[i : i + rng.randint(1, 8)]
        elif op in ("splice", "overwrite"):
            donor = rng.choice(donors)
            a = rng.randint(0, len(donor))
            piece = donor[a : a + rng.randint(1, 64)]
            if op == "splice":
                data[i:i] = piece
            else:
                data[i : i + len(piece)] = piece
    return bytes(data)


def mutations(base: bytes, donors: Sequence[bytes], seed: int, n: int) -> list[bytes]:
    """`n` distinct mutations of `base` (none equal to it), the same for the same seed."""
    rng = random.Random(seed)
    out: dict[bytes, None] = {}
    for _ in range(50 * n):
        if len(out) == n:
            break
        data = mutate(base, donors, rng)
        if data != base:
            out.setdefault(data)
    assert len(out) == n, f"only {len(out)} distinct mutations of {n}"
    return list(out)


def ref_payload(payload: bytes) -> RolloutGroup | None:
    try:
        return rh.ref_decode(payload)
    except (rh.Invalid, TypeError, ValueError):
        return None


def ref_record(data: bytes) -> RolloutGroup | None:
    """The reference for a framed record: one zstd frame, then the reference payload decoder.
    Called only on records the real code admitted (so the frame is bounded)."""
    if not data.startswith(MAGIC) or len(data) <= len(MAGIC) + 1 or data[len(MAGIC)] != rh.FORMAT:
        return None
    try:
        payload = zstandard.ZstdDecompressor().decompress(data[len(MAGIC) + 1 :])
    except zstandard.ZstdError:
        return None
    return ref_payload(payload)


def loaded(data: bytes, limits: RecordLimits) -> Callable[[], RolloutGroup]:
    return lambda: load_record(data, limits, now=rh.NOW)


RecordCase = tuple[Callable[[], RolloutGroup], Callable[[], RolloutGroup | None]]


def hand_made_records() -> dict[str, list[RecordCase]]:
    """The hostile corpora: every case is invalid by construction."""
    none: Callable[[], RolloutGroup | None] = lambda: None  # noqa: E731
    return {
        "hostile_payloads": [(loaded(frame_payload(p), rh.LIMITS), none) for _, p, _ in rh.HOSTILE_PAYLOADS],
        "hostile_frames": [(loaded(make(), rh.LIMITS), none) for _, make, _ in rh.HOSTILE_FRAMES],
        "hostile_episodes": [(loaded(encode_group(g), tr.TOOL_LIMITS), none) for _, g, _ in tr.TOOL_HOSTILE],
    }


def mutated_records(seed: int) -> dict[str, list[RecordCase]]:
    """Seeded mutations of valid payloads (framed) and of a valid framed record."""
    donors = [rh.PAYLOAD, *rh.OTHER_PAYLOADS, rh.TOOL_PAYLOAD]
    sources = {
        "mutated_payload": (rh.PAYLOAD, 160),
        "mutated_large_payload": (rh.OTHER_PAYLOADS[1], 80),
        "mutated_episode_payload": (rh.TOOL_PAYLOAD, 160),
    }
    out: dict[str, list[RecordCase]] = {}
    for i, (source, (base, n)) in enumerate(sources.items()):
        out[source] = [
            (loaded(frame_payload(p), rh.LIMITS), lambda p=p: ref_payload(p))  # type: ignore[misc]
            for p in mutations(base, donors, seed + i, n)
        ]
    out["mutated_frame"] = [
        (loaded(d, rh.LIMITS), lambda d=d: ref_record(d))  # type: ignore[misc]
        for d in mutations(rh.VALID, [rh.VALID, *donors], seed + 10, 120)
    ]
    return out


SIGNED_RUN = "signed-run"


@dataclasses.dataclass(frozen=True)
class SignedAdmission:
    """The consumer's admission of a signed run: signature against the registry, decoding and
    validation, the record's key, replays, re-scoring (`judge_record`)."""

    registry: Registry | None  # None: an unsigned run's admission (envelopes unwrapped, not checked)
    keys: dict[str, SigningKey]
    replay: ReplayLedger
    rescorer: Rescorer

    @classmethod
    def make(cls) -> SignedAdmission:
        keys = {w: SigningKey.generate() for w in ("mac-a", "mac-b", "mac-c")}
        registry = Registry(run=SIGNED_RUN)
        for worker, key in keys.items():
            registry = add_worker(registry, worker=worker, name=worker, key=key.public, now=1.0)
        registry = revoke_worker(registry, "mac-c", now=2.0)
        task = make_task("synthetic", generate_items(8, seed=1))
        rescorer = Rescorer(task=task, decode=lambda ids: " ".join(str(t) for t in ids))
        return cls(registry, keys, ReplayLedger(), rescorer)

    def judge(self, data: bytes, worker: str, seq: int, ts_ms: int, *, replay: bool = True) -> RolloutGroup:
        """`replay=False`: without the replay ledger, so the other checks stand alone."""
        name = RunLayout(SIGNED_RUN).rollout(worker, ts_ms, seq)
        admitted = judge_record(
            name, data, key=RolloutKey("train", ts_ms, worker, seq), limits=rh.LIMITS, rescorer=self.rescorer,
            reward_tolerance=1e-6, now=rh.NOW, replay=self.replay if replay else None, registry=self.registry,
        )
        return admitted.group


def signed_group(worker: str, seq: int, prompt_index: int) -> RolloutGroup:
    return rh.make_group(run=SIGNED_RUN, task_id="synthetic", worker_id=worker, seq=seq, prompt_index=prompt_index)


def signed_records(seed: int, adm: SignedAdmission | None = None) -> dict[str, list[RecordCase]]:
    """Two honest signed records first (admitted), then every envelope attack and seeded
    mutations of an honest envelope, in one admission (`adm`, a fresh one by default)."""
    adm = adm or SignedAdmission.make()
    a, b, c = (adm.keys[w] for w in ("mac-a", "mac-b", "mac-c"))
    good = [signed_group("mac-a", 0, 0), signed_group("mac-b", 0, 1)]
    honest = [sign_record(encode_group(good[0]), a, run=SIGNED_RUN), sign_record(encode_group(good[1]), b, run=SIGNED_RUN)]

    def case(data: bytes, worker: str, seq: int, ts: int, want: RolloutGroup | None = None, replay: bool = True) -> RecordCase:
        return (lambda: adm.judge(data, worker, seq, ts, replay=replay), lambda: want)

    def env(group: RolloutGroup, key: SigningKey, run: str = SIGNED_RUN) -> bytes:
        return sign_record(encode_group(group), key, run=run)

    other = signed_group("mac-a", 3, 3)
    attacks = [
        case(encode_group(signed_group("mac-a", 1, 2)), "mac-a", 1, 10),  # unsigned
        case(env(signed_group("mac-x", 0, 2), SigningKey.generate()), "mac-x", 0, 11),  # unknown key
        case(env(signed_group("mac-c", 0, 2), c), "mac-c", 0, 12),  # revoked
        case(env(signed_group("mac-a", 2, 2), b), "mac-a", 2, 13),  # mac-b signs as mac-a
        case(env(other, a)[:HEADER_LEN] + encode_group(signed_group("mac-a", 3, 4)), "mac-a", 3, 14),  # other bytes
        case(env(signed_group("mac-a", 4, 2), a, run="other-run"), "mac-a", 4, 15),  # another run
        case(honest[0], "mac-a", 0, 16),  # replayed under another timestamp
        case(honest[0], "mac-b", 0, 17),  # under mac-b's name and sequence number
        case(env(signed_group("mac-a", 5, 99), a), "mac-a", 5, 18),  # signed, but no such task item
        case(env(signed_group("mac-a", 6, 2), a), "mac-a", 7, 19),  # signed, but not its key's seq
    ]
    # Each under the honest record's own key, without the replay ledger: only the signature
    # (and decoding) stand between a mutated envelope and admission.
    flipped = [case(d, "mac-a", 0, 1, replay=False) for d in mutations(honest[0], honest, seed + 20, 120)]
    return {
        "signed_honest": [case(honest[0], "mac-a", 0, 1, good[0]), case(honest[1], "mac-b", 0, 2, good[1])],
        "signed_attacks": attacks,
        "signed_mutated": flipped,
    }


def records_report(cases: dict[str, list[RecordCase]]) -> dict[str, Counter[str]]:
    """Outcome counts per source, cases judged in order (the signed ones by the consumer, which
    adds its own reasons: signature, replay, task)."""
    return {
        source: Counter(
            classify_record(load, ref, ALL_REASONS if source.startswith("signed") else REJECT_REASONS)
            for load, ref in items
        )
        for source, items in cases.items()
    }


# -- names -------------------------------------------------------------------------------------------

NameReader = Callable[[str], object]


def probe_name(read: NameReader, name: str) -> NameOutcome:
    """A reader refuses a name with a ValueError (or a RecordError, for records)."""
    try:
        read(name)
    except (ValueError, RecordError):
        return "refused"
    except Exception:
        return "crash"
    return "escaped"


def parsed(value: object) -> object:
    """A parser's answer: None (the key is not one of the layout's) is a refusal."""
    if value is None:
        raise ValueError("not a key of the layout")
    return value


def edited(doc: bytes, path: str, parse: Callable[[bytes], object]) -> NameReader:
    return lambda name: parse(hn.edit(doc, path, name))


def record_field(field: str) -> NameReader:
    def read(name: str) -> object:
        data, _ = hn.record_with(field, name)
        return load_record(data, hn.LIMITS, now=hn.NOW)

    return read


RUN_KEY = SigningKey.generate()


def signed_registry_with_worker(name: str) -> bytes:
    entry = WorkerEntry(worker="mac-01", name="mac", key=SigningKey.generate().public, added_at=1.0)
    doc = Registry(run=hn.RUN, serial=1, workers={"mac-01": entry}).to_doc()
    doc["workers"] = {name: doc["workers"]["mac-01"]}
    return json.dumps(sign_document(doc, RUN_KEY)).encode()


def learn_rotation(name: str) -> object:
    trust = RunTrust(hn.RUN, RUN_KEY.public)
    return trust.learn(rotation_document(name, 1, SigningKey.generate().public, 0, RUN_KEY), "rotation")


def search_index() -> bytes:
    sha = "0" * 64
    files = tuple(IndexFile(f, 1, sha, (Chunk(chunk_name(f, 0), 1, sha),)) for f in INDEX_FILES)
    return encode_manifest(IndexManifest(passages=1, files=files))


def hf_index(root: Path) -> NameReader:
    def read(name: str) -> object:
        (root / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": name}}))
        return load_hf_state(root)

    return read


def name_readers(tmp: Path) -> dict[str, NameReader]:
    """Every reader of a name read from the bucket, by a short label."""
    layout, attempt, v = hn.LAYOUT, hn.ATTEMPT, "000000000001"
    pointer, version, anchor = hn.pointer().to_bytes(), hn.version_manifest().to_bytes(), hn.anchor_manifest().to_bytes()
    good_run = json.loads(RunManifest(run=hn.RUN, model="tiny", task="gsm8k").to_bytes())
    beat = json.loads(Heartbeat(worker_id="mac-01", name="studio", status="generating").to_bytes())
    index = search_index()
    assert parse_manifest(index).files and Pointer.from_bytes(pointer, run=hn.RUN)  # the baselines parse
    load_registry(signed_registry_with_worker("mac-01"), run=hn.RUN, run_key=RUN_KEY.public)

    def version_doc(d: bytes) -> object:
        return VersionManifest.from_bytes(d, "v")

    def anchor_doc(d: bytes) -> object:
        return AnchorManifest.from_bytes(d, "a")

    def pointer_doc(d: bytes) -> object:
        return Pointer.from_bytes(d, run=hn.RUN)

    prefix = layout.anchor_prefix(0, attempt)
    readers: dict[str, NameReader] = {
        "check_name.run": lambda n: check_name("run", n),
        "check_name.task": lambda n: check_name("task", n),
        "check_name.file": lambda n: check_name("file", n),
        "check_worker_id": check_worker_id,
        "safe_child": lambda n: safe_child(tmp, n),
        "layout.run": RunLayout,
        "layout.anchor_file": lambda n: layout.anchor_file(1, attempt, n),
        "layout.task_file.file": lambda n: layout.task_file("gsm8k", n),
        "layout.task_file.task": lambda n: layout.task_file(n, "train.jsonl.zst"),
        "layout.task_data": lambda n: layout.task_data("gsm8k", n),
        "layout.trainer_file": layout.trainer_file,
        "layout.heartbeat": layout.heartbeat,
        "layout.rollout": lambda n: layout.rollout(n, 1, 1),
        "layout.version_manifest": lambda n: layout.version_manifest(1, n),
        "parse.version_manifest": lambda n: parsed(layout.parse_version_manifest(f"{layout.versions_prefix}{n}.json")),
        "parse.anchor_file": lambda n: parsed(layout.parse_anchor_file(f"{layout.anchors_prefix}{v}-{attempt}/{n}")),
        "parse.anchor_manifest": lambda n: parsed(layout.parse_anchor_manifest(f"{layout.anchors_prefix}{n}/manifest.json")),
        "parse.patch": lambda n: parsed(layout.parse_patch(f"{layout.patches_prefix}{v}-{attempt}/{n}")),
        "parse.rollout": lambda n: parsed(layout.parse_rollout(f"{layout.rollouts_prefix()}1700000000000-{n}-0000000001.rec")),
        "heartbeat.worker_id": lambda n: Heartbeat.from_bytes(json.dumps({**beat, "worker_id": n}).encode()),
        "pointer.run": edited(pointer, "run", pointer_doc),
        "pointer.manifest": edited(pointer, "manifest", pointer_doc),
        "pointer.manifest.version": lambda n: pointer_doc(hn.edit(pointer, "manifest", f"{layout.versions_prefix}{n}.json")),
        "pointer.anchor.manifest": lambda n: pointer_doc(hn.edit(pointer, "anchor.manifest", f"{layout.anchors_prefix}{n}/manifest.json")),
        "version.run": edited(version, "run", version_doc),
        "version.attempt": edited(version, "attempt", version_doc),
        "version.patch_key": edited(version, "patches.0.key", version_doc),
        "version.patch_key.file": lambda n: version_doc(hn.edit(version, "patches.0.key", f"{layout.patches_prefix}{v}-{attempt}/{n}")),
        "version.parent": lambda n: version_doc(hn.edit(version, "parent.manifest", f"{layout.versions_prefix}{n}.json")),
        "version.anchor": lambda n: version_doc(hn.edit(version, "anchor.manifest", f"{layout.anchors_prefix}{v}-{attempt}/{n}")),
        "anchor.extra_name": edited(anchor, "extras.0.name", anchor_doc),
        "anchor.weight_name": edited(anchor, "weights.0.name", anchor_doc),
        "anchor.run": edited(anchor, "run", anchor_doc),
        "anchor.attempt": edited(anchor, "attempt", anchor_doc),
        "anchor.extra_key": lambda n: anchor_doc(hn.edit(anchor, "extras.0.key", prefix + n)),
        "anchor.extra_name_and_key": lambda n: anchor_doc(hn.edit(hn.edit(anchor, "extras.0.name", n), "extras.0.key", prefix + n)),
        "hf_index.shard": hf_index(tmp),
        "record.run": record_field("run"),
        "record.task_id": record_field("task_id"),
        "record.worker_id": record_field("worker_id"),
        "registry.worker_id": lambda n: load_registry(signed_registry_with_worker(n), run=hn.RUN, run_key=RUN_KEY.public),
        "rotation.run": learn_rotation,
        "run_trust.run": lambda n: RunTrust(n, RUN_KEY.public),
        "search_index.file": edited(index, "files.0.name", parse_manifest),
        "search_index.chunk": edited(index, "files.0.chunks.0.name", parse_manifest),
    }
    for field in ("run", "task", "task_split"):
        readers[f"run_manifest.{field}"] = run_manifest_field(good_run, field)
    return readers


def run_manifest_field(good: dict[str, Any], field: str) -> NameReader:
    return lambda name: RunManifest.from_bytes(json.dumps({**good, field: name}).encode())


def tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


async def probe_extras(store: Store, root: Path, names: Iterable[str]) -> Counter[str]:
    """`download_extras` given an anchor manifest (built in memory, past the parser) naming each
    hostile extra file: it must refuse, and no file may appear outside its folder."""
    data = b"{}"
    key = hn.LAYOUT.anchor_file(0, hn.ATTEMPT, "config.json")
    await store.put(key, data)
    digest = xxhash.xxh3_128_hexdigest(data)
    good = AnchorFile(name="config.json", key=key, bytes=len(data), xxh3=digest)
    folder = root / "a" / "b" / "extras"
    folder.mkdir(parents=True)
    outcomes: Counter[str] = Counter()
    for name in names:
        manifest = dataclasses.replace(hn.anchor_manifest(), extras=(good, AnchorFile(name=name, key=key, bytes=2, xxh3=digest)))
        before = tree(root)
        try:
            await download_extras(store, manifest, folder)
            outcome: NameOutcome = "escaped"
        except ValueError:
            outcome = "refused"
        except Exception:
            outcome = "crash"
        if any(folder not in p.parents for p in tree(root) - before):
            outcome = "escaped"
        outcomes[outcome] += 1
    return outcomes


def names_report(readers: dict[str, NameReader], names: Sequence[str]) -> dict[str, Counter[str]]:
    return {label: Counter(probe_name(read, n) for n in names) for label, read in readers.items()}


# -- weights -----------------------------------------------------------------------------------------


async def weights_by_kind(store: Store) -> dict[str, Counter[str]]:
    """Each case of `forged_weights` in a fresh run: tried / applied / refused per kind."""
    out: dict[str, Counter[str]] = {}
    for i, case in enumerate(CASES):
        h = await honest_run(store, f"by-kind-{i}", np.random.default_rng(SEED + i))
        outcome = await run_case(h, case)
        counts = out.setdefault(case.kind, Counter())
        counts.update(tried=1, applied=int(outcome.applied), refused=int(outcome.refused))
    return out


async def open_backends(stack: AsyncExitStack, tmp: Path, server: LocalS3Server, bucket: str) -> dict[str, Callable[[str], Awaitable[Store]]]:
    """For each backend, a factory of fresh, empty stores (a folder, or a bucket prefix)."""
    creds = server.credentials()
    env = {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}

    async def file_store(prefix: str) -> Store:
        root = tmp / "bucket" / prefix
        root.mkdir(parents=True)
        return await stack.enter_async_context(open_store(f"file://{root}"))

    async def s3_store(prefix: str) -> Store:
        return await stack.enter_async_context(open_store(s3_url(server, bucket, f"sec-{prefix}"), environ=env))

    return {"file": file_store, "s3": s3_store}


# -- freshness and heartbeats ------------------------------------------------------------------------

ROLLBACK_ATTACKS = (
    trb.test_a_subscriber_refuses_an_old_genuine_pointer_and_keeps_its_weights,
    trb.test_a_publisher_resumes_from_the_highest_signed_version_not_an_old_pointer,
    trb.test_a_publisher_never_writes_a_second_manifest_for_a_version,
)
DOWNGRADE_ATTACKS = (
    tdg.test_a_worker_holding_a_worker_key_refuses_an_unsigned_run,
    tdg.test_a_worker_refuses_a_run_re_keyed_after_it_first_trusted_it,
    tdg.test_a_pinned_worker_refuses_an_unsigned_run,
)
#: A worker token's writes in single-bucket mode: to the trainer's own objects, and to the live
#: weight chain under a live publisher.
WRITER_ATTACKS = {**tw.ATTACKS, **CHAIN_ATTACKS}


async def accepted(attack: Awaitable[object]) -> int:
    """1 when the refusal an attack's test asserts did not happen (it fails), else 0."""
    try:
        await attack
    except Exception:
        return 1
    return 0


async def file_store(stack: AsyncExitStack, root: Path) -> tuple[Store, str]:
    root.mkdir(parents=True)
    url = f"file://{root}"
    return await stack.enter_async_context(open_store(url)), url


async def freshness(
    stack: AsyncExitStack, tmp: Path, factories: dict[str, Callable[[str], Awaitable[Store]]], tiny: Tiny,
    caplog: Any,
) -> dict[str, int]:
    """Every rollback and downgrade attack, each in a fresh store."""
    rollback = [await accepted(attack(await factory(f"rollback-{i}")))
                for name, factory in factories.items() for i, attack in enumerate(ROLLBACK_ATTACKS)]
    downgrade = []
    for i, attack in enumerate(DOWNGRADE_ATTACKS):
        store, url = await file_store(stack, tmp / f"downgrade-{i}" / "bucket")
        downgrade.append(await accepted(attack(store, url, tmp / f"downgrade-{i}", caplog)))
        caplog.clear()
    store, url = await file_store(stack, tmp / "state-rollback")
    state = int(await tcs.state_rollback(store, url, tiny))
    store, url = await file_store(stack, tmp / "registry-rollback")
    registry = int(await tcs.registry_rollback(store, url, tiny))
    writer = []  # single-bucket mode: a worker token's writes against a trainer with its own copies
    for name, writer_attack in WRITER_ATTACKS.items():
        store, url = await file_store(stack, tmp / f"writer-{name}" / "bucket")
        writer.append(await writer_attack(store, url, tiny, tmp / f"writer-{name}" / "trainer"))
    return {
        "rollback_tried": len(rollback) + 2, "rollback_accepted": sum(rollback) + state + registry,
        "downgrade_tried": len(downgrade), "downgrade_accepted": sum(downgrade),
        "registry_rollback_accepted": registry, "state_rollback_accepted": state,
        "writer_tried": len(writer),
        "writer_stops_trainer": sum(o.stopped or not o.restored or o.revoked_admitted > 0 for o in writer),
        "honest_rejected_for_missing_object": sum(o.honest_rejected for o in writer),
    }


async def forged_heartbeats(store: Store) -> dict[str, int]:
    """Forged heartbeats beside an honest one, judged against the run's registry as `stoa fleet`
    and the trainer's metrics judge them: how many show as a running worker."""
    from slime_stoa.protocol.heartbeat import NOT_RUNNING, read_fleet

    await thb.put_forgeries(store)  # mac-a honest; mac-b unsigned; mac-c revoked
    layout, key_a, key_b = RunLayout(thb.RUN), thb.KEYS["mac-a"], thb.KEYS["mac-b"]
    tampered = thb.beat("mac-a").to_bytes(key_a, run=thb.RUN).replace(b'"tokens_per_s": 500.0', b'"tokens_per_s": 1e9')
    forgeries = {
        "mac-d": thb.beat("mac-d").to_bytes(SigningKey.generate(), run=thb.RUN),  # an unknown key
        "mac-e": thb.beat("mac-e").to_bytes(key_b, run=thb.RUN),  # another worker's key
        "mac-f": thb.beat("mac-f").to_bytes(),  # unsigned, unregistered
    }
    for worker, data in forgeries.items():
        await store.put(layout.heartbeat(worker), data)
    registry = thb.registry()
    judged, _ = await read_fleet(store, thb.RUN, registry)
    now = time.time()
    shown = sum(shown_status(b, now, t) not in NOT_RUNNING for b, t in judged if b.worker_id != "mac-a")
    # the honest one, tampered and signed for another run (each judged in place of the honest one)
    for data in (tampered, thb.beat("mac-a").to_bytes(key_a, run="other-run")):
        await store.put(layout.heartbeat("mac-a"), data)
        judged, _ = await read_fleet(store, thb.RUN, registry)
        shown += sum(shown_status(b, now, t) not in NOT_RUNNING for b, t in judged if b.worker_id == "mac-a")
    honest = sum(t == "signed" for b, t in judged)
    assert honest == 0  # the last forgery replaced the honest heartbeat
    return {"heartbeat_forged_tried": 2 + len(forgeries) + 2, "heartbeat_forged_shown_healthy": shown}


async def forged_task_objects(store: Store) -> dict[str, int]:
    """A signed run's task data rewritten by a worker's token (a split replaced at its size or
    grown, the manifest deleted, re-signed by another key, or another task's): how many of them
    the trainer's `read_task` accepts instead of refusing (`protocol.task_manifest`)."""
    from slime_stoa.judging.run_data import read_task
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.protocol.task_manifest import TaskDataRefused, empty_manifest, task_manifest_bytes
    from slime_stoa.tasks import generate_items, make_task
    from slime_stoa.tasks.objects import put_task_objects

    key, run = SigningKey.generate(), "tasks"
    layout, data = RunLayout(run), make_task("synthetic", generate_items(6, seed=1)).encode()
    manifest = RunManifest(run=run, model="m", task="synthetic", run_key=key.public.to_text())
    await put_task_objects(store, run, "synthetic", {"train": data}, key=key)
    split, signed = layout.task_data("synthetic", "train"), layout.task_manifest("synthetic")
    genuine = {split: data, signed: await store.get_bytes(signed)}
    forged_by = SigningKey.generate()
    attacks = [
        {split: data[:-1] + bytes([data[-1] ^ 1])},
        {split: data + b"more labels"},
        {signed: None},
        {signed: task_manifest_bytes(empty_manifest(run, "synthetic").with_objects({"train.jsonl.zst": data}), forged_by)},
        {signed: task_manifest_bytes(empty_manifest(run, "gsm8k").with_objects({"train.jsonl.zst": data}), key)},
    ]
    accepted = 0
    for attack in attacks:
        for k, v in attack.items():
            await (store.delete(k) if v is None else store.put(k, v))
        try:
            await read_task(store, manifest)
            accepted += 1
        except TaskDataRefused:
            pass
        for k in attack:
            await store.put(k, genuine[k])
    return {"task_forged_tried": len(attacks), "task_forged_accepted": accepted}


# -- the report ---------------------------------------------------------------------------------------


def totals(counts: dict[str, Counter[str]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for c in counts.values():
        out.update(c)
    return out


def plain(counts: dict[str, Counter[str]]) -> dict[str, dict[str, int]]:
    return {k: {"tried": sum(c.values()), **dict(sorted(c.items()))} for k, c in counts.items()}


async def delivery(tmp: Path, server: LocalS3Server, bucket: str, tiny: Tiny) -> dict[str, Any]:
    """What junk in the prefix, a Mac's clock and a slow answer cost the honest records, each
    measured by the test that asserts it: junk keys (`test_discovery_junk`'s small form: LISTs
    per poll against a control, saved-state growth), corrected clocks at +10/-10/-40 minutes
    (`test_worker_clock`: records refused), one trickled GET among 12 (`test_slow_download`)."""
    (tmp / "junk").mkdir(parents=True)
    _, _, summary, _ = await junk.small_form(tiny, tmp / "junk")
    skew = await clock.skew_report(server, bucket, tmp / "clock", tiny)
    return {
        "junk_list_ratio": summary["junk_list_ratio"],
        "junk_state_bytes": summary["junk_state_bytes"],
        "skew_tried": skew["skew_tried"],
        "skew_rejected": skew["skew_rejected"],
        **await slow.slow_answer_report(server, bucket, tiny),
    }


async def build_report(
    tmp: Path, server: LocalS3Server, bucket: str, seed: int, tiny: Tiny | None = None, caplog: Any = None
) -> dict[str, Any]:
    records = records_report({**hand_made_records(), **mutated_records(seed), **signed_records(seed)})
    names = [n for _, n in hn.HOSTILE_NAMES]
    readers_tmp = tmp / "readers"
    readers_tmp.mkdir()
    name_counts = names_report(name_readers(readers_tmp), names)
    weights: dict[str, Counter[str]] = {}
    by_backend: dict[str, dict[str, int]] = {}
    oversize: dict[str, dict[str, int]] = {}
    fresh: dict[str, int] = {}
    async with AsyncExitStack() as stack:
        factories = await open_backends(stack, tmp, server, bucket)
        if tiny is not None:
            fresh = await freshness(stack, tmp / "freshness", factories, tiny, caplog)
            fresh.update(await forged_heartbeats(await factories["file"]("heartbeats")))
            fresh.update(await forged_task_objects(await factories["file"]("tasks")))
            fresh.update(await delivery(tmp / "delivery", server, bucket, tiny))
        for backend, factory in factories.items():
            name_counts[f"download_extras.{backend}"] = await probe_extras(await factory("extras"), tmp / f"extras-{backend}", names)
            tallied = await factory("tally")

            async def same(run: str, store: Store = tallied) -> Store:
                return store

            by_backend[backend] = await tally(same, seed=seed)
            for kind, c in (await weights_by_kind(await factory("kinds"))).items():
                weights.setdefault(kind, Counter()).update(c)
            oversize[backend] = await ov.tally(factory)
    r, n = totals(records), totals(name_counts)
    return {
        "records_tried": sum(r.values()),
        "records_admitted_invalid": r["admitted_invalid"],
        "crashes": r["crash"] + n["crash"],
        "names_tried": sum(n.values()),
        "names_escaped": n["escaped"],
        "weights_forged_tried": sum(t["weights_forged_tried"] for t in by_backend.values()),
        "weights_forged_applied": sum(t["weights_forged_applied"] for t in by_backend.values()),
        "oversize_tried": sum(t["oversize_tried"] for t in oversize.values()),
        "max_bytes_read_over_limit": max(t["max_bytes_read_over_limit"] for t in oversize.values()),
        **fresh,
        "seed": seed,
        "records_admitted_valid": r["admitted"],
        "names_distinct": len(set(names)),
        "records_by_source": plain(records),
        "names_by_reader": plain(name_counts),
        "weights_by_kind": plain(weights),
        "weights_by_backend": by_backend,
        "oversize_by_backend": oversize,
    }


async def test_security_report(
    s3_server: LocalS3Server, s3_bucket: str, tmp_path: Path, tiny: Tiny, caplog: pytest.LogCaptureFixture
) -> None:
    report = await build_report(tmp_path, s3_server, s3_bucket, SEED, tiny, caplog)
    if path := os.environ.get(REPORT_ENV):
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
    summary = {k: report[k] for k in list(report)[: list(report).index("seed")]}
    print(json.dumps(summary))
    where = f"seed {SEED}: {summary}"
    assert report["records_admitted_invalid"] == 0, (where, report["records_by_source"])
    assert report["crashes"] == 0, (where, report["records_by_source"], report["names_by_reader"])
    assert report["names_escaped"] == 0, (where, report["names_by_reader"])
    assert report["weights_forged_applied"] == 0, (where, report["weights_by_kind"])
    assert report["max_bytes_read_over_limit"] == 0, (where, report["oversize_by_backend"])
    for name in ("rollback_accepted", "downgrade_accepted", "registry_rollback_accepted", "state_rollback_accepted",
                 "heartbeat_forged_shown_healthy", "task_forged_accepted", "writer_stops_trainer", "honest_rejected_for_missing_object"):
        assert report[name] == 0, (name, where)
    assert report["rollback_tried"] == 2 * len(ROLLBACK_ATTACKS) + 2 and report["downgrade_tried"] == len(DOWNGRADE_ATTACKS)
    assert report["heartbeat_forged_tried"] == 7 and report["writer_tried"] == len(WRITER_ATTACKS), where
    assert report["task_forged_tried"] == 5, where
    assert report["junk_list_ratio"] <= junk.bench.TARGET_RATIO, where
    assert report["junk_state_bytes"] < junk.bench.TARGET_STATE_GROWTH, where
    assert report["skew_tried"] == 3 * clock.PER_WORKER and report["skew_rejected"] == 0, where
    assert report["slow_answer_admitted_ratio"] == 1.0, where
    assert report["oversize_tried"] == 2 * len(ov.cases()), where
    assert all(t["oversize_refused"] == t["oversize_tried"] for t in report["oversize_by_backend"].values()), report
    # The corpus is the size the report claims, and the checks can say yes: honest and
    # harmlessly mutated records are admitted (and agree with the reference).
    assert report["records_tried"] >= 300 and report["names_distinct"] >= 50, where
    assert report["names_tried"] >= 50 * 40, where
    by_source = report["records_by_source"]
    assert by_source["signed_honest"] == {"tried": 2, "admitted": 2}, by_source["signed_honest"]
    assert report["records_admitted_valid"] > 2, where
    for source in ("hostile_payloads", "hostile_frames", "hostile_episodes", "signed_attacks", "signed_mutated"):
        assert by_source[source]["tried"] == by_source[source].get("refused"), (source, by_source[source])
    kinds = report["weights_by_kind"]
    assert set(kinds) >= WEIGHT_KINDS, sorted(kinds)
    assert all(k["refused"] == k["tried"] for k in kinds.values()), kinds
    assert report["weights_forged_tried"] == 2 * len(CASES) == sum(k["tried"] for k in kinds.values())
    assert all(t["weights_forged_refused"] == len(CASES) for t in report["weights_by_backend"].values())


# -- the classifiers catch what they claim to -----------------------------------------------------------


def test_classify_record_counts_admissions_refusals_and_crashes() -> None:
    group = rh.GROUP

    def refuse() -> RolloutGroup:
        raise RecordError("type", "no")

    def undocumented() -> RolloutGroup:
        raise RecordError("not-a-reason", "no")

    def boom() -> RolloutGroup:
        raise IndexError("decoder bug")

    assert classify_record(refuse, lambda: None) == "refused"
    assert classify_record(undocumented, lambda: None) == "crash"
    assert classify_record(boom, lambda: group) == "crash"
    assert classify_record(lambda: group, lambda: group) == "admitted"
    assert classify_record(lambda: group, lambda: None) == "admitted_invalid"
    other = rh.make_group(seq=4)
    assert classify_record(lambda: other, lambda: group) == "admitted_invalid"
    # A decoder that accepts whatever it is given is caught by the reference on the mutations.
    sloppy = {s: Counter(classify_record(lambda: group, ref) for _, ref in items) for s, items in mutated_records(1).items()}
    assert all(c["admitted_invalid"] > 0 for c in sloppy.values()), sloppy


def test_an_admission_without_the_signature_check_is_caught() -> None:
    """The same attacks against a consumer that skips the signature check (as for an unsigned
    run): the report counts what it admits."""
    unchecked = dataclasses.replace(SignedAdmission.make(), registry=None)
    counts = records_report(signed_records(2, unchecked))
    assert counts["signed_honest"] == Counter(admitted=2)
    assert counts["signed_attacks"]["admitted_invalid"] > 0 and counts["signed_mutated"]["admitted_invalid"] > 0, counts
    assert not counts["signed_mutated"]["crash"], counts


def test_probe_name_counts_escapes_and_crashes(tmp_path: Path) -> None:
    assert probe_name(check_worker_id, "..") == "refused"
    assert probe_name(lambda n: n, "..") == "escaped"
    empty: dict[str, int] = {}
    assert probe_name(lambda n: empty[n], "..") == "crash"
    assert probe_name(lambda n: parsed(None), "..") == "refused"
    # The readers accept the good names: their refusals are of the hostile ones only.
    readers = name_readers(tmp_path)
    for label in ("check_name.file", "check_worker_id", "layout.rollout", "layout.heartbeat", "record.worker_id"):
        assert probe_name(readers[label], "mac-01") == "escaped", label


def test_mutations_are_seeded_and_distinct() -> None:
    donors = [rh.PAYLOAD]
    first = mutations(rh.PAYLOAD, donors, 5, 50)
    assert first == mutations(rh.PAYLOAD, donors, 5, 50) != mutations(rh.PAYLOAD, donors, 6, 50)
    assert len(set(first)) == 50 and rh.PAYLOAD not in first
