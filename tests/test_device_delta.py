"""trainer.device_delta: the torch diff, quantization, plane delta and host-side digest, byte for
byte the numpy path's (`codec.diff`, `quant.quantize`, `plane.plane_bits`, `StateDigest`), on the
CPU here (the same code runs on CUDA): special bit patterns, empty and odd shapes, every group
size and width, refusals, and large random states."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slime_stoa.protocol.pulse.codec import diff, float32_to_bf16_bits
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.plane import plane_bits, plane_shapes
from slime_stoa.protocol.pulse.quant import quantize as numpy_quantize
from slime_stoa.trainer import device_delta
from slime_stoa.trainer.device_delta import DeviceDeltaConfig, PreviousState, apply_delta, quantize
from slime_stoa.trainer.slime.gathered import tensor_bits
from tests.quant_cases import hostile_rows

PARAMS = [(64, 8), (64, 4), (32, 4), (128, 4), (32, 8), (128, 8), (64, 2), (32, 2)]
# bf16 bit patterns a bit compare must tell apart: +-0, +-inf, NaNs with other payloads and signs,
# the smallest subnormal, the largest finite.
SPECIAL = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x0001, 0x7F7F], dtype=np.uint16)


def torch_bits(bits: np.ndarray) -> torch.Tensor:
    """uint16 bf16 bits as a torch bf16 tensor of the same shape (the trainer's weights)."""
    return torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16).copy()).view(torch.bfloat16)


def torch_state(state: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch_bits(bits) for name, bits in state.items()}


def random_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)


def changed_copy(rng: np.random.Generator, bits: np.ndarray, density: float) -> np.ndarray:
    new = bits.copy()
    flat = new.reshape(-1)
    mask = rng.random(flat.size) < density
    flat[mask] ^= rng.integers(1, 1 << 16, size=int(mask.sum()), dtype=np.uint16)
    return new


def assert_same_delta(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, (indices, values) in theirs.items():
        got_i, got_v = ours[name]
        assert got_i.dtype == np.int64 and got_v.dtype == np.uint16, name
        assert got_i.tobytes() == indices.tobytes() and got_v.tobytes() == values.tobytes(), name


def device_diff(base: dict[str, np.ndarray], new: dict[str, np.ndarray], budget: int = 0) -> tuple[dict, PreviousState]:
    previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=budget))
    previous.reset(torch_state(base))
    return previous.diff(torch_state(new)), previous


# -- the diff -------------------------------------------------------------------------------------
shape_st = st.lists(st.integers(0, 12), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=5),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.0, 0.02, 0.3, 1.0]),
)
def test_diff_equals_codec_diff(shapes: list[tuple[int, ...]], seed: int, density: float) -> None:
    rng = np.random.default_rng(seed)
    base = {f"t{i}": random_bits(rng, s) for i, s in enumerate(shapes)}
    new = {name: changed_copy(rng, bits, density) for name, bits in base.items()}
    delta, previous = device_diff(base, new)
    assert_same_delta(delta, diff(base, new))
    previous.commit()
    assert previous.diff(torch_state(new)) == {}  # the committed version is the new one


def test_special_bit_patterns_are_changes_and_unchanged_nans_are_not() -> None:
    n = SPECIAL.size
    old = np.repeat(SPECIAL, n)  # every pair (a, b) of special patterns
    new = np.tile(SPECIAL, n)
    base, state = {"x": old.reshape(n, n)}, {"x": new.reshape(n, n)}
    delta, _ = device_diff(base, state)
    theirs = diff(base, state)
    assert_same_delta(delta, theirs)
    assert theirs["x"][0].size == n * n - n  # only the diagonal (same bits, NaNs included) is unchanged


