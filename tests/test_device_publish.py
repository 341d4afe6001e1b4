"""The slime hook's device path (`stoa_device_budget_bytes`, `trainer.slime.device_publish`), torch on
the CPU: the versions it publishes are byte for byte the numpy path's in the bucket (patches,
anchors, planes, manifests and pointers but for attempt ids and clocks) over an anchor, a failed
publish that is retried, a pointer write whose answer was lost (a version the trainer does not
know committed), a resume that restores an older checkpoint; and only the patch leaves the device
for every version but a run's first.

`publish_weights` runs against the stand-in for slime of tests/test_slime_hook.py, publishing in
the background (the default), through a store that injects the faults."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
from argparse import Namespace
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.codec import diff
from slime_stoa.protocol.pulse.manifests import Pointer
from slime_stoa.protocol.pulse.plane import plane_bits
from slime_stoa.protocol.pulse.publisher import PublisherConfig, PublishError, PublishResult, StaleBase
from slime_stoa.protocol.pulse.quant import plane_names
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.protocol.store.base import Payload
from slime_stoa.trainer.consumer.counting import CountingStore
from slime_stoa.trainer.slime import publish as slime_hook
from slime_stoa.trainer.slime.device_publish import DeviceDelta, DevicePath
from slime_stoa.trainer.slime.hf_names import EMBEDDING, TIED_HEAD, HeadPlan
from slime_stoa.trainer.slime.publish import Handoff, HostCollector, SyncPublisher
from tests.conftest import wait_until
from tests.test_slime_hook import FakeBackuper, fake_slime  # noqa: F401 - the fixture (pytest finds it by name)

RUN = "dev"
CONFIG = PublisherConfig(anchor_every=3, planes=("int8", "int4"), shard_bytes=8 << 10, retain_anchors=0)
SHAPES = {
    "embed_tokens.weight": (128, 64),
    "layers.0.mlp.up_proj.weight": (128, 64),
    "layers.0.self_attn.q_proj.weight": (64, 64),
    "norm.weight": (64,),
}
PUBLISHED = ["model." + name for name in SHAPES]  # the stand-in's HF names


class UntiedConfig:  # an HF config with its own output head (no head plan)
    tie_word_embeddings = False


class FaultStore(CountingStore):
    """The real store, failing once where the test arms it: `patch` fails the next bf16 patch
    upload; `lose` lets the next pointer write land but loses its answer, and the pointer read
    that would have told fails too."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.armed: set[str] = set()
        self.pointer = RunLayout(RUN).pointer

    async def put_if_absent(self, key: str, data: Payload) -> str:
        if "patch" in self.armed and key.startswith(f"runs/{RUN}/patches/"):
            self.armed.discard("patch")
            raise StoreError("the upload failed (injected)")
        return await super().put_if_absent(key, data)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        etag = await super().put(key, data, if_match=if_match)
        if "lose" in self.armed and key == self.pointer:
            self.armed.discard("lose")
            self.armed.add("pointer read")
            raise StoreError("the answer was lost (injected)")
        return etag

    async def get(self, key: str, **kw: Any) -> Any:
        if "pointer read" in self.armed and key == self.pointer:
            self.armed.discard("pointer read")
            raise StoreError("the pointer did not read (injected)")
        return await super().get(key, **kw)


class FaultPublisher(SyncPublisher):
    faults: FaultStore
    handed: list[str]  # what each version was handed over as: "dict" (a host state) or "DeviceDelta"

    async def _open_store(self, environ: Any, create: bool) -> Store:
        self.faults = FaultStore(open_store(self.url))
        return self.faults

    def submit(self, state: Any, **kw: Any) -> Handoff:
        self.handed.append(type(state).__name__)
        return super().submit(state, **kw)


def int16(tensor: Any) -> Any:
    return tensor.view(torch.int16)


def bits_of(weights: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"model." + n: int16(t).numpy().view(np.uint16).copy() for n, t in weights.items()}


def step(weights: dict[str, Any], rng: np.random.Generator, names: list[str]) -> None:
    """A training step that changes about 5% of the elements of `names`, in place."""
    for name in names:
        flat = int16(weights[name]).reshape(-1)
        where = torch.from_numpy(rng.random(flat.numel()) < 0.05)
        flat[where] ^= 1


