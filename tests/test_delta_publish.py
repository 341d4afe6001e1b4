"""Publishing by delta (`ChainPublisher.publish_delta`, `device_delta.PreviousState.sparse_step`),
torch on the CPU: a publisher that keeps no copy of the state writes, for the same sequence of
bf16 states, the same bytes as the full-state path (patches, anchors, manifests, pointers but for
attempt ids and clocks), over anchors, catch-ups and a restart, its quantized planes too (each
plane's step computed on the device, `PreviousState.plane_step`); a real Subscriber installs both
to the trainer's bits; a step from a stale base writes nothing; a lost pointer answer settles."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slime_stoa.protocol.layout import QuantPlane, RunLayout
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.frames import encode_delta
from slime_stoa.protocol.pulse.plane import plane_bits, plane_shapes
from slime_stoa.protocol.pulse.plane_siblings import PlaneSteps
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, PublishError, StaleBase
from slime_stoa.protocol.pulse.step_diff import sparse_digest
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.protocol.store.base import Payload
from slime_stoa.trainer.consumer.counting import CountingStore
from slime_stoa.trainer.device_delta import PreviousState, bf16_view
from tests.test_device_publish import RUN, committed_objects

CONFIG = PublisherConfig(anchor_every=4, shard_bytes=8 << 10, retain_anchors=0, planes=())
SHAPES = {
    "model.embed_tokens.weight": (96, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.self_attn.q_proj.weight": (64, 64),
    "model.norm.weight": (64,),
}


def initial_weights(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    weights = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in SHAPES.items()}
    weights["model.norm.weight"][:4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")])
    return weights


def train_step(weights: dict[str, Any], gen: Any, k: int) -> None:
    """An Adam-like step: a small move on a few percent of the elements, and for some versions a
    tensor left alone, a sign flip of a zero (bits differ, values equal) and a NaN payload."""
    for i, w in enumerate(weights.values()):
        if i == k % len(weights):
            continue  # one tensor unchanged this version
        mask = torch.rand(w.shape, generator=gen) < 0.03
        w.add_(torch.where(mask, torch.randn(w.shape, generator=gen) * 1e-3, 0.0).to(torch.bfloat16))
    norm = weights["model.norm.weight"].view(torch.int16)
    norm[1] ^= torch.tensor(-0x8000, dtype=torch.int16)  # -0.0 <-> 0.0
    norm[2] = torch.tensor(0x7FC1 + k, dtype=torch.int16)  # another NaN payload


def host_bits(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {name: bf16_view(name, w).numpy().view(np.uint16).copy() for name, w in weights.items()}


class Trainer:
    """The weights and one publisher of them: full host states, or deltas from a device copy."""

    def __init__(self, store: Store, by_delta: bool, planes: tuple[QuantPlane, ...] = ()) -> None:
        self.store, self.by_delta, self.planes = store, by_delta, planes
        # With planes every due catch-up is written: a plane's (scales and biases change nearly
        # everywhere) would not fit the default budget, and the test wants the planes' too.
        config = replace(CONFIG, planes=planes, catchup_budget=math.inf) if planes else CONFIG
        self.publisher = Publisher(store, RUN, config)
        self.previous = PreviousState()

    async def start(self, weights: dict[str, Any]) -> None:
        """Open (resume) or publish the first version; the delta path then keeps the published
        state only beside the weights."""
        if await self.publisher.open() is None:
            await self.publisher.publish(host_bits(weights))
        if self.by_delta:
            self.previous.reset_from_host(self.publisher.release_baseline(), "cpu")

    async def publish(self, weights: dict[str, Any]) -> Any:
        if not self.by_delta:
            return await self.publisher.publish(host_bits(weights))
        step = self.previous.sparse_step(self.previous.diff(weights))
        assert self.publisher.state_digest is not None
        planes = PlaneSteps(
            steps={p: self.previous.plane_step(p, None, "cpu") for p in self.planes},
            shapes={p: plane_shapes(SHAPES, p) for p in self.planes},
            committed={p: self.previous.plane_reader(p, None, "cpu") for p in self.planes},
        )
        result = await self.publisher.publish_delta(step, base=self.publisher.state_digest, planes=planes)
        self.previous.commit()
        return result


async def run_both(
    urls: tuple[str, str], versions: int, restart_at: int, planes: tuple[QuantPlane, ...] = ()
) -> list[Any]:
    weights, gen = initial_weights(), torch.Generator().manual_seed(1)
    results: list[Any] = []
    async with open_store(urls[0]) as full_store, open_store(urls[1]) as delta_store:
        trainers = [Trainer(full_store, False, planes), Trainer(delta_store, True, planes)]
        readers = [Subscriber(full_store, RUN), Subscriber(delta_store, RUN)]
        plane_readers = [(p, Subscriber(store, RUN, plane=p)) for p in planes for store in (full_store, delta_store)]
        for t in trainers:
            await t.start(weights)
        for k in range(1, versions + 1):
            if k == restart_at:  # a restarted trainer resumes from the bucket
                trainers = [Trainer(full_store, False, planes), Trainer(delta_store, True, planes)]
                for t in trainers:
                    await t.start(weights)
            train_step(weights, gen, k)
            pair = [await t.publish(weights) for t in trainers]
            results.append(pair)
            assert not trainers[1].publisher.weights.holds_state and trainers[1].publisher.weights.baseline == {}
            assert pair[0].planes == pair[1].planes == planes
            for chain in trainers[1].publisher.planes.values():  # no plane kept on the host either
                assert not chain.holds_state and chain.baseline == {} and chain.version == k
            expected = host_bits(weights)
            for reader in readers:
                assert await reader.sync() is not None
                assert reader.state is not None and reader.version == k
                for name, bits in expected.items():  # the installed state is the trainer's, bit for bit
                    assert np.array_equal(reader.state[name], bits), (k, name)
            for plane, reader in plane_readers:  # and each plane's is the trainer's state quantized
                assert await reader.sync() is not None and reader.version == k and reader.state is not None
                want = plane_bits(expected, plane)
                assert reader.state.keys() == want.keys()
                for name, bits in want.items():
                    assert np.array_equal(reader.state[name], bits), (k, plane, name)
            assert readers[0].digest == readers[1].digest
            assert trainers[0].publisher.state_digest == trainers[1].publisher.state_digest
            assert trainers[0].publisher.state_digest == StateDigest.of(expected).root()
    return results


@pytest.fixture
def buckets(tmp_path: Path) -> tuple[str, str]:
    for name in ("full", "delta"):
        (tmp_path / name).mkdir()
    return f"file://{tmp_path / 'full'}", f"file://{tmp_path / 'delta'}"


@pytest.mark.parametrize("planes", [(), ("int8", "int4")])
def test_publishing_by_delta_writes_the_full_paths_bytes(buckets: tuple[str, str], planes: tuple[QuantPlane, ...]) -> None:
    results = asyncio.run(run_both(buckets, versions=11, restart_at=6, planes=planes))
    anchored = [full.anchored for full, _ in results]
    assert any(anchored) and not all(anchored)  # anchors and patches both went through the delta path
    assert any(full.catchup_bytes for full, _ in results)  # and catch-ups
    for full, delta in results:
        assert (full.version, full.anchored, full.changed, full.patch_bytes, full.catchup_bytes, full.anchor_bytes) == (
            delta.version, delta.anchored, delta.changed, delta.patch_bytes, delta.catchup_bytes, delta.anchor_bytes
        )
    full_objects = asyncio.run(committed_objects(buckets[0], planes=planes))
    delta_objects = asyncio.run(committed_objects(buckets[1], planes=planes))
    assert len(full_objects) > 20
    for plane in planes:  # the planes' patches, catch-ups and anchors went through the delta path
        for kind in ("/step-", "/catchup-", "/anchors/"):
            assert any(k.startswith(f"runs/{RUN}/planes/{plane}/") and kind in k for k in full_objects), (plane, kind)
    assert full_objects.keys() == delta_objects.keys()
    for key, value in full_objects.items():
        assert delta_objects[key] == value, key


def test_the_step_patch_from_old_bits_is_the_one_from_the_base() -> None:
    rng = np.random.default_rng(3)
    base = {"a": rng.integers(0, 1 << 16, (300, 70), dtype=np.uint16), "b": rng.integers(0, 1 << 16, 50, dtype=np.uint16)}
    delta = {}
    for name, bits in base.items():
        indices = np.sort(rng.choice(bits.size, bits.size // 7, replace=False)).astype(np.int64)
        delta[name] = (indices, rng.integers(0, 1 << 16, indices.size, dtype=np.uint16))
    old = {name: base[name].reshape(-1)[indices] for name, (indices, _) in delta.items()}
    shapes = {name: bits.shape for name, bits in base.items()}
    for frame_bytes in (1 << 20, 2000):  # one frame; a tensor split over frames
        from_base = encode_delta(delta, shapes, base=base, mode="rel", frame_bytes=frame_bytes, threads=1)
        from_old = encode_delta(delta, shapes, old=old, mode="rel", frame_bytes=frame_bytes, threads=1)
        assert from_base[1] == from_old[1] and from_base[0] == from_old[0]
    with pytest.raises(ValueError, match="old bits"):
        encode_delta(delta, shapes, old={"a": old["a"], "b": old["b"][:3]}, mode="rel")


def test_sparse_digest_is_the_full_states_digest() -> None:
    weights = initial_weights()
    previous = PreviousState()
    previous.reset(weights)
    old_bits = host_bits(weights)
    before = StateDigest.of(old_bits)
    train_step(weights, torch.Generator().manual_seed(5), 2)
    step = previous.sparse_step(previous.diff(weights))
    assert sparse_digest(before, step, threads=2) == StateDigest.of(host_bits(weights))
    for name, (indices, _) in step.delta.items():  # the old bits are the previous version's
        assert np.array_equal(step.old[name], old_bits[name].reshape(-1)[indices])
    for name in SHAPES:  # each tensor on request is the new version's
        assert np.array_equal(step.tensor(name), host_bits(weights)[name])


def test_a_step_from_a_stale_base_writes_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with open_store(f"file://{tmp_path}") as store:
            weights = initial_weights()
            trainer = Trainer(store, by_delta=True)
            await trainer.start(weights)
            train_step(weights, torch.Generator().manual_seed(2), 1)
            step = trainer.previous.sparse_step(trainer.previous.diff(weights))
            keys = sorted([k async for k in _keys(store)])
            with pytest.raises(StaleBase):
                await trainer.publisher.publish_delta(step, base="0" * 32)
            assert sorted([k async for k in _keys(store)]) == keys
            with pytest.raises(RuntimeError, match="release_baseline"):
                await Publisher(store, RUN, CONFIG).weights.publish_delta(step, base="0" * 32)

    asyncio.run(main())


async def _keys(store: Store) -> Any:
    async for info in store.list(f"runs/{RUN}/"):
        yield info.key


class LoseAnswer(CountingStore):
    """Lets the next pointer write land but loses its answer, and fails the read that would tell."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.armed = False

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        etag = await super().put(key, data, if_match=if_match)
        if self.armed and key == RunLayout(RUN).pointer:
            self.armed = False
            raise StoreError("the answer was lost")
        return etag