def test_empty_diff_all_changed_zero_dim_and_empty_tensors() -> None:
    rng = np.random.default_rng(1)
    base = {"scalar": np.array(0x8000, dtype=np.uint16), "empty": np.zeros((0, 5), np.uint16),
            "vec": random_bits(rng, (1000,)), "odd": random_bits(rng, (7, 13, 3))}
    delta, _ = device_diff(base, {k: v.copy() for k, v in base.items()})
    assert delta == {}
    flipped = {k: np.asarray(v ^ np.uint16(1)) for k, v in base.items()}
    delta, _ = device_diff(base, flipped)
    assert_same_delta(delta, diff(base, flipped))
    assert delta["vec"][0].size == 1000 and delta["scalar"][0].tolist() == [0]


def test_mismatched_states_are_refused_as_the_numpy_diff_refuses() -> None:
    previous = PreviousState()
    previous.reset(torch_state({"a": np.zeros(4, np.uint16)}))
    with pytest.raises(ValueError, match="names"):
        previous.diff(torch_state({"b": np.zeros(4, np.uint16)}))
    with pytest.raises(ValueError, match="shape"):
        previous.diff(torch_state({"a": np.zeros(5, np.uint16)}))
    with pytest.raises(ValueError, match="dtype"):
        previous.diff({"a": torch.zeros(4, dtype=torch.int32)})
    with pytest.raises(RuntimeError, match="commit"):
        PreviousState().commit()


def test_float_tensors_are_cast_to_bf16_as_the_host_path_casts() -> None:
    from slime_stoa.trainer.slime.publish import tensor_bits

    rng = np.random.default_rng(2)
    values = torch.from_numpy(rng.standard_normal((6, 33)).astype(np.float32))
    previous = PreviousState()
    previous.reset({"w": torch.zeros(6, 33, dtype=torch.bfloat16)})
    delta = previous.diff({"w": values})
    assert_same_delta(delta, diff({"w": np.zeros((6, 33), np.uint16)}, {"w": tensor_bits("w", values)}))


def test_large_random_state_commits_in_place_and_digests_like_the_host() -> None:
    rng = np.random.default_rng(3)
    shapes = [(1024, 1536), (3000,), (64, 128, 9), (1,)]
    states = [{f"t{i}": random_bits(rng, s) for i, s in enumerate(shapes)}]
    for density in (0.02, 0.001, 0.5):
        states.append({k: changed_copy(rng, v, density) for k, v in states[-1].items()})
    previous = PreviousState()
    previous.reset(torch_state(states[0]))
    host, digest = states[0], StateDigest.of(states[0])
    for before, after in itertools.pairwise(states):
        handed = previous.transfer.device_to_host
        delta = previous.diff(torch_state(after))
        # only the patch reaches the host: int32 indices (these tensors are small) and uint16 values
        assert previous.transfer.device_to_host - handed == sum(6 * i.size for i, _ in delta.values())
        assert_same_delta(delta, diff(before, after))
        previous.commit()
        host = apply_delta(host, delta)  # the host's copy of the new version
        digest = digest.update(host, delta.keys())
        assert digest.root() == StateDigest.of(after).root()
        assert all(np.array_equal(host[k], after[k]) for k in after)
    assert previous.transfer.host_to_device == 0  # the previous version lives with the weights


