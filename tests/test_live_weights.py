"""macd.weights: a live MLX model following PULSE versions, on the bf16 and int8 planes."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, quantize_model

from macd import cpu_compute
from macd.cpu_compute import computes_in_float32, use_float32_compute
from macd.weights import ApplyStats, LiveWeights
from slime_stoa.protocol.hf.folders import (
    load_hf_state,
    save_hf_folder,
)
from slime_stoa.protocol.pulse.digest import state_digest
from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.protocol.pulse.subscriber import Subscriber, SyncResult
from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart.tiny_model import build_tiny_model

RUN = "live-weights"
GROUP = 64
FULLY_CHANGED = "model.layers.1.mlp.gate_proj.weight"  # quantized on the int8 plane
UNQUANTIZED = "model.layers.0.mlp.down_proj.weight"  # input 160: no multiple of 64, stays bf16
PROMPT = mx.array([[5, 17, 42, 99, 3, 250, 7, 11]])

State = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # intermediate 160: down_proj's input size is no multiple of the group size
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), intermediate_size=160)


def fresh_model(path: Path, state: State | None = None):
    """The folder's model structure; with `state`, holding exactly those bf16 weights."""
    model, _ = load_model(path, lazy=True)
    if state is not None:
        model.load_weights([(n, mx.array(b).view(mx.bfloat16)) for n, b in state.items()], strict=True)
        mx.eval(model.parameters())
    return model