def test_a_lost_pointer_answer_settles_by_digest(tmp_path: Path) -> None:
    """The retry of a version whose pointer write landed unanswered returns that version; a
    step diffed from the state before it once it is adopted is stale."""

    async def main() -> None:
        async with open_store(f"file://{tmp_path}") as inner:
            store = LoseAnswer(inner)
            weights, gen = initial_weights(), torch.Generator().manual_seed(4)
            trainer = Trainer(store, by_delta=True)
            await trainer.start(weights)
            train_step(weights, gen, 1)
            step = trainer.previous.sparse_step(trainer.previous.diff(weights))
            base = trainer.publisher.state_digest
            assert base is not None
            store.armed = True
            with pytest.raises(PublishError):
                await trainer.publisher.publish_delta(step, base=base)
            again = await trainer.publisher.publish_delta(step, base=base)  # the same version, retried
            assert again.version == 1 and trainer.publisher.state_digest == StateDigest.of(host_bits(weights)).root()
            trainer.previous.commit()
            train_step(weights, gen, 2)
            stale = trainer.previous.sparse_step(trainer.previous.diff(weights))
            with pytest.raises(StaleBase):
                await trainer.publisher.publish_delta(stale, base=base)
            result = await trainer.publisher.publish_delta(stale, base=trainer.publisher.state_digest)
            assert result.version == 2
            reader = Subscriber(inner, RUN)
            await reader.sync()
            assert reader.state is not None
            assert all(np.array_equal(reader.state[n], b) for n, b in host_bits(weights).items())

    asyncio.run(main())