# -- quantization -----------------------------------------------------------------------------------
def hostile_weights(group_size: int, rows: int, seed: int) -> np.ndarray:
    """bf16 bits (rows, 3 groups): normal weights with hostile groups (all positive, all equal,
    all negative, integers (exact halves), tiny, huge, an outlier, signed zeros)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, (rows, 3 * group_size)).astype(np.float32)
    g = w.reshape(-1, group_size)
    g[0::16] = np.abs(g[0::16]) + 0.5
    g[1::8] = -3.5
    g[2::8] = -np.abs(g[2::8]) - 10
    g[3::8] = rng.integers(-8, 9, g[3::8].shape)
    g[4::8] *= 1e-37
    g[5::8] *= 1e36
    g[6::8, 3] = 40.0
    g[7::8] = np.where(rng.random(g[7::8].shape) < 0.5, np.float32(-0.0), np.float32(0.0))
    return float32_to_bf16_bits(w)


def assert_same_quantized(ours, theirs) -> None:
    for a, b, what in ((ours.codes, theirs.codes, "codes"), (ours.scales, theirs.scales, "scales"),
                       (ours.biases, theirs.biases, "biases")):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), what


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_quantize_equals_numpy_quantize(group_size: int, bits: int) -> None:
    w = hostile_weights(group_size, 21, seed=group_size + bits)
    assert_same_quantized(quantize(torch_bits(w), group_size, bits), numpy_quantize(w, group_size, bits))
    stacked = w.reshape(3, 7, -1)  # more leading dimensions (MoE experts stacked)
    assert_same_quantized(quantize(torch_bits(stacked), group_size, bits), numpy_quantize(stacked, group_size, bits))


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_the_groups_numpy_is_held_to_mlx_on_are_the_numpy_quantizers(group_size: int, bits: int) -> None:
    """The hostile groups the numpy quantizer is checked against ``mx.quantize`` on (all equal,
    subnormal, huge, around eps / 2, ranges near eps, exact halves, random bit patterns over
    every exponent range), one group per row and side by side."""
    rows = hostile_rows(group_size, np.random.default_rng(7 + bits))
    assert_same_quantized(quantize(torch_bits(rows), group_size, bits), numpy_quantize(rows, group_size, bits))
    wide = rows[: rows.shape[0] // 4 * 4].reshape(-1, 4 * group_size)
    assert_same_quantized(quantize(torch_bits(wide), group_size, bits), numpy_quantize(wide, group_size, bits))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_other_float_weights_quantize_as_their_bf16_rounding(dtype: torch.dtype) -> None:
    """A float16/32/64 weight is rounded to bf16 first, as the publisher's host path rounds it."""
    values = np.random.default_rng(3).normal(0, 0.5, (4, 128))
    weight = torch.from_numpy(values).to(dtype)
    bits = tensor_bits("w", weight)  # the host path's gather
    assert_same_quantized(quantize(weight, 64, 4), numpy_quantize(bits, 64, 4))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 9), groups=st.integers(1, 4),
    params=st.sampled_from(PARAMS), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e20]),
)
def test_quantize_random_weights_equals_numpy(seed: int, rows: int, groups: int, params: tuple[int, int], scale: float) -> None:
    group_size, bits = params
    rng = np.random.default_rng(seed)
    w = float32_to_bf16_bits((rng.standard_normal((rows, groups * group_size)) * scale).astype(np.float32))
    assert_same_quantized(quantize(torch_bits(w), group_size, bits), numpy_quantize(w, group_size, bits))


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({5: np.inf}, "non-finite value at flat index 69"),
        ({7: np.nan}, "non-finite value at flat index 71"),
        ({0: -2e38, 1: 2e38}, "group 1: MLX's scale for it would be inf"),
        (dict.fromkeys(range(64), 3e38), "group 1: MLX's scale for it would be 0"),
    ],
)
def test_refusals_are_the_numpy_quantizers(values: dict[int, float], match: str) -> None:
    w = np.full((2, 128), 0.5, dtype=np.float32)
    for i, v in values.items():
        w.reshape(-1)[64 + i] = v
    bits16 = float32_to_bf16_bits(w)
    with pytest.raises(ValueError, match=match):
        numpy_quantize(bits16, 64, 8)
    with pytest.raises(ValueError, match=match):
        quantize(torch_bits(bits16), 64, 8)


def test_shapes_and_parameters_are_refused_as_numpy_refuses() -> None:
    for shape, match in (((128,), "at least 2 dimensions"), ((2, 100), "divisible by the group size")):
        with pytest.raises(ValueError, match=match):
            numpy_quantize(np.zeros(shape, np.uint16), 64, 8)
        with pytest.raises(ValueError, match=match):
            quantize(torch.zeros(shape, dtype=torch.bfloat16), 64, 8)
    with pytest.raises(ValueError, match="group size"):
        quantize(torch.zeros(2, 48, dtype=torch.bfloat16), 48, 8)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.zeros(2, 64, dtype=torch.bfloat16), 64, 3)


