"""pulse.quant's pass-by-pass quantizer: bit-exact with mx.quantize across pass boundaries (a
partial last pass included), its refusals name the right element or group in any pass and write
nothing, and `quantize_groups_into` re-quantizes chosen groups in place exactly as `quantize`;
bench_publish's quantizer rates hold per contender and thread count."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mx = pytest.importorskip("mlx.core")

from slime_stoa.protocol.pulse import quant
from slime_stoa.protocol.pulse.codec import float32_to_bf16_bits
from slime_stoa.protocol.pulse.quant import quantize, quantize_groups_into
from tests.scripts_loader import load_script

PARAMS = [(64, 8), (64, 4), (32, 4), (128, 4), (32, 8), (128, 8), (64, 2), (32, 2)]


def hostile_state(group_size: int, rows: int, seed: int) -> np.ndarray:
    """bf16 bits (rows, 3 groups): normal weights with hostile groups mixed in (all positive, all
    equal, all negative, exact halves, tiny, huge, an outlier)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.02, (rows, 3 * group_size)).astype(np.float32)
    g = w.reshape(-1, group_size)
    g[0::14] = np.abs(g[0::14]) + 0.5
    g[1::7] = -3.5
    g[2::7] = -np.abs(g[2::7]) - 10
    g[3::7] = rng.integers(-8, 9, g[3::7].shape)
    g[4::7] *= 1e-37
    g[5::7] *= 1e36
    g[6::7, 3] = 40.0
    return float32_to_bf16_bits(w)


def mlx_quantize(bits16: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    wq, scales, biases = mx.quantize(mx.array(bits16).view(mx.bfloat16), group_size, bits)
    return np.array(wq), np.array(scales.view(mx.uint16)), np.array(biases.view(mx.uint16))


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_passes_match_mx_quantize(monkeypatch: pytest.MonkeyPatch, group_size: int, bits: int) -> None:
    w = hostile_state(group_size, 11, seed=bits + group_size)  # 33 groups: passes of 4, the last of 1
    monkeypatch.setattr(quant, "_GROUPS_PER_PASS", 4)
    q = quantize(w, group_size, bits)
    theirs_all = mlx_quantize(w, group_size, bits)
    for ours, theirs, what in zip((q.codes, q.scales, q.biases), theirs_all, ("codes", "scales", "biases"), strict=True):
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), what
    monkeypatch.setattr(quant, "_GROUPS_PER_PASS", 1 << 11)
    whole = quantize(w, group_size, bits)
    assert all(np.array_equal(a, b) for a, b in zip((q.codes, q.scales, q.biases), (whole.codes, whole.scales, whole.biases), strict=True))


def test_refusals_in_a_later_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_GROUPS_PER_PASS", 4)
    ok = hostile_state(64, 5, seed=1)  # 15 groups, 4 passes
    for bad in (np.inf, -np.inf, np.nan):
        w = ok.copy()
        w[3, 100] = float32_to_bf16_bits(np.array([bad], np.float32))[0]  # group 10, the third pass
        w[4, 5] = w[3, 100]  # a later pass too: the first one is named
        with pytest.raises(ValueError, match=f"'t': non-finite value at flat index {3 * 192 + 100};"):
            quantize(w, 64, 8, name="t")
    w = ok.copy()
    w[2, 64:66] = float32_to_bf16_bits(np.array([-2e38, 2e38], np.float32))  # group 7: the range overflows
    with pytest.raises(ValueError, match="group 7: MLX's scale for it would be inf"):
        quantize(w, 64, 4)
    w[4, 7] = float32_to_bf16_bits(np.array([np.nan], np.float32))[0]  # a NaN in a later pass is named first
    with pytest.raises(ValueError, match=f"non-finite value at flat index {4 * 192 + 7};"):
        quantize(w, 64, 4)
    w = ok.copy()
    w[3, 0:64] = float32_to_bf16_bits(np.array([3e38], np.float32))  # group 9: edge / eps overflows
    with pytest.raises(ValueError, match="group 9: MLX's scale for it would be 0"):
        quantize(w, 64, 4)