class FailPlanePatch(CountingStore):
    """Fails the next upload of a patch of plane `plane` once armed."""

    def __init__(self, inner: Store, plane: str) -> None:
        super().__init__(inner)
        self.prefix, self.armed = f"runs/{RUN}/planes/{plane}/patches/", False

    async def put_if_absent(self, key: str, data: Payload) -> str:
        if self.armed and key.startswith(self.prefix):
            self.armed = False
            raise StoreError("the upload failed (injected)")
        return await super().put_if_absent(key, data)


def test_a_plane_left_behind_by_delta_is_stepped_as_the_full_path_steps_it(buckets: tuple[str, str]) -> None:
    """A plane whose step failed is left at the version before (the bf16 version and the other
    plane commit); before the next version it is stepped to the committed one, from its plane
    read back from the bucket and the device copy's plane, then on: the full-state path's bytes."""

    async def main() -> None:
        weights, gen = initial_weights(), torch.Generator().manual_seed(6)
        async with open_store(buckets[0]) as full_inner, open_store(buckets[1]) as delta_inner:
            stores = [FailPlanePatch(full_inner, "int4"), FailPlanePatch(delta_inner, "int4")]
            trainers = [Trainer(stores[0], False, ("int8", "int4")), Trainer(stores[1], True, ("int8", "int4"))]
            for t in trainers:
                await t.start(weights)
            for k in range(1, 4):
                train_step(weights, gen, k)
                for store in stores:
                    store.armed = k == 1
                results = [await t.publish(weights) for t in trainers]
                assert [r.planes for r in results] == [("int8",) if k == 1 else ("int8", "int4")] * 2, k
                int4 = trainers[1].publisher.planes["int4"]
                assert int4.version == (0 if k == 1 else k) and not int4.holds_state
            assert int4.head is not None and int4.head.anchor.version == 0  # stepped, not a new chain
            for plane in ("int8", "int4"):
                reader = Subscriber(delta_inner, RUN, plane=plane)  # type: ignore[arg-type]
                assert (await reader.sync()) is not None and reader.version == 3 and reader.state is not None
                for name, bits in plane_bits(host_bits(weights), plane).items():  # type: ignore[arg-type]
                    assert np.array_equal(reader.state[name], bits), (plane, name)

    asyncio.run(main())
    full_objects = asyncio.run(committed_objects(buckets[0], ("int8", "int4")))
    assert any("/planes/int4/patches/000000000001/step-" in key for key in full_objects)  # v1's, stepped late
    assert asyncio.run(committed_objects(buckets[1], ("int8", "int4"))) == full_objects


