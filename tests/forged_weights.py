"""Every kind of forged or corrupted weight object an attacker with a bucket token can write.

`honest_run` publishes a signed run (v0, v1), brings a victim subscriber to v1, then publishes
v2. Each `Case` rewrites part of the bucket as an attacker would (`mutate`); `run_case` lets the
victim (at v1, or a fresh one for the anchor cases) sync and reports whether the forgery was
refused and whether any forged bits were applied. `tally` counts `weights_forged_tried` and
`weights_forged_applied` over every case.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from slime_stoa.protocol.hf.safetensors_io import safetensors_bytes
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor import write_anchor
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.history import find_manifest, read_anchor_manifest, read_manifest, read_pointer
from slime_stoa.protocol.pulse.manifests import Pointer, Ref, VersionManifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncError, WeightsRefused
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey, sign_document
from slime_stoa.protocol.store import Store

SHAPES = {"embed": (64, 32), "layer.0.w": (48, 48), "norm": (100,)}


def random_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for name, shape in SHAPES.items()}


def step_state(state: dict[str, np.ndarray], rng: np.random.Generator, density: float = 0.05) -> dict[str, np.ndarray]:
    new = {name: bits.copy() for name, bits in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        where = rng.random(flat.size) < density
        flat[where] = rng.integers(0, 1 << 16, size=int(where.sum()), dtype=np.uint16)
    return new


@dataclass
class Honest:
    store: Store
    run: str
    key: SigningKey  # the run key
    attacker: SigningKey  # a key of the attacker's own
    publisher: Publisher
    victim: Subscriber  # at v1
    states: list[dict[str, np.ndarray]]  # v0, v1, v2

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run)

    def trust(self) -> RunTrust:
        return RunTrust(self.run, self.key.public)


async def honest_run(store: Store, run: str, rng: np.random.Generator) -> Honest:
    key, attacker = SigningKey.generate(), SigningKey.generate()
    manifest = RunManifest(run=run, model="tiny", task="synthetic", run_key=key.public.to_text())
    await store.put_if_absent(RunLayout(run).run_manifest, manifest.to_bytes(key))
    pub = Publisher(store, run, PublisherConfig(anchor_every=50), key=key)
    states = [random_state(rng)]
    await pub.publish(states[0])
    states.append(step_state(states[0], rng))
    await pub.publish(states[1])
    victim = Subscriber(store, run, trust=RunTrust(run, key.public))
    await victim.sync()
    assert victim.version == 1
    states.append(step_state(states[1], rng))
    await pub.publish(states[2])
    return Honest(store, run, key, attacker, pub, victim, states)


# -- what an attacker writes -------------------------------------------------------------------------


async def _raw(h: Honest, key: str) -> dict:
    return json.loads(await h.store.get_bytes(key))


async def _put_json(h: Honest, key: str, doc: dict) -> None:
    await h.store.put(key, json.dumps(doc, sort_keys=True).encode())


def _unsigned(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "signature"}


def _claiming(doc: dict, h: Honest) -> dict:
    """Signed by the attacker, but naming the run key's id."""
    forged = sign_document(_unsigned(doc), h.attacker)
    forged["signature"]["key"] = h.key.key_id
    return forged


def _tampered(doc: dict) -> dict:
    return {**doc, "created_at" if "created_at" in doc else "updated_at": 12345.0}


def _doc_case(where: Callable[[Honest], Awaitable[str]], change: Callable[[dict, Honest], dict]):
    async def mutate(h: Honest) -> None:
        key = await where(h)
        await _put_json(h, key, change(await _raw(h, key), h))

    return mutate


async def _pointer_key(h: Honest) -> str:
    return h.layout.pointer


async def _version_key(h: Honest) -> str:
    return (await read_pointer(h.store, h.run)).manifest


async def _anchor_key(h: Honest) -> str:
    return (await read_pointer(h.store, h.run)).anchor.manifest


async def _patch_keys(h: Honest) -> list[str]:
    manifest = await read_manifest(h.store, await _version_key(h))
    return [p.key for p in manifest.patches]