# -- the plane delta --------------------------------------------------------------------------------
def model_state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A small LFM2-MoE-like state: quantized weights (one an MoE router kept at 8 bits on every
    plane), a weight whose last dimension no group size divides, norms, a conv kernel."""
    def w(*shape: int) -> np.ndarray:
        return float32_to_bf16_bits((rng.standard_normal(shape) * 0.02).astype(np.float32))

    return {
        "model.embed_tokens.weight": w(96, 128),
        "model.layers.0.self_attn.q_proj.weight": w(128, 128),
        "model.layers.0.feed_forward.gate.weight": w(8, 128),
        "model.layers.0.feed_forward.experts.0.w1.weight": w(64, 128),
        "model.layers.0.operator_norm.weight": w(128),
        "model.layers.0.conv.conv.weight": w(128, 1, 3),
        "model.layers.0.odd.weight": w(16, 100),
    }


@pytest.mark.parametrize("plane", ["int8", "int4"])
@pytest.mark.parametrize("density", [0.0, 0.002, 0.02, 1.0])
def test_plane_delta_equals_the_diff_of_numpy_planes(plane: str, density: float) -> None:
    rng = np.random.default_rng(int(density * 1000) + len(plane))
    before = model_state(rng)
    after = {k: changed_copy(rng, v, density) & np.uint16(0xBFFF) for k, v in before.items()}  # finite values
    before = {k: v & np.uint16(0xBFFF) for k, v in before.items()}
    previous = PreviousState()
    previous.reset(torch_state(before))
    bf16_delta = previous.diff(torch_state(after))
    ours = previous.plane_delta(torch_state(after), bf16_delta.keys(), plane, "lfm2_moe")
    theirs = diff(plane_bits(before, plane, "lfm2_moe"), plane_bits(after, plane, "lfm2_moe"))
    assert_same_delta(ours, theirs)
    if density:
        assert any(k.endswith(".scales") for k in ours)
        conv = "model.layers.0.conv.conv.weight"  # kept bf16 by the plane: its bf16 entry as it is
        assert (conv in ours) == (conv in bf16_delta)


@pytest.mark.parametrize("plane", ["int8", "int4"])
@pytest.mark.parametrize("density", [0.0, 0.002, 1.0])
def test_plane_step_is_the_numpy_planes_change_and_reads_the_new_plane(plane: str, density: float) -> None:
    """`plane_step` of a gathered version: the diff of both numpy planes, the old plane's bits at
    its indices, and every tensor of the new plane on request (after `commit` too), each bf16
    tensor quantized once for its three arrays; `plane_reader` reads the previous version's plane;
    `plane_shapes` gives the plane's shapes."""
    rng = np.random.default_rng(int(density * 1000) + 7 * len(plane))
    before = {k: v & np.uint16(0xBFFF) for k, v in model_state(rng).items()}  # finite values
    after = {k: changed_copy(rng, v, density) & np.uint16(0xBFFF) for k, v in before.items()}
    old_plane, new_plane = plane_bits(before, plane, "lfm2_moe"), plane_bits(after, plane, "lfm2_moe")
    assert plane_shapes({k: v.shape for k, v in after.items()}, plane, "lfm2_moe") == {
        k: v.shape for k, v in new_plane.items()
    }
    previous = PreviousState()
    previous.reset(torch_state(before))
    previous.begin()
    for name, tensor in torch_state(after).items():  # as a gather streams it
        previous.diff_tensor(name, tensor)
    previous.end()
    reader = previous.plane_reader(plane, "lfm2_moe", "cpu")  # type: ignore[arg-type]
    assert all(np.array_equal(reader(key), bits) for key, bits in old_plane.items())  # the previous version's plane
    step = previous.plane_step(plane, "lfm2_moe", "cpu")  # type: ignore[arg-type]
    theirs = diff(old_plane, new_plane)
    assert_same_delta(step.delta, theirs)
    assert step.old.keys() == theirs.keys()
    for key, (indices, _) in theirs.items():
        assert step.old[key].dtype == np.uint16 and np.array_equal(step.old[key], old_plane[key].reshape(-1)[indices])
    moved = previous.transfer.device_to_host
    for key, bits in new_plane.items():  # in the plane's order: a quantized weight's arrays together
        got = step.tensor(key)
        assert got.dtype == np.uint16 and got.shape == bits.shape and np.array_equal(got, bits), key
    assert previous.transfer.device_to_host - moved == sum(b.nbytes for b in new_plane.values())
    previous.commit()
    assert all(np.array_equal(step.tensor(key), bits) for key, bits in new_plane.items())
    with pytest.raises(KeyError):
        step.tensor("model.layers.0.odd.scales")  # not a tensor of the plane
    with pytest.raises(RuntimeError, match="plane_step"):
        previous.plane_step(plane, "lfm2_moe", "cpu")  # type: ignore[arg-type]