class LosePlaneAnswer(CountingStore):
    """Lets the next pointer write of plane `plane` land but loses its answer, once armed."""

    def __init__(self, inner: Store, plane: QuantPlane) -> None:
        super().__init__(inner)
        self.pointer, self.armed = RunLayout(RUN, plane).pointer, False

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        etag = await super().put(key, data, if_match=if_match)
        if self.armed and key == self.pointer:
            self.armed = False
            raise StoreError("the answer was lost (injected)")
        return etag


def test_a_plane_commit_whose_answer_was_lost_is_settled_and_stepped_on(buckets: tuple[str, str]) -> None:
    """A plane version whose pointer write landed without an answer is adopted before the next
    version's plane, which then goes as a step from it: the same bytes as the full-state path."""

    async def main() -> None:
        weights, gen = initial_weights(), torch.Generator().manual_seed(8)
        async with open_store(buckets[0]) as full_inner, open_store(buckets[1]) as delta_inner:
            stores = [LosePlaneAnswer(full_inner, "int8"), LosePlaneAnswer(delta_inner, "int8")]
            trainers = [Trainer(stores[0], False, ("int8",)), Trainer(stores[1], True, ("int8",))]
            for t in trainers:
                await t.start(weights)
            for k in range(1, 5):
                train_step(weights, gen, k)
                for store in stores:
                    store.armed = k == 2
                results = [await t.publish(weights) for t in trainers]
                assert [r.planes for r in results] == [() if k == 2 else ("int8",)] * 2, k
            for t in trainers:
                chain = t.publisher.planes["int8"]
                assert chain.version == 4 and chain.head is not None and chain.head.parent is not None  # one chain

    asyncio.run(main())
    full_objects = asyncio.run(committed_objects(buckets[0], ("int8",)))
    assert any("/planes/int8/patches/000000000003/step-" in key for key in full_objects)  # v3's plane: a step
    assert asyncio.run(committed_objects(buckets[1], ("int8",))) == full_objects