@pytest.mark.parametrize(("group_size", "bits"), PARAMS)
def test_quantize_groups_into_equals_quantize(monkeypatch: pytest.MonkeyPatch, group_size: int, bits: int) -> None:
    monkeypatch.setattr(quant, "_GROUPS_PER_PASS", 4)
    before = hostile_state(group_size, 9, seed=3)
    after = hostile_state(group_size, 9, seed=4)
    n = before.size // group_size
    rows = np.array([n - 1, 0, 5, 5, 12, 3, 20, 13, 2], dtype=np.int32)  # unsorted, a repeat, int32
    old, new = quantize(before, group_size, bits), quantize(after, group_size, bits)
    codes = old.codes.reshape(n, -1).copy()
    scales, biases = old.scales.reshape(-1).copy(), old.biases.reshape(-1).copy()
    quantize_groups_into(after, rows, codes, scales, biases, group_size, bits)
    expect = np.zeros(n, dtype=bool)
    expect[rows] = True
    for got, was, now in ((codes, old.codes, new.codes), (scales, old.scales, new.scales), (biases, old.biases, new.biases)):
        was, now = was.reshape(n, -1), now.reshape(n, -1)
        assert np.array_equal(got.reshape(n, -1)[expect], now[expect])  # the chosen groups: the new ones
        assert np.array_equal(got.reshape(n, -1)[~expect], was[~expect])  # the rest untouched
    quantize_groups_into(after, np.arange(n), codes, scales, biases, group_size, bits)
    assert np.array_equal(codes, new.codes.reshape(n, -1)) and np.array_equal(scales, new.scales.reshape(-1))
    quantize_groups_into(after, np.array([], dtype=np.int64), codes, scales, biases, group_size, bits)  # nothing to do


def test_quantize_groups_into_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_GROUPS_PER_PASS", 4)
    w = hostile_state(64, 4, seed=5)  # 12 groups
    q = quantize(w, 64, 8)
    codes, scales, biases = q.codes.reshape(12, 16).copy(), q.scales.reshape(-1).copy(), q.biases.reshape(-1).copy()
    for rows in (np.array([12]), np.array([-1]), np.array([[1]]), np.array([0.0])):
        with pytest.raises(ValueError, match=r"'t': .*rows"):
            quantize_groups_into(w, rows, codes, scales, biases, 64, 8, name="t")
    for outputs in ((codes.astype(np.int64), scales, biases), (codes[:6], scales, biases), (codes, scales[:6], biases),
                    (codes, scales, biases.astype(np.float32))):
        with pytest.raises(ValueError, match="outputs must be uint32 codes"):
            quantize_groups_into(w, np.array([1]), *outputs, 64, 8)
    bad = w.copy()
    bad[2, 130] = float32_to_bf16_bits(np.array([np.inf], np.float32))[0]  # group 8
    with pytest.raises(ValueError, match=f"non-finite value at flat index {2 * 192 + 130}"):
        quantize_groups_into(bad, np.array([1, 8]), codes, scales, biases, 64, 8)
    other = hostile_state(64, 4, seed=6)
    other[3, 150] = bad[2, 130]  # group 11, in the last of 3 passes of 4 groups
    with pytest.raises(ValueError, match=f"non-finite value at flat index {3 * 192 + 150}"):
        quantize_groups_into(other, np.arange(12), codes, scales, biases, 64, 8, name="t")
    assert np.array_equal(codes, q.codes.reshape(12, 16)) and np.array_equal(scales, q.scales.reshape(-1))  # nothing written
    quantize_groups_into(bad, np.array([1, 9]), codes, scales, biases, 64, 8)  # group 8 not asked for
    assert np.array_equal(codes, q.codes.reshape(12, 16))




def test_bench_baseline_is_the_same_quantizer_and_rates_are_reported() -> None:
    bench = load_script("bench_publish")
    w = hostile_state(64, 6, seed=6)
    for bits in (8, 4, 2):
        q = quantize(w, 64, bits)
        base = bench.baseline_quantize(w, 64, bits)
        assert all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip((q.codes, q.scales, q.biases), base, strict=True))
    shapes = {"a.weight": (8, 128), "b.weight": (4, 256), "norm.weight": (128,)}
    rates = bench.quantize_rates(shapes, density=0.05, seed=0, repeat=2)  # checks the contenders agree first
    assert rates.keys() == {"whole", "touched"}
    for planes in rates.values():
        assert planes.keys() == {"int8", "int4"}
        for per in planes.values():
            assert per.keys() == {"current", "baseline"}
            for threads in per.values():
                assert threads.keys() == {str(t) for t in bench.QUANT_THREADS}
                for s in threads.values():
                    assert s["n"] == 2 and all(math.isfinite(s[k]) for k in ("min", "median", "max"))
                    assert 0 < s["min"] <= s["median"] <= s["max"]