class Trainer:
    """One run of the scenario: the hook, its publisher (device path or not) and its bucket."""

    def __init__(self, url: str, budget: int | None, config: PublisherConfig = CONFIG) -> None:
        self.url, self.budget, self.config = url, budget, config
        self.handed: list[str] = []
        self.holds: list[bool] = []  # per committed version: the publisher kept a host state
        rng = np.random.default_rng(11)
        self.weights = {  # finite weights: the planes quantize them
            n: torch.from_numpy(rng.standard_normal(s, dtype=np.float32) * 0.02).to(torch.bfloat16)
            for n, s in SHAPES.items()
        }
        self.actor = Namespace(weights_backuper=FakeBackuper(self.weights), hf_config=UntiedConfig(), model=[object()])
        self.args = Namespace(
            stoa_publish=True, stoa_bucket=url, stoa_run=RUN, model_name=None, offload_train=False,
            untie_embeddings_and_output_weights=True,
        )
        self.publisher = self.start()
        self.moved: list[int] = []  # bytes device -> host per gather (device path)

    def start(self) -> FaultPublisher:
        device = DevicePath(self.budget) if self.budget is not None else None
        publisher = FaultPublisher(self.url, RUN, self.config, retries=1, backoff_s=0, device=device)
        publisher.handed = self.handed
        slime_hook._PUBLISHER = publisher  # what get_publisher returns (closed by the fixture)
        return publisher

    def restart(self) -> None:
        """The trainer process restarts: a new publisher, and a new device path, resuming."""
        self.publisher.close()
        self.publisher = self.start()

    def publish(self) -> Handoff:
        device = self.publisher.device
        before = device.transfer.device_to_host if device is not None else 0
        handoff = slime_hook.publish_weights(self.actor, self.args)
        assert isinstance(handoff, Handoff)
        self.moved.append(device.transfer.device_to_host - before if device is not None else 0)
        return handoff

    def committed(self) -> PublishResult:
        self.publisher.wait()
        assert self.publisher.last is not None and self.publisher._publisher is not None
        self.holds.append(self.publisher._publisher.weights.holds_state)
        return self.publisher.last


Gather = tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray]]


def scenario(trainer: Trainer) -> tuple[list[tuple[int, bool, int, int | None]], list[Gather]]:
    """The versions the trainer publishes, (version, anchored, changed, restored_from) each, and
    each gather's (the last state it knew committed (None: none), the state it gathered)."""
    rng = np.random.default_rng(5)
    w = trainer.weights
    names = list(SHAPES)
    results: list[tuple[int, bool, int, int | None]] = []
    gathers: list[Gather] = []
    committed: list[dict[str, np.ndarray]] = []  # the states of the versions the trainer knows committed

    def version() -> None:
        trainer.publish()
        result = trainer.committed()
        gathers.append((committed[-1] if committed else None, bits_of(w)))
        committed.append(bits_of(w))
        results.append((result.version, result.anchored, result.changed, result.restored_from))

    version()  # v0: the run's first version, an anchor
    for _ in range(3):  # v1..v3 (v3 an anchor: anchor_every)
        step(w, rng, names)
        version()
    step(w, rng, names)
    trainer.publisher.faults.armed.add("patch")
    version()  # v4: its first try fails, the retry commits it
    before_lost = {n: int16(t).clone() for n, t in w.items()}
    step(w, rng, names[:2])
    trainer.publisher.faults.armed.add("lose")
    trainer.publish()  # v5: its pointer write lands, but no answer says so (twice): it fails
    gathers.append((committed[-1], bits_of(w)))
    device = trainer.publisher.device
    inflight = trainer.publisher._inflight
    assert inflight is not None
    concurrent.futures.wait([inflight])  # v5's publish reads from the device by delta: let it end first
    moved = device.transfer.device_to_host if device is not None else 0
    with pytest.raises(PublishError):  # raised by the next call, which gathers (collectively) and keeps nothing
        slime_hook.publish_weights(trainer.actor, trainer.args)
    assert device is None or device.transfer.device_to_host == moved
    # The next step undoes v5's change of the embedding: unchanged since v4, which the trainer
    # believes is the committed version, but not since v5, which the publisher settles first.
    int16(w["embed_tokens.weight"]).copy_(before_lost["embed_tokens.weight"])
    step(w, rng, names[2:])
    version()  # v6
    trainer.restart()  # the trainer restarts from an older checkpoint: v2's weights
    for name, bits in committed[2].items():
        int16(w[name.removeprefix("model.")]).copy_(torch.from_numpy(bits.view(np.int16)))
    version()  # v7 restores v2 (a new branch)
    step(w, rng, names)
    version()  # v8
    assert [r[0] for r in results] == [0, 1, 2, 3, 4, 6, 7, 8]
    return results, gathers