def nudge(state: State, rng: np.random.Generator, density: float = 0.01) -> State:
    """A copy with ~`density` of each tensor's elements given new low mantissa bits (finite)."""
    new = {name: bits.copy() for name, bits in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        at = np.flatnonzero(rng.random(flat.size) < density)
        flat[at] ^= rng.integers(1, 8, size=at.size, dtype=np.uint16)
    return new


def versions(v0: State, rng: np.random.Generator) -> list[State]:
    """v0, a 1% patch, a patch with one tensor fully changed, no change, another 1% patch."""
    v1 = nudge(v0, rng)
    v2 = nudge(v1, rng)
    v2[FULLY_CHANGED] = v2[FULLY_CHANGED] ^ np.uint16(1)
    v4 = nudge(v2, rng)
    return [v0, v1, v2, {n: b.copy() for n, b in v2.items()}, v4]


def bits_of(a: mx.array) -> np.ndarray:
    """Any MLX array's raw bits as numpy (bf16 -> uint16, others as they are)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def snapshot(model) -> dict[str, np.ndarray]:
    return {name: bits_of(a) for name, a in tree_flatten(model.parameters())}


def assert_same_params(model, expected: dict[str, np.ndarray]) -> None:
    got = snapshot(model)
    assert got.keys() == expected.keys()
    for name, bits in expected.items():
        assert got[name].dtype == bits.dtype and np.array_equal(got[name], bits), name


def assert_same_logits(a, b) -> None:
    """`a` and `b` compute the same logits, bit for bit: `b` (a reference) computes the way `a`
    does (on the CPU device, a bf16-plane model computes in float32: `macd.cpu_compute`)."""
    if computes_in_float32(a):
        use_float32_compute(b)
    la, lb = a(PROMPT), b(PROMPT)
    assert la.dtype == lb.dtype and bool(mx.array_equal(la, lb).item())


def int8_reference(tiny: Path, state: State):
    """Quantize the master from scratch, the way mlx-lm quantizes a model."""
    model = fresh_model(tiny, state)
    quantize_model(model, {}, group_size=GROUP, bits=8)
    mx.eval(model.parameters())
    if cpu_compute.float32_activations_wanted():  # as the worker's int8 plane computes on MLX's CPU device
        cpu_compute.use_float32_activations(model)
    return model


def expected_groups(live: LiveWeights, result: SyncResult) -> int:
    assert result.changed is not None
    quantized = {f"{path}.weight" for path, m in live.model.named_modules() if "scales" in m}
    return sum(np.unique(idx // GROUP).size for name, idx in result.changed.items() if name in quantized)


async def first_install(sub: Subscriber, model: nn.Module, plane: str) -> LiveWeights:
    """A worker's cold start: a deferred sync's verified state, owned by the live weights from then on."""
    result = await sub.sync()
    assert result is not None and result.changed is None and result.staged is not None and result.staged.state is not None
    live = LiveWeights.from_state(model, result.staged.state, plane, result.staged.digest.root())  # type: ignore[arg-type]
    sub.advance(result.staged)
    assert sub.state is None  # the subscriber holds no weight bytes
    return live


async def install_next(sub: Subscriber, live: LiveWeights) -> tuple[SyncResult, ApplyStats]:
    """A worker's install: a sync staged on the live weights' bits (lent read-only), installed by
    them in one call (at a safe point, on the MLX thread), then the subscriber stands at it."""
    result = await sub.sync(live.bits())
    assert result is not None and result.staged is not None
    stats = live.install_version(result.staged)
    sub.advance(result.staged)
    assert live.digest == sub.digest.root() == result.staged.digest.root()  # type: ignore[union-attr]
    return result, stats


async def follow(tiny: Path, bucket: Path, plane: str) -> None:
    """Publish the versions, sync a deferred subscriber, install, and compare after each version."""
    rng = np.random.default_rng(0)
    states = versions(load_hf_state(tiny), rng)
    async with open_store(f"file://{bucket}") as store:
        pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
        stale = LiveWeights.from_state(fresh_model(tiny), states[0], plane)  # for the anchor path
        live: LiveWeights | None = None
        for v, state in enumerate(states):
            await pub.publish(state)
            if live is None:
                live = await first_install(sub, fresh_model(tiny), plane)
                check(tiny, plane, live, state)
                continue
            result, stats = await install_next(sub, live)
            assert result.version == v and result.path == "step" and result.changed is not None
            assert not stats.full
            if plane == "bf16":  # one copy: the patch was committed into the live weights
                assert live.shares(live.state) and stats.tensors == 0
            else:
                assert stats.tensors == len([i for i in result.changed.values() if i.size])
            if plane == "int8":
                assert stats.groups == expected_groups(live, result)
            if v == 3:
                assert stats.tensors == stats.groups == 0  # nothing changed
            if v in (1, 4) and plane == "int8":
                total = sum(m.scales.size for _, m in live.model.named_modules() if "scales" in m)
                assert 0 < stats.groups < total  # a real subset
            check(tiny, plane, live, state)

        cold = Subscriber(store, RUN, deferred=True)  # far behind: the anchor path replaces the whole state
        result = await cold.sync()
        assert result is not None and result.path.startswith("anchor") and result.staged is not None
        stats = stale.install_version(result.staged)
        assert stats.full and stats.tensors == len(states[-1]) and stale.digest == pub.state_digest
        check(tiny, plane, stale, states[-1])


def check(tiny: Path, plane: str, live: LiveWeights, state: State) -> None:
    assert live.digest_check(state)
    if plane == "bf16":
        assert_same_params(live.model, state)
        reference = fresh_model(tiny, state)
    else:
        reference = int8_reference(tiny, state)
        assert_same_params(live.model, snapshot(reference))
        assert "scales" not in dict(live.model.named_modules())[UNQUANTIZED.rsplit(".", 1)[0]]
    assert_same_logits(live.model, reference)


async def test_bf16_plane_follows_every_version(tiny: Path, tmp_path: Path) -> None:
    await follow(tiny, tmp_path, "bf16")


def assert_one_copy(live: LiveWeights, state: State) -> None:
    """Every state tensor is the memory of the model parameter of that name (no second copy)."""
    params = dict(tree_flatten(live.model.parameters()))
    assert live.shares(state) and params.keys() == state.keys()
    for name, bits in state.items():
        assert np.shares_memory(bits, np.array(params[name].view(mx.uint16), copy=False)), name
    assert live.nbytes == sum(b.nbytes for b in state.values())


async def test_one_copy_stays_bit_identical_to_a_fresh_load_over_20_patches(tiny: Path, tmp_path: Path) -> None:
    """bf16: the live weights' state is the model's memory, and the subscriber holds none of it.
    Twenty patches staged on it and installed in one call each leave it bit-identical to a freshly
    loaded model of the published state; an anchor's new state is installed and shared in its
    turn, and the old one let go."""
    rng = np.random.default_rng(5)
    state = load_hf_state(tiny)
    async with open_store(f"file://{tmp_path}") as store:
        pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
        await pub.publish(state)
        live = await first_install(sub, fresh_model(tiny), "bf16")
        assert_one_copy(live, live.state)
        for v in range(1, 21):
            state = nudge(state, rng)
            await pub.publish(state)
            result, stats = await install_next(sub, live)
            assert result.version == v and result.path == "step"
            assert stats.tensors == 0  # nothing to copy: the patch wrote the live weights
            assert_one_copy(live, live.state)
        assert sub.digest is not None and sub.digest.root() == state_digest(state) == pub.state_digest
        assert_same_params(live.model, state)
        assert_same_logits(live.model, fresh_model(tiny, state))

        for _ in range(3):  # three versions behind: a catch-up patch or a chain, staged
            state = nudge(state, rng)
            await pub.publish(state)
        result, _ = await install_next(sub, live)
        assert result.version == 23 and not result.path.startswith("anchor")
        assert_one_copy(live, live.state)
        assert_same_params(live.model, state)

        cold = Subscriber(store, RUN, deferred=True)
        result = await cold.sync()
        assert result is not None and result.path.startswith("anchor") and result.staged is not None
        old, new = live.state, result.staged.state
        stats = live.install_version(result.staged)
        assert stats.full and stats.tensors == len(state) and live.state is new
        assert_one_copy(live, live.state)
        assert not live.shares(old)
        assert_same_params(live.model, state)


@pytest.mark.parametrize("plane", ["bf16", "int8"])
async def test_a_failed_install_changes_nothing(
    tiny: Path, tmp_path: Path, plane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged version the model cannot take (staged on another version, a new state that does
    not fit) or whose install fails half-way (an MLX error after the patch was committed) leaves
    the model and its state at the version it held, bit for bit; the same version installs after."""
    rng = np.random.default_rng(9)
    state = load_hf_state(tiny)
    async with open_store(f"file://{tmp_path}") as store:
        pub, sub = Publisher(store, RUN), Subscriber(store, RUN, deferred=True)
        await pub.publish(state)
        live = await first_install(sub, fresh_model(tiny), plane)
        before, held = snapshot(live.model), {n: b.copy() for n, b in live.state.items()}
        new = nudge(state, rng)
        await pub.publish(new)
        result = await sub.sync(live.bits())
        assert result is not None and result.staged is not None and result.staged.patch is not None

        def unchanged() -> None:
            assert live.digest == sub.digest.root() and sub.version == 0  # type: ignore[union-attr]
            assert_same_params(live.model, before)
            assert all(np.array_equal(live.state[n], b) for n, b in held.items())
            assert live.digest_check(live.state)

        with pytest.raises(ValueError, match="staged on state"):
            live.install_version(dataclasses.replace(result.staged, base="another version"))
        unchanged()
        misfit = {**held, "model.norm.weight": held["model.norm.weight"][:-1].copy()}
        with pytest.raises(ValueError, match=r"model\.norm\.weight"):
            live.install_version(dataclasses.replace(result.staged, patch=None, state=misfit))
        unchanged()

        failed: list[str] = []

        def failing_once(real):  # type: ignore[no-untyped-def]
            def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
                if not failed:  # an MLX error after the patch was written into the state
                    failed.append(real.__name__)
                    raise RuntimeError("out of memory (a test's)")
                return real(*args, **kwargs)
            return wrapper

        if plane == "bf16":  # the patch lands in the model's memory: refreshing a layer after it fails
            monkeypatch.setattr(LiveWeights, "_rewiden", failing_once(LiveWeights._rewiden))
        else:  # the patch lands in the master: loading the re-quantized groups fails
            monkeypatch.setattr(LiveWeights, "_load", failing_once(LiveWeights._load))
        with pytest.raises(RuntimeError, match="out of memory"):
            live.install_version(result.staged)
        assert failed
        unchanged()
        monkeypatch.undo()
        stats = live.install_version(result.staged)
        sub.advance(result.staged)
        assert not stats.full and live.digest == pub.state_digest
        assert live.digest_check(live.state) and all(np.array_equal(live.state[n], b) for n, b in new.items())


async def test_int8_plane_requantizes_only_touched_groups(tiny: Path, tmp_path: Path) -> None:
    await follow(tiny, tmp_path, "int8")


def test_matches_a_freshly_loaded_folder(tiny: Path, tmp_path: Path) -> None:
    state = nudge(load_hf_state(tiny), np.random.default_rng(1))
    live = LiveWeights.from_state(fresh_model(tiny), state, "bf16")
    loaded, _ = mlx_lm.load(str(save_hf_folder(state, tmp_path / "v", source_dir=tiny)))
    assert_same_logits(live.model, loaded)


@pytest.mark.parametrize("plane", ["bf16", "int8"])
def test_bad_tensors_are_refused_and_leave_the_model_unchanged(tiny: Path, plane: str) -> None:
    state = load_hf_state(tiny)
    name = "model.layers.0.self_attn.q_proj.weight"
    wrong_shape = {**state, name: state[name].reshape(-1)}
    model = fresh_model(tiny, state)
    before = snapshot(model)
    with pytest.raises(ValueError, match=name):
        LiveWeights.from_state(model, wrong_shape, plane)
    assert_same_params(model, before)  # not even quantized

    live = LiveWeights.from_state(model, state, plane)
    before = snapshot(live.model)
    changed = {n: np.arange(3) for n in state}
    bad_states = {
        "shape": wrong_shape,
        "dtype": {**state, name: state[name].astype(np.int16)},
        "name": {**state, "model.layers.9.mlp.up_proj.weight": state[name]},
    }
    for bad in bad_states.values():
        touched = sorted(set(bad) - {"model.norm.weight"})
        for how in (changed, None):
            with pytest.raises(ValueError, match=r"model\.layers\.[09]"):
                live.apply(bad, how, touched)
            assert_same_params(live.model, before)
    with pytest.raises(ValueError, match=name):
        live.apply(state, {name: np.array([0, state[name].size])}, [name])
    missing = {n: b for n, b in state.items() if n != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        live.install(missing)
    assert_same_params(live.model, before)
    assert live.digest_check(state) and not live.digest_check(nudge(state, np.random.default_rng(2)))


def test_tied_head_in_the_state(tiny: Path) -> None:
    state = load_hf_state(tiny)
    head = "lm_head.weight"
    assert head not in state  # the tiny model ties its embeddings
    old_head = state["model.embed_tokens.weight"].copy()
    with_head = {**state, head: old_head.copy()}
    live = LiveWeights.from_state(fresh_model(tiny), with_head, "int8")
    assert live.digest_check(with_head)
    at = np.array([0, 5])
    with_head[head].reshape(-1)[at] ^= np.uint16(1)
    with pytest.raises(ValueError, match=head):
        live.apply(with_head, {head: at}, [head])
    with_head["model.embed_tokens.weight"].reshape(-1)[at] ^= np.uint16(1)
    with pytest.raises(ValueError, match=head):  # the embedding alone moved away from the head
        live.apply({**with_head, head: old_head}, {"model.embed_tokens.weight": at}, [])
    both = {head: at, "model.embed_tokens.weight": at}
    stats = live.apply(with_head, both, list(both))
    assert stats == ApplyStats(1, 1, False, stats.seconds) and live.digest_check(with_head)


def test_unknown_plane(tiny: Path) -> None:
    with pytest.raises(ValueError, match="plane"):
        LiveWeights.from_state(fresh_model(tiny), load_hf_state(tiny), "int4")