async def _flip_patches(h: Honest) -> None:
    for key in await _patch_keys(h):
        body = bytearray(await h.store.get_bytes(key))
        body[len(body) // 2] ^= 0x40
        await h.store.put(key, bytes(body))


async def _replace_patches(h: Honest) -> None:
    """Each of v2's patches replaced by another honest-looking patch body (v1's step patch)."""
    v1 = await find_manifest(h.store, h.run, 1)
    other = await h.store.get_bytes(v1.patches[0].key)
    for key in await _patch_keys(h):
        await h.store.put(key, other)


async def _anchor_files(h: Honest):
    return (await read_anchor_manifest(h.store, await _anchor_key(h))).weights


async def _flip_anchor_file(h: Honest) -> None:
    for f in await _anchor_files(h):
        data = bytearray(await h.store.get_bytes(f.key))
        data[-1] ^= 0x01
        await h.store.put(f.key, bytes(data))


async def _replace_anchor_file(h: Honest) -> None:
    """The shard replaced by the attacker's own weights in the same shapes (same size)."""
    own = random_state(np.random.default_rng(99))
    for f in await _anchor_files(h):
        await h.store.put(f.key, safetensors_bytes(own, metadata={"format": "pt"}))


def _own_anchor(sign: bool):
    """The attacker publishes a full anchor of its own weights as v3 and moves the pointer."""

    async def mutate(h: Honest) -> None:
        own = random_state(np.random.default_rng(7))
        digest = StateDigest.of(own).root()
        key = h.attacker if sign else None
        attempt = "a77ac4e1"
        anchor_key, anchor = await write_anchor(
            h.store, h.layout, version=3, attempt=attempt, state=own, state_digest=digest, key=key
        )
        head = await read_pointer(h.store, h.run)
        manifest = VersionManifest(
            run=h.run, version=3, attempt=attempt, state_digest=digest,
            parent=Ref(version=2, manifest=head.manifest, state_digest=head.state_digest),
            anchor=Ref(version=3, manifest=anchor_key, state_digest=digest),
            anchor_bytes=anchor.total_bytes, since_anchor_bytes=0, patches=(), elements=head_elements(h),
            created_at=1.0,
        )
        manifest_key = h.layout.version_manifest(3, attempt)
        await h.store.put(manifest_key, manifest.to_bytes(key))
        pointer = Pointer(
            run=h.run, version=3, state_digest=digest, manifest=manifest_key,
            anchor=Ref(version=3, manifest=anchor_key, state_digest=digest), updated_at=1.0,
        )
        await h.store.put(h.layout.pointer, pointer.to_bytes(key))

    return mutate


def head_elements(h: Honest) -> int:
    return int(sum(a.size for a in h.states[0].values()))


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "pointer", "version manifest", "anchor manifest", "patch", "anchor file", "own anchor"
    mutate: Callable[[Honest], Awaitable[None]]
    fresh: bool = False  # the victim is a fresh subscriber (the anchor path), not the one at v1


CASES: tuple[Case, ...] = (
    Case("own anchor, unsigned", "own anchor", _own_anchor(sign=False)),
    Case("own anchor, attacker-signed", "own anchor", _own_anchor(sign=True)),
    Case("pointer unsigned", "pointer", _doc_case(_pointer_key, lambda d, h: _unsigned(d))),
    Case("pointer signed by another key", "pointer", _doc_case(_pointer_key, lambda d, h: sign_document(_unsigned(d), h.attacker))),
    Case("pointer claiming the run key", "pointer", _doc_case(_pointer_key, _claiming)),
    Case("pointer tampered", "pointer", _doc_case(_pointer_key, lambda d, h: _tampered(d))),
    Case("version manifest unsigned", "version manifest", _doc_case(_version_key, lambda d, h: _unsigned(d))),
    Case("version manifest signed by another key", "version manifest",
         _doc_case(_version_key, lambda d, h: sign_document(_unsigned(d), h.attacker))),
    Case("version manifest claiming the run key", "version manifest", _doc_case(_version_key, _claiming)),
    Case("version manifest tampered", "version manifest", _doc_case(_version_key, lambda d, h: _tampered(d))),
    Case("anchor manifest unsigned", "anchor manifest", _doc_case(_anchor_key, lambda d, h: _unsigned(d)), fresh=True),
    Case("anchor manifest signed by another key", "anchor manifest",
         _doc_case(_anchor_key, lambda d, h: sign_document(_unsigned(d), h.attacker)), fresh=True),
    Case("anchor manifest tampered", "anchor manifest", _doc_case(_anchor_key, lambda d, h: _tampered(d)), fresh=True),
    Case("patches corrupted", "patch", _flip_patches),
    Case("patches replaced", "patch", _replace_patches),
    Case("anchor file corrupted", "anchor file", _flip_anchor_file, fresh=True),
    Case("anchor file replaced by other weights", "anchor file", _replace_anchor_file, fresh=True),
)


@dataclass(frozen=True)
class Outcome:
    refused: bool  # the sync raised WeightsRefused and counted the refusal
    applied: bool  # the victim's state moved off its last verified weights
    version: int | None
    message: str


async def run_case(h: Honest, case: Case) -> Outcome:
    """Apply `case` to the honest run and let its victim sync once."""
    victim = Subscriber(h.store, h.run, trust=h.trust()) if case.fresh else h.victim
    before = None if victim.state is None else {k: v.copy() for k, v in victim.state.items()}
    digest = victim.digest.root() if victim.digest else None
    refused_before = victim.refused
    await case.mutate(h)
    message, refused = "", False
    try:
        await victim.sync()
    except WeightsRefused as exc:
        refused, message = victim.refused > refused_before, str(exc)
    except SyncError as exc:
        message = f"not refused as a forgery: {exc}"
    if before is None:
        applied = victim.state is not None
    else:
        assert victim.state is not None
        applied = (victim.digest.root() if victim.digest else None) != digest or any(
            not np.array_equal(before[k], victim.state[k]) for k in before
        )
    return Outcome(refused, applied, victim.version, message)


async def tally(store_factory: Callable[[str], Awaitable[Store]], seed: int = 0) -> dict[str, int]:
    """`weights_forged_tried` / `weights_forged_applied` (and refused) over every case, each in
    a fresh run of the store `store_factory(run)` returns."""
    counts = {"weights_forged_tried": 0, "weights_forged_applied": 0, "weights_forged_refused": 0}
    for i, case in enumerate(CASES):
        run = f"forged-{i}"
        h = await honest_run(await store_factory(run), run, np.random.default_rng(seed + i))
        outcome = await run_case(h, case)
        counts["weights_forged_tried"] += 1
        counts["weights_forged_applied"] += int(outcome.applied)
        counts["weights_forged_refused"] += int(outcome.refused)
    return counts