async def committed_objects(url: str, planes: tuple[str, ...] = CONFIG.planes or ()) -> dict[str, Any]:
    """Everything the run's pointers reach (version and anchor manifests, patches, anchor
    shards, the planes'), by key, with each attempt id and clock taken out: what a reader sees."""
    attempt = re.compile(r"(\d{12})-[0-9a-f]{8}")
    out: dict[str, Any] = {}

    def strip(doc: Any, found: list[str]) -> Any:
        if isinstance(doc, dict):
            return {k: strip(v, found) for k, v in doc.items() if k not in ("attempt", "created_at", "updated_at")}
        if isinstance(doc, list):
            return [strip(v, found) for v in doc]
        if isinstance(doc, str) and doc.startswith(f"runs/{RUN}/"):
            found.append(doc)
            return attempt.sub(r"\1", doc)
        return doc

    async with open_store(url) as store:
        todo = [RunLayout(RUN).pointer] + [RunLayout(RUN, p).pointer for p in planes]  # type: ignore[arg-type]
        while todo:
            key = todo.pop()
            name = attempt.sub(r"\1", key)
            if name in out:
                continue
            data = await store.get_bytes(key)
            if key.endswith(".json"):
                found: list[str] = []
                out[name] = strip(json.loads(data), found)
                todo += found
            else:
                out[name] = data
    return out


@pytest.fixture
def buckets(tmp_path: Path) -> tuple[str, str]:
    for name in ("numpy", "device"):
        (tmp_path / name).mkdir()
    return f"file://{tmp_path / 'numpy'}", f"file://{tmp_path / 'device'}"


@pytest.mark.parametrize("budget", [0, 1 << 30])  # the previous version in host memory / beside the weights
def test_with_planes_the_device_path_publishes_the_numpy_paths_bytes_by_delta(
    fake_slime, buckets: tuple[str, str], budget: int  # noqa: F811
) -> None:
    """With quantized planes too, the publisher hands its state to the device path once a version
    is committed (or resumed) and keeps none, nor any plane's: each plane of a version goes by its
    change computed on the device (a step), or, where the plane is not one step behind (v6: its
    v5 never published), as a new chain from an anchor read from the device one tensor at a time.
    The bucket holds the numpy path's objects over plane anchors, the failures and the restart."""
    numpy_url, device_url = buckets
    numpy_trainer = Trainer(numpy_url, None)
    want, _ = scenario(numpy_trainer)
    device = Trainer(device_url, budget)
    got, _ = scenario(device)
    assert got == want
    assert [r[1] for r in want] == [True, False, False, True, False, True, False, False]  # v0, v3, v6
    assert want[6][3] == 2 and want[5][3] is None  # v7 restores v2

    numpy_objects = asyncio.run(committed_objects(numpy_url))
    device_objects = asyncio.run(committed_objects(device_url))
    assert device_objects.keys() == numpy_objects.keys()
    for plane in CONFIG.planes or ():
        for kind in ("patches", "anchors"):  # (catch-ups: tests/test_delta_publish.py)
            assert any(f"/planes/{plane}/{kind}/" in k for k in numpy_objects), (plane, kind)
        assert any(k.startswith(f"runs/{RUN}/planes/{plane}/anchors/000000000006/") for k in numpy_objects)
    for key, value in numpy_objects.items():
        assert device_objects[key] == value, key

    assert device.handed == ["dict"] + ["DeviceDelta"] * 8 and numpy_trainer.handed == ["dict"] * 9
    assert device.holds == [False] * 8 and numpy_trainer.holds == [True] * 8
    publisher = device.publisher._publisher
    assert publisher is not None and set(publisher.planes) == set(CONFIG.planes or ())
    for chain in publisher.planes.values():
        assert chain.version == 8 and not chain.holds_state and not chain.baseline
    for plane in CONFIG.planes or ():  # a real Subscriber on each plane installs the trainer's plane
        version, state = asyncio.run(installed(device_url, plane))
        assert version == 8
        want_plane = plane_bits(bits_of(device.weights), plane)
        assert state.keys() == want_plane.keys()
        for name, bits in want_plane.items():
            assert np.array_equal(state[name], bits), (plane, name)