def test_device_budget_places_tensors_in_order_and_config_is_checked() -> None:
    with pytest.raises(ValueError, match="device_budget_bytes"):
        DeviceDeltaConfig(device_budget_bytes=-1)
    assert device_delta.DEFAULT_DEVICE_BUDGET_BYTES == DeviceDeltaConfig().device_budget_bytes == 0
    previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=1 << 30))
    previous.reset(torch_state({"a": np.zeros(4, np.uint16)}))
    assert previous.device_bytes() == 0  # CPU tensors are host memory, whatever the budget


def test_a_plane_step_read_by_many_threads_quantizes_each_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher's digest reads a plane step's changed keys on its threads (`sparse_digest`,
    eight by default), so reads of several quantized weights' arrays interleave: each bf16 tensor
    is still quantized, and its plane arrays copied to the host, once."""
    rng = np.random.default_rng(11)
    before = {k: v & np.uint16(0xBFFF) for k, v in model_state(rng).items()}
    after = {k: changed_copy(rng, v, 1.0) & np.uint16(0xBFFF) for k, v in before.items()}
    new_plane = plane_bits(after, "int8", "lfm2_moe")
    previous = PreviousState()
    previous.reset(torch_state(before))
    previous.diff(torch_state(after))
    step = previous.plane_step("int8", "lfm2_moe", "cpu")
    quantized: list[str] = []
    real = device_delta._plane_of
    monkeypatch.setattr(device_delta, "_plane_of", lambda name, *a: (quantized.append(name), real(name, *a))[1])
    moved = previous.transfer.device_to_host
    keys = sorted(step.delta)
    # eight readers each taking the next key in turn, as a thread pool over the sorted names does,
    # and finishing out of order: the first halves of the keys, then the second halves, interleaved
    order = [k for pair in itertools.zip_longest(keys[: len(keys) // 2], keys[len(keys) // 2 :]) for k in pair if k]
    for key in order:
        assert np.array_equal(step.tensor(key), new_plane[key]), key
    owners = {name for name in after if any(k.startswith(name.removesuffix("weight")) for k in keys)}
    assert sorted(quantized) == sorted(owners) and len(quantized) == len(set(quantized)), quantized
    arrays = {k for name in owners for k in new_plane if k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0]}
    assert previous.transfer.device_to_host - moved == sum(new_plane[k].nbytes for k in arrays)


def test_a_copy_from_a_handed_over_host_state_consumes_it() -> None:
    """`reset_from_host(consume=True)`: each tensor leaves the handed-over dict once copied (one
    host copy of the model at a time, not two); the copy is the state; a read-only mapping is
    refused, and without `consume` the state is left as it was."""
    from types import MappingProxyType

    rng = np.random.default_rng(5)
    state = {f"t{i}": random_bits(rng, (8, 16)) for i in range(4)}
    want = {k: v.copy() for k, v in state.items()}
    kept = PreviousState()
    kept.reset_from_host(state, "cpu")
    assert state.keys() == want.keys()
    handed = dict(state)
    kept.reset_from_host(handed, "cpu", consume=True)
    assert handed == {} and kept.names == frozenset(want)
    for name, bits in want.items():
        assert np.array_equal(kept.previous_bits(name), bits), name
    with pytest.raises(TypeError, match="mutable mapping"):
        kept.reset_from_host(MappingProxyType(want), "cpu", consume=True)
