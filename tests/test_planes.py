"""Quantized planes published by the trainer: the plane layout, plane documents checked against
it, the publisher writing each plane after its bf16 version (signed, same version number, its
own catch-ups), completing a plane left behind, and the run manifest listing the planes."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import QUANT_PLANES, RunLayout, check_plane
from slime_stoa.protocol.pulse.codec import diff
from slime_stoa.protocol.pulse.history import NotPublished, read_manifest, read_pointer
from slime_stoa.protocol.pulse.manifests import ManifestError, Pointer, Ref, VersionManifest
from slime_stoa.protocol.pulse.plane import plane_bits, updated_plane_bits
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.slime.settings import StoaSettings

State = dict[str, np.ndarray]
RUN = "r1"


def bf16_state(seed: int = 0) -> State:
    """A small bf16 state (uint16 bits of values near 0.02) with quantized and kept tensors."""
    rng = np.random.default_rng(seed)

    def bits(shape: tuple[int, ...]) -> np.ndarray:
        values = rng.standard_normal(shape).astype(np.float32) * np.float32(0.02)
        return (values.view(np.uint32) >> 16).astype(np.uint16)

    return {
        "model.embed_tokens.weight": bits((96, 128)),
        "model.layers.0.mlp.up_proj.weight": bits((128, 64)),
        "model.layers.0.mlp.down_proj.weight": bits((64, 128)),
        "model.layers.0.input_layernorm.weight": bits((64,)),
        "model.layers.0.self_attn.q_proj.bias": bits((64,)),
    }


def nudged(state: State, seed: int, fraction: float = 0.02) -> State:
    rng = np.random.default_rng(seed)
    new = {k: v.copy() for k, v in state.items()}
    for a in new.values():
        flat = a.reshape(-1)
        at = np.flatnonzero(rng.random(flat.size) < fraction)
        flat[at] ^= rng.integers(1, 64, size=at.size, dtype=np.uint16)
    return new


# -- 1. the layout ----------------------------------------------------------------------------------
def test_a_plane_has_its_own_weight_keys_and_parses_only_its_own() -> None:
    bf16, int8, int4 = RunLayout(RUN), RunLayout(RUN, "int8"), RunLayout(RUN, "int4")
    assert int8.pointer == f"runs/{RUN}/planes/int8/current.json" and bf16.pointer == f"runs/{RUN}/current.json"
    key = int8.version_manifest(3, "0a0b0c0d")
    assert key == f"runs/{RUN}/planes/int8/versions/000000000003-0a0b0c0d.json"
    assert int8.patch(3, "0a0b0c0d", "step", 2) == f"runs/{RUN}/planes/int8/patches/000000000003-0a0b0c0d/step-000000000002.pulse"
    assert int8.anchor_manifest(0, "0a0b0c0d") == f"runs/{RUN}/planes/int8/anchors/000000000000-0a0b0c0d/manifest.json"
    assert int8.parse_version_manifest(key) == (3, "0a0b0c0d")
    for other in (bf16, int4):  # another plane's (or the bf16 weights') keys never parse as int8's
        assert other.parse_version_manifest(key) is None
        assert other.parse_anchor_manifest(int8.anchor_manifest(0, "0a0b0c0d")) is None
        assert other.parse_patch(int8.patch(3, "0a0b0c0d", "step", 2)) is None
        assert int8.parse_version_manifest(other.version_manifest(3, "0a0b0c0d")) is None
    assert bf16.weight_object_version(key) is None  # bf16 retention never touches a plane's objects
    assert int8.run_manifest == bf16.run_manifest and int8.rollouts_prefix() == bf16.rollouts_prefix()
    assert set(QUANT_PLANES) == {"int8", "int4"}
    for bad in ("bf16", "int3", "INT8", "int8/", "int8\n", "", 8):
        with pytest.raises(ValueError, match="quantized plane"):
            RunLayout(RUN, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="quantized plane"):
            check_plane(bad)
    with pytest.raises(ValueError, match="quantized plane"):
        check_plane(None)


# -- 2. plane documents are checked against the plane's layout --------------------------------------
def _manifest(layout: RunLayout, version: int = 1, **kw: object) -> VersionManifest:
    anchor = Ref(version=0, manifest=layout.anchor_manifest(0, "00000000"), state_digest="ab" * 16)
    parent = Ref(version=version - 1, manifest=layout.version_manifest(version - 1, "00000000"), state_digest="cd" * 16)
    fields: dict = dict(
        run=RUN, version=version, attempt="11111111", state_digest="ef" * 16, parent=parent, anchor=anchor,
        anchor_bytes=10, since_anchor_bytes=0, patches=(), elements=4, created_at=1.0, plane=layout.plane,
    )
    fields.update(kw)
    return VersionManifest(**fields)


def test_plane_documents_name_their_plane_and_its_bf16_source() -> None:
    int8 = RunLayout(RUN, "int8")
    source = Ref(version=1, manifest=RunLayout(RUN).version_manifest(1, "22222222"), state_digest="12" * 16)
    good = _manifest(int8, source=source)
    key = int8.version_manifest(1, "11111111")
    parsed = VersionManifest.from_bytes(good.to_bytes(), "m", key=key)
    assert parsed.plane == "int8" and parsed.source == source
    assert "plane" not in json.loads(_manifest(RunLayout(RUN)).to_bytes())  # bf16 documents as before planes
    with pytest.raises(ManifestError, match="does not belong"):  # a plane's manifest at a bf16 key
        VersionManifest.from_bytes(good.to_bytes(), "m", key=RunLayout(RUN).version_manifest(1, "11111111"))
    with pytest.raises(ManifestError, match="manifest key of run 'r1' plane int4"):  # relabelled as another plane: its keys are int8's
        VersionManifest.from_bytes(_manifest(int8, source=source, plane="int4").to_bytes(), "m")
    with pytest.raises(ManifestError, match="source"):
        VersionManifest.from_bytes(_manifest(int8).to_bytes(), "m")  # no source
    with pytest.raises(ManifestError, match="source"):
        VersionManifest.from_bytes(_manifest(RunLayout(RUN), source=source).to_bytes(), "m")  # bf16 with a source
    with pytest.raises(ManifestError, match="source v0"):
        VersionManifest.from_bytes(_manifest(int8, source=Ref(version=0, manifest=RunLayout(RUN).version_manifest(0, "22222222"), state_digest="12" * 16)).to_bytes(), "m")
    with pytest.raises(ManifestError, match="manifest key"):  # the source is a bf16 manifest, not a plane's
        VersionManifest.from_bytes(_manifest(int8, source=Ref(version=1, manifest=key, state_digest="12" * 16)).to_bytes(), "m")
    doc = json.loads(good.to_bytes())
    doc["plane"] = "int16"
    with pytest.raises(ManifestError, match="quantized plane"):
        VersionManifest.from_bytes(json.dumps(doc).encode(), "m")

    anchor = Ref(version=0, manifest=int8.anchor_manifest(0, "00000000"), state_digest="ab" * 16)
    pointer = Pointer(run=RUN, version=1, state_digest="ef" * 16, manifest=key, anchor=anchor, updated_at=1.0, plane="int8")
    assert Pointer.from_bytes(pointer.to_bytes(), plane="int8") == pointer
    with pytest.raises(ManifestError, match="plane int8, not of the bf16 weights"):
        Pointer.from_bytes(pointer.to_bytes())
    with pytest.raises(ManifestError, match="not of plane int4"):
        Pointer.from_bytes(pointer.to_bytes(), plane="int4")
    doc = json.loads(pointer.to_bytes())
    del doc["plane"]  # a plane's keys under a pointer that claims to be the bf16 weights'
    with pytest.raises(ManifestError, match="manifest key"):
        Pointer.from_bytes(json.dumps(doc).encode())


# -- 3. the publisher writes the planes ------------------------------------------------------------
@pytest.mark.parametrize("plane", QUANT_PLANES)
def test_a_step_requantizes_only_the_groups_it_changed_bit_exact(plane: str) -> None:
    p = check_plane(plane)
    before = bf16_state(3)
    before["model.layers.0.feed_forward.gate.weight"] = bf16_state(4)["model.layers.0.mlp.down_proj.weight"][:8]
    after = nudged(before, 7, fraction=0.005)
    changed = {name: indices for name, (indices, _) in diff(before, after).items()}
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.0.feed_forward.gate.weight"} <= changed.keys()
    previous = plane_bits(before, p, "lfm2_moe")  # the MoE router stays at 8 bits on every plane
    for threads in (1, 3):
        updated = updated_plane_bits(previous, after, changed, p, "lfm2_moe", threads=threads)
        expected = plane_bits(after, p, "lfm2_moe")
        assert updated.keys() == expected.keys()
        assert all(np.array_equal(updated[n], a) for n, a in expected.items())
        whole = plane_bits(after, p, "lfm2_moe", threads=threads)  # a full quantize on `threads` threads
        assert list(whole) == list(expected) and all(np.array_equal(whole[n], a) for n, a in expected.items())
    kept = {"model.layers.0.mlp.up_proj.weight": changed["model.layers.0.mlp.up_proj.weight"]}
    partial = updated_plane_bits(previous, after, kept, p, "lfm2_moe")
    assert partial["model.embed_tokens.weight"] is previous["model.embed_tokens.weight"]  # untouched: no copy
    assert np.array_equal(partial["model.layers.0.mlp.up_proj.weight"], expected["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="previous plane"):
        updated_plane_bits(before, after, changed, p, "lfm2_moe")  # a bf16 state is not a plane
    with pytest.raises(ValueError, match="not a tensor"):
        updated_plane_bits(previous, after, {"nope.weight": np.array([1])}, p, "lfm2_moe")


# -- the publisher --------------------------------------------------------------------------------------------------------------------------------------
async def test_the_publisher_writes_each_plane_after_its_bf16_version_signed(store: Store) -> None:
    key = SigningKey.generate()
    trust = RunTrust(RUN, key.public)
    config = PublisherConfig(planes=("int8", "int4"), catchup_budget=float("inf"))
    pub = Publisher(store, RUN, config, key=key)
    subs = {p: Subscriber(store, RUN, trust=RunTrust(RUN, key.public), plane=p) for p in QUANT_PLANES}
    states = [bf16_state()]
    for v in range(4):
        if v:
            states.append(nudged(states[-1], v))
        result = await pub.publish(states[-1])
        assert result.version == v and result.planes == ("int8", "int4")
        bf16 = await read_pointer(store, RUN, trust=trust)
        for plane, sub in subs.items():
            pointer = await read_pointer(store, RUN, trust=trust, plane=plane)
            assert pointer.version == v and pointer.plane == plane
            manifest = await read_manifest(store, pointer.manifest, trust=trust)  # signed by the run key
            assert manifest.source == Ref(version=v, manifest=bf16.manifest, state_digest=bf16.state_digest)
            synced = await sub.sync()
            assert synced is not None and synced.version == v
            assert synced.path == ("anchor" if v == 0 else "step")
            expected = plane_bits(states[-1], plane)
            assert sub.state is not None and sub.state.keys() == expected.keys()
            assert all(np.array_equal(sub.state[n], a) for n, a in expected.items())
            assert sub.digest is not None and sub.digest.root() == pointer.state_digest != bf16.state_digest
            if v == 2:  # the plane's own catch-up schedule: two versions past its anchor
                assert manifest.patch("catchup") is not None
        assert pub.planes["int8"].state_digest == (await read_pointer(store, RUN, plane="int8")).state_digest
    # A bf16 reader never sees a plane's objects.
    bf16_sub = Subscriber(store, RUN, trust=trust)
    assert (await bf16_sub.sync()) is not None and bf16_sub.state is not None
    assert all(np.array_equal(bf16_sub.state[n], a) for n, a in states[-1].items())


async def test_a_resumed_publisher_completes_a_plane_left_behind(store: Store) -> None:
    key = SigningKey.generate()
    trust = RunTrust(RUN, key.public)
    planes = PublisherConfig(planes=("int8",))
    first = Publisher(store, RUN, planes, key=key)
    states = [bf16_state(), nudged(bf16_state(), 1)]
    for s in states:
        await first.publish(s)
    sub = Subscriber(store, RUN, trust=trust, plane="int8")
    assert (await sub.sync()) is not None and sub.version == 1
    # The trainer died after committing bf16 v2 and before the plane's v2 (a publisher without the
    # planes stands in for that moment).
    states.append(nudged(states[-1], 2))
    await Publisher(store, RUN, PublisherConfig(), key=key).publish(states[-1])
    assert (await read_pointer(store, RUN, plane="int8", trust=trust)).version == 1
    resumed = Publisher(store, RUN, planes, key=key)
    assert await resumed.open() == 2
    assert (await read_pointer(store, RUN, plane="int8", trust=trust)).version == 2  # completed on open
    synced = await sub.sync()
    assert synced is not None and synced.path == "step" and synced.version == 2
    assert sub.digest is not None and all(np.array_equal(sub.state[n], a) for n, a in plane_bits(states[-1], "int8").items())  # type: ignore[index]
    epoch = sub.head_epoch
    # Further behind (two bf16 versions without the plane): a new chain from an anchor at the
    # bf16 version, on the same epoch, so a follower takes it.
    for seed in (3, 4):
        states.append(nudged(states[-1], seed))
        await Publisher(store, RUN, PublisherConfig(), key=key).publish(states[-1])
    again = Publisher(store, RUN, planes, key=key)
    states.append(nudged(states[-1], 5))
    result = await again.publish(states[-1])
    assert result.version == 5 and result.planes == ("int8",)
    synced = await sub.sync()
    assert synced is not None and synced.version == 5 and sub.head_epoch == epoch
    assert all(np.array_equal(sub.state[n], a) for n, a in plane_bits(states[-1], "int8").items())  # type: ignore[index]
    v5 = await read_manifest(store, (await read_pointer(store, RUN, plane="int8", trust=trust)).manifest, trust=trust)
    assert v5.version == 5 and v5.parent is not None and v5.parent.version == 4 and v5.anchor.version == 4


async def test_a_plane_publisher_refuses_what_is_not_its_next_version(store: Store) -> None:
    pub = Publisher(store, RUN, PublisherConfig(planes=("int8",)))
    with pytest.raises(ValueError, match="bf16 source"):
        await pub.publish(bf16_state(), source=Ref(version=0, manifest=RunLayout(RUN).version_manifest(0, "00000000"), state_digest="ab" * 16))
    await pub.publish(bf16_state())
    with pytest.raises(ValueError, match="bf16 source"):
        await pub.planes["int8"].publish(plane_bits(bf16_state(), "int8"))
    with pytest.raises(ValueError, match="no planes of its own"):
        Publisher(store, RUN, PublisherConfig(planes=("int8",)), plane="int4")
    with pytest.raises(NotPublished):
        await read_pointer(store, RUN, plane="int4")
    for bad in (("int8", "int8"), ("bf16",), ["int8"]):
        with pytest.raises(ValueError, match="plane"):
            PublisherConfig(planes=bad)  # type: ignore[arg-type]


# -- 4. the run manifest lists the planes offered ---------------------------------------------------
def test_the_run_manifest_lists_the_planes_offered() -> None:
    m = RunManifest(run=RUN, model="m", task="t", plane="int4", planes=("int8", "int4"))
    back = RunManifest.from_bytes(m.to_bytes())
    assert back.planes == ("int8", "int4") and back.plane == "int4" and back.offers("int8") and not back.offers("bf16")
    assert "planes" not in json.loads(RunManifest(run=RUN, model="m", task="t").to_bytes())  # bytes older readers know
    with pytest.raises(ValueError, match="int4 needs"):
        RunManifest(run=RUN, model="m", task="t", plane="int4")
    for bad in (("int8", "int8"), ("bf16",), ("int3",), ["int8"]):
        with pytest.raises(ValueError, match="planes must be"):
            RunManifest(run=RUN, model="m", task="t", planes=bad)  # type: ignore[arg-type]


def test_the_trainer_setting_names_the_planes() -> None:
    def planes(value: object) -> tuple[str, ...] | None:
        return StoaSettings.from_args(Namespace(stoa_bucket="file:///b", stoa_run="r", stoa_planes=value)).publisher.planes

    assert planes("int8, int4") == planes(["int8", "int4"]) == ("int8", "int4")
    assert planes(None) is None and planes("") is None  # the run manifest's planes
    assert planes([]) == ()  # none, whatever the run offers
    for bad in ("int8,int16", "int8,int8", 8):
        with pytest.raises(ValueError, match=r"plane|list"):
            planes(bad)


async def test_by_default_the_publisher_writes_the_planes_the_run_offers(store: Store) -> None:
    await store.put(RunLayout(RUN).run_manifest, RunManifest(run=RUN, model="m", task="t", planes=("int4",)).to_bytes())
    pub = Publisher(store, RUN)
    assert (await pub.publish(bf16_state())).planes == ("int4",)
    assert (await read_pointer(store, RUN, plane="int4")).version == 0
    with pytest.raises(NotPublished):
        await read_pointer(store, RUN, plane="int8")
    none = Publisher(store, "r2", PublisherConfig(planes=()))  # said explicitly: no plane, whatever the run offers
    await store.put(RunLayout("r2").run_manifest, RunManifest(run="r2", model="m", task="t", planes=("int8",)).to_bytes())
    assert (await none.publish(bf16_state())).planes == ()


def test_run_create_offers_planes(tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    base = ["run", "create", "--store", url, "--model", "m", "--task", "synthetic"]
    assert main([*base, "--run", "a", "--plane", "int4", "--planes", "int8, int4"]) == 0
    assert main([*base, "--run", "b", "--planes", "int16"]) == 1
    doc = json.loads((tmp_path / "runs" / "a" / "run.json").read_bytes())
    assert doc["planes"] == ["int8", "int4"] and doc["plane"] == "int4"
    assert not (tmp_path / "runs" / "b").exists()