BY_DELTA = replace(CONFIG, planes=())  # no quantized planes: the device path publishes by delta


async def installed(url: str, plane: str | None = None) -> tuple[int | None, dict[str, np.ndarray]]:
    """What a real Subscriber installs from the bucket at `url` (its version and state; a plane's
    held bits with `plane`)."""
    async with open_store(url) as store:
        sub = Subscriber(store, RUN, plane=plane)  # type: ignore[arg-type]
        await sub.sync()
        return sub.version, dict(sub.state or {})


@pytest.mark.parametrize("budget", [0, 1 << 30])  # the previous version in host memory / beside the weights
def test_by_delta_the_device_path_publishes_the_numpy_paths_bytes_keeping_no_host_state(
    fake_slime, buckets: tuple[str, str], budget: int, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Without planes the publisher hands its state to the device path once a version is
    committed (or resumed) and each version goes by `publish_delta`: the same bucket objects
    over anchors, a retried failure, a lost pointer answer (the next version's base is stale:
    rebuilt from the bucket, diffed again) and a restart that restores v2."""
    numpy_url, device_url = buckets
    numpy_trainer = Trainer(numpy_url, None, BY_DELTA)
    want, _ = scenario(numpy_trainer)
    device = Trainer(device_url, budget, BY_DELTA)
    with caplog.at_level(logging.INFO):
        got, _ = scenario(device)
    assert got == want
    numpy_objects = asyncio.run(committed_objects(numpy_url, ()))
    assert asyncio.run(committed_objects(device_url, ())) == numpy_objects

    # v0 is a host state (a new run's anchor); every later version is handed as the device's
    # delta, and from v0's commit on the publisher keeps no state (the numpy path keeps one).
    assert device.handed == ["dict"] + ["DeviceDelta"] * 8  # v1..v6 (v5 did not commit), v7, v8
    assert numpy_trainer.handed == ["dict"] * 9
    assert device.holds == [False] * 8 and numpy_trainer.holds == [True] * 8
    path = device.publisher.device
    assert path is not None and path.released is None  # the released state was dropped at the gather
    committed = device.publisher.committed()
    assert committed is not None and committed.version == 8 and not committed.baseline
    # v6's base was v4 (v5's answer was lost, then v5 turned out committed): StaleBase, the copy
    # brought to v5 by v5's step, where it lives, and v6 diffed again
    assert caplog.text.count("bringing the device's copy to v5 by its step") == 1
    assert "rebuilding the device's copy from the bucket" not in caplog.text

    # a real Subscriber installs the trainer's bits
    version, state = asyncio.run(installed(device_url))
    assert version == 8
    assert state.keys() == set(PUBLISHED)
    for name, bits in bits_of(device.weights).items():
        assert np.array_equal(state[name], bits), name


def test_a_device_copy_behind_the_committed_state_is_rebuilt_from_the_bucket(
    fake_slime, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """The device's copy is not the committed state and no known step leads there (here: put back
    to v0 while v2 is committed): the stale step writes nothing, the copy is rebuilt from the
    committed state read back from the bucket, and the version published is the trainer's."""
    url = f"file://{tmp_path}"
    trainer = Trainer(url, 1 << 30, BY_DELTA)
    rng = np.random.default_rng(6)
    trainer.publish()
    trainer.committed()
    assert trainer.publisher._publisher is not None
    v0 = bits_of(trainer.weights), trainer.publisher._publisher.state_digest
    for _ in range(2):
        step(trainer.weights, rng, list(SHAPES))
        trainer.publish()
        trainer.committed()
    path = trainer.publisher.device
    assert path is not None and v0[1] is not None
    path.previous.reset_from_host(v0[0], "cpu")
    path.held = v0[1]
    step(trainer.weights, rng, list(SHAPES)[1:])
    with caplog.at_level(logging.WARNING):
        trainer.publish()
        result = trainer.committed()
    assert result.version == 3 and result.restored_from is None
    assert caplog.text.count("rebuilding the device's copy from the bucket's v2") == 1
    version, state = asyncio.run(installed(url))
    assert version == 3
    for name, bits in bits_of(trainer.weights).items():
        assert np.array_equal(state[name], bits), name
    step(trainer.weights, rng, list(SHAPES))  # and the copy goes on from there
    trainer.publish()
    assert trainer.committed().version == 4
    version, state = asyncio.run(installed(url))
    assert version == 4 and all(np.array_equal(state[n], b) for n, b in bits_of(trainer.weights).items())


def test_by_delta_the_pointer_keeper_re_signs_between_publishes(tmp_path: Path) -> None:
    """Publishes by delta hold the keeper's lock: with the keeper re-signing every 10 ms each
    version commits (no refresh takes its ETag), and the keeper keeps the last one fresh."""
    url = f"file://{tmp_path}"
    pointer_key = RunLayout(RUN).pointer

    def pointer() -> Pointer:
        async def read() -> Pointer:
            async with open_store(url) as store:
                return Pointer.from_bytes(await store.get_bytes(pointer_key), pointer_key, run=RUN)
        return asyncio.run(read())

    rng = np.random.default_rng(9)
    tensors = {"model." + n: torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to(torch.bfloat16)
               for n, s in SHAPES.items()}
    device = DevicePath(0)
    with SyncPublisher(url, RUN, BY_DELTA, device=device, refresh_s=0.01) as publisher:
        for v in range(4):
            collector = device.collector(publisher)(HeadPlan())
            collector.add(list(tensors.items()))
            state = collector.finish()
            assert isinstance(state, DeviceDelta) == (v > 0)
            assert publisher.publish(state).version == v
            for t in tensors.values():
                int16(t).reshape(-1)[v :: 97] ^= 1
        published = pointer()
        assert published.version == 3
        wait_until(lambda: pointer().updated_at > published.updated_at, message="v3 re-signed")
        assert pointer().manifest == published.manifest


def test_with_planes_only_the_patches_cross_at_the_gather_and_the_changed_tensors_at_the_publish(
    tmp_path: Path,
) -> None:
    """By delta with planes, a gather moves to the host only each patch: the bf16 delta (int32
    indices and bf16 values), its old bits, and each plane's delta and old bits; the publish then
    reads, one at a time, each changed bf16 tensor and the plane arrays of each bf16 tensor whose
    plane changed (their digests), one quantization each. Neither the publisher nor a plane's
    chain keeps a state."""
    rng = np.random.default_rng(12)
    tensors = {"model." + n: torch.from_numpy(rng.standard_normal(s, dtype=np.float32) * 0.02).to(torch.bfloat16)
               for n, s in SHAPES.items()}
    config = replace(CONFIG, anchor_every=50, threads=1)  # one reader: each plane tensor quantized once
    device = DevicePath(0)
    planes = config.planes or ()
    with SyncPublisher(f"file://{tmp_path}", RUN, config, device=device) as publisher:
        base: dict[str, np.ndarray] | None = None
        for v in range(4):
            bits = {n: int16(t).numpy().view(np.uint16).copy() for n, t in tensors.items()}
            before = device.transfer.device_to_host
            collector = device.collector(publisher)(HeadPlan())
            collector.add(list(tensors.items()))
            state = collector.finish()
            at_gather = device.transfer.device_to_host - before
            before = device.transfer.device_to_host
            assert publisher.publish(state).version == v
            at_publish = device.transfer.device_to_host - before
            if v == 0:
                assert not isinstance(state, DeviceDelta) and at_gather == sum(b.nbytes for b in bits.values())
            else:
                assert isinstance(state, DeviceDelta) and base is not None
                bf16 = diff(base, bits)
                patch = 8 * sum(indices.size for indices, _ in bf16.values())
                read = sum(bits[name].nbytes for name in bf16)
                for plane in planes:
                    before_plane, after_plane = plane_bits(base, plane), plane_bits(bits, plane)
                    changed = diff(before_plane, after_plane)
                    patch += 8 * sum(indices.size for indices, _ in changed.values())
                    owners = {n for n in bits if {n, *plane_names(n)[1:]} & changed.keys()}
                    read += sum(after_plane[k].nbytes for n in owners for k in {n, *plane_names(n)[1:]} & after_plane.keys())
                assert at_gather == patch, v
                assert at_publish == read, v
                whole = sum(b.nbytes for b in bits.values()) + sum(
                    b.nbytes for plane in planes for b in plane_bits(bits, plane).values()
                )
                assert at_gather < whole / 10 and at_publish < whole, v  # 1% of two of four tensors changed
            inner = publisher._publisher
            assert inner is not None and not inner.weights.holds_state
            assert all(not chain.holds_state and chain.version == v for chain in inner.planes.values())
            base = bits
            for name in list(tensors)[v % 2 :: 2]:  # two of the four tensors change
                int16(tensors[name]).reshape(-1)[v :: 97] ^= 1


def test_a_restarted_publisher_by_delta_rebuilds_the_copy_from_what_it_resumed(
    fake_slime, tmp_path: Path  # noqa: F811
) -> None:
    """A resumed publisher releases the state it synced from the bucket at open; the device's
    copy is rebuilt from it at the first gather, and the copy advances with each commit."""
    trainer = Trainer(f"file://{tmp_path}", 1 << 30, BY_DELTA)
    rng = np.random.default_rng(4)
    trainer.publish()
    trainer.committed()
    trainer.restart()
    trainer.publisher.open()
    path = trainer.publisher.device
    assert path is not None and path.released is not None and path.held is None
    assert trainer.publisher._publisher is not None and not trainer.publisher._publisher.weights.holds_state
    released = path.released[1]
    assert isinstance(released, dict) and released.keys() == set(PUBLISHED)
    for _ in range(2):
        step(trainer.weights, rng, list(SHAPES)[:2])
        trainer.publish()
        result = trainer.committed()
        assert path.released is None and path.held == trainer.publisher._publisher.state_digest
        assert released == {}  # each tensor left the released state as the copy took it
        copy = {name: path.previous.previous_bits(name) for name in path.previous.names}
        assert copy.keys() == set(PUBLISHED)
        for name, bits in bits_of(trainer.weights).items():  # the copy is the committed version
            assert np.array_equal(copy[name], bits), name
    assert result.version == 2 and trainer.handed == ["dict", "DeviceDelta", "DeviceDelta"]


def test_previous_state_streams_a_gather() -> None:
    """`begin`, `diff_tensor` and `end` give `codec.diff`'s delta a tensor at a time; a version
    that did not commit is discarded; the copy rebuilt from host bits diffs as one from tensors."""
    rng = np.random.default_rng(8)
    base = {n: rng.integers(0, 1 << 15, s, dtype=np.uint16) for n, s in SHAPES.items()}
    new = {n: b.copy() for n, b in base.items()}
    new["norm.weight"][3] ^= 1
    new["embed_tokens.weight"][0, :5] ^= 4
    tensors = {n: torch.from_numpy(b.view(np.int16).copy()) for n, b in new.items()}
    previous = DevicePath(0).previous
    previous.reset_from_host(base, "cpu")
    previous.begin()
    delta = {}
    for name in reversed(SHAPES):  # the chunks' order, not sorted
        if (entry := previous.diff_tensor(name, tensors[name])) is not None:
            delta[name] = entry
    previous.end()
    want = diff(base, new)
    assert delta.keys() == want.keys()
    for name, (indices, values) in want.items():
        assert np.array_equal(delta[name][0], indices) and np.array_equal(delta[name][1], values)
    previous.discard()  # not committed: the copy stays the base
    with pytest.raises(RuntimeError, match="commit"):
        previous.commit()
    assert previous.diff(tensors).keys() == want.keys()
    previous.begin()
    previous.diff_tensor("norm.weight", tensors["norm.weight"])
    with pytest.raises(ValueError, match=r"missing \['embed_tokens.weight'"):
        previous.end()
    with pytest.raises(ValueError, match="'extra' is not in the previous version"):
        previous.diff_tensor("extra", tensors["norm.weight"])
    with pytest.raises(ValueError, match=r"shape \(64,\) != \(64, 64\)"):
        previous.diff_tensor("norm.weight", tensors["layers.0.self_attn.q_proj.weight"])
    indices, values = previous.diff_against("embed_tokens.weight", tensors["embed_tokens.weight"])
    assert np.array_equal(indices, want["embed_tokens.weight"][0])


# -- the output head's plans --------------------------------------------------------------------
def chunk_versions() -> list[list[tuple[str, Any]]]:
    """Three versions of a tied model's gathered chunks, the last stage's output head included
    (kept equal to the embedding, except in one element of the last version)."""
    rng = np.random.default_rng(3)
    embed = torch.from_numpy(rng.standard_normal((64, 64), dtype=np.float32) * 0.02).to(torch.bfloat16)
    norm = torch.from_numpy(rng.standard_normal(64, dtype=np.float32)).to(torch.bfloat16)
    out = []
    for i in range(3):
        int16(embed).reshape(-1)[i * 7 : i * 7 + 5] ^= 1
        head = embed.clone()
        if i == 2:
            int16(head).reshape(-1)[0] ^= 2
        out.append([(EMBEDDING, embed.clone()), ("model.norm.weight", norm.clone()), (TIED_HEAD, head)])
    return out


@pytest.mark.parametrize("planes", [(), ("int8",)])
@pytest.mark.parametrize("plan", [HeadPlan(drop=True), HeadPlan(copy=True)])
def test_the_head_plans_publish_the_numpy_paths_bytes(
    buckets: tuple[str, str], plan: HeadPlan, planes: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """A dropped head (compared with the embedding by its delta from it) and a stored one (the
    chunk's own when it brings one, else the embedding's copy) as the host collector makes them."""
    results = {}
    config = PublisherConfig(retain_anchors=0, planes=planes)  # type: ignore[arg-type]
    for url, device in zip(buckets, (None, DevicePath(0)), strict=True):
        with SyncPublisher(url, RUN, config, device=device) as publisher:
            out = []
            for i, chunks in enumerate(chunk_versions()):
                collect = device.collector(publisher) if device is not None else HostCollector
                collector = collect(plan)
                # The second version brings no head: the copy plan copies the embedding.
                collector.add([pair for pair in chunks if i != 1 or pair[0] != TIED_HEAD])
                state = collector.finish()
                if isinstance(state, DeviceDelta):  # by delta from v1 on
                    assert device is not None and i > 0 and (state.planes is not None) == bool(planes)
                    assert (TIED_HEAD in device.previous.names) == plan.copy
                else:
                    assert (TIED_HEAD in state) == plan.copy
                    assert device is None or i == 0
                out.append(publisher.publish(state).changed)
            results[url] = out
    assert results[buckets[0]] == results[buckets[1]]
    numpy_objects = asyncio.run(committed_objects(buckets[0], planes))
    assert asyncio.run(committed_objects(buckets[1], planes)) == numpy_objects
    if plan.drop:  # the last version's head differs from its embedding: both paths say so
        assert caplog.text.count("differs from model.embed_tokens.weight in 1 of 4096 elements") == 2


def test_the_device_budget_setting_selects_the_path(fake_slime, tmp_path: Path) -> None:  # noqa: F811
    args = Namespace(stoa_publish=True, stoa_bucket=f"file://{tmp_path}", stoa_run=RUN)
    settings = slime_hook.settings_from_args(args)
    assert settings.device_budget_bytes is None and slime_hook.get_publisher(settings).device is None
    slime_hook._PUBLISHER.close()  # type: ignore[union-attr]
    slime_hook._PUBLISHER = None
    args.stoa_device_budget_bytes = "1024"
    publisher = slime_hook.get_publisher(slime_hook.settings_from_args(args))
    assert publisher.device is not None and publisher.device.previous.config.device_budget_bytes == 1024
    args.stoa_device_budget_bytes = -1
    with pytest.raises(ValueError, match="stoa_device_budget_bytes must be a finite number >= 0"):
        slime_hook.settings_from_args(args)


@pytest.mark.parametrize("config", [BY_DELTA, CONFIG], ids=["bf16", "planes"])
def test_a_device_path_restarted_over_a_lost_chain_sends_a_full_state(
    fake_slime, tmp_path: Path, config: PublisherConfig  # noqa: F811
) -> None:
    """Every patch deleted while the trainer was down (no keep folder): the resumed publisher
    cannot read the head back, so it releases nothing to the device path, whose next gather is a
    full state published as a fresh anchor; the gathers after it go by delta again, and a worker
    rebuilds each version (and its planes) bit for bit."""
    trainer = Trainer(f"file://{tmp_path}", 1 << 30, config)
    rng = np.random.default_rng(6)
    for _ in range(3):  # v0 anchor, v1, v2 patches
        trainer.publish()
        trainer.committed()
        step(trainer.weights, rng, list(SHAPES)[:2])
    patches = [p for p in tmp_path.rglob("*") if p.is_file() and "/patches/" in p.as_posix()]
    assert patches
    for patch in patches:
        patch.unlink()
    trainer.restart()
    trainer.publisher.open()
    path, pub = trainer.publisher.device, trainer.publisher._publisher
    assert path is not None and pub is not None and pub.weights.baseline_lost
    assert path.released is None and path.held is None  # nothing to diff against: host copies next
    for version in (3, 4):
        trainer.publish()
        result = trainer.committed()
        assert result.version == version and result.anchored == (version == 3)
        want = bits_of(trainer.weights)
        got_version, got = asyncio.run(installed(f"file://{tmp_path}"))
        assert got_version == version and got.keys() == set(PUBLISHED)
        assert all(np.array_equal(got["model." + n], want["model." + n]) for n in SHAPES)
        for plane in config.planes or ():
            plane_version, held = asyncio.run(installed(f"file://{tmp_path}", plane))
            assert plane_version == version and held  # the plane is brought to the same version
        step(trainer.weights, rng, list(SHAPES)[:2])
    assert trainer.handed[3:] == ["dict", "DeviceDelta"]


@pytest.mark.parametrize("config", [BY_DELTA, CONFIG], ids=["bf16", "planes"])
def test_a_stale_base_whose_committed_state_cannot_be_read_back_is_published_as_an_anchor(
    fake_slime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,  # noqa: F811
    config: PublisherConfig,
) -> None:
    """A pointer write whose answer was lost landed (`StaleBase`), its step not known here, and
    every patch of the chain deleted (no keep folder): the committed state cannot be read back
    from the bucket, so the version is published as a fresh anchor of the trainer's weights
    instead of failing, and the next one goes by delta again; a worker rebuilds each bit for bit."""
    url = f"file://{tmp_path}"
    trainer = Trainer(url, 1 << 30, config)
    rng = np.random.default_rng(9)
    names = list(SHAPES)
    for _ in range(2):  # v0 (an anchor), v1 (by delta)
        trainer.publish()
        trainer.committed()
        step(trainer.weights, rng, names)
    trainer.publisher.faults.armed.add("lose")
    trainer.publish()  # v2: its pointer write lands, its answer is lost
    inflight = trainer.publisher._inflight
    assert inflight is not None
    concurrent.futures.wait([inflight])
    with pytest.raises(PublishError):
        slime_hook.publish_weights(trainer.actor, trainer.args)
    pub = trainer.publisher._publisher
    assert pub is not None
    real = pub.publish_delta

    async def step_unknown(*args: Any, **kw: Any) -> PublishResult:
        try:
            return await real(*args, **kw)
        except StaleBase:
            pub.weights.last_delta = None  # as when the landed version is not the one after the copy's
            raise

    monkeypatch.setattr(pub, "publish_delta", step_unknown)
    patches = [p for p in tmp_path.rglob("*") if p.is_file() and "/patches/" in p.as_posix()]
    assert patches
    for patch in patches:
        patch.unlink()

    caplog.set_level(logging.WARNING)
    for version, anchored in ((3, True), (4, False)):
        step(trainer.weights, rng, names[:2])
        trainer.publish()
        result = trainer.committed()
        assert (result.version, result.anchored) == (version, anchored)
        want = bits_of(trainer.weights)
        got_version, got = asyncio.run(installed(url))
        assert got_version == version and all(np.array_equal(got["model." + n], want["model." + n]) for n in SHAPES)
        for plane in config.planes or ():
            plane_version, held = asyncio.run(installed(url, plane))
            assert plane_version == version and held
        if version == 3:
            assert any("cannot be read back from the bucket" in r.getMessage() and "fresh anchor" in r.getMessage()
                       for r in caplog.records)
    assert trainer.handed[-2:] == ["DeviceDelta", "DeviceDelta"]
