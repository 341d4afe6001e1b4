"""plane.updated_plane_bits re-quantizes a tensor's touched groups, or the whole tensor from
WHOLE_TENSOR_SHARE of its groups touched on; either way the plane equals plane_bits of the new
state, bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from slime_stoa.protocol.pulse import plane as plane_mod
from slime_stoa.protocol.pulse.codec import float32_to_bf16_bits
from slime_stoa.protocol.pulse.plane import QuantPlane, plane_bits, updated_plane_bits

SHAPES = {"a.weight": (16, 256), "b.weight": (8, 128), "norm.weight": (128,)}


def state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: float32_to_bf16_bits(rng.normal(0, 0.02, s).astype(np.float32)) for n, s in SHAPES.items()}


def stepped(before: dict[str, np.ndarray], every: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`before` with every `every`-th element of each tensor nudged by 1-3 ulp, and the changed indices."""
    rng = np.random.default_rng(seed)
    after, changed = {}, {}
    for name, bits in before.items():
        flat = bits.reshape(-1).copy()
        where = np.arange(int(rng.integers(0, every)), flat.size, every)
        flat[where] ^= rng.integers(1, 4, where.size).astype(np.uint16)
        after[name], changed[name] = flat.reshape(bits.shape), where
    return after, changed


@pytest.mark.parametrize("plane", ["int8", "int4"])
@pytest.mark.parametrize("every", [1, 7, 50, 640])  # groups of 64 touched: all, all, most, a tenth
def test_updated_plane_bits_is_plane_bits_on_either_path(monkeypatch: pytest.MonkeyPatch, plane: QuantPlane, every: int) -> None:
    before = state(0)
    after, changed = stepped(before, every, seed=every)
    previous = plane_bits(before, plane)
    expected = plane_bits(after, plane)
    calls: list[str] = []
    real = plane_mod.quantize_groups_into

    def spy(w: np.ndarray, rows: np.ndarray, *args: Any, name: str = "w", **kwargs: Any) -> None:
        calls.append(name)
        real(w, rows, *args, name=name, **kwargs)

    monkeypatch.setattr(plane_mod, "quantize_groups_into", spy)
    for share in (0.0, plane_mod.WHOLE_TENSOR_SHARE, 1.01):  # always whole, as shipped, never whole
        monkeypatch.setattr(plane_mod, "WHOLE_TENSOR_SHARE", share)
        calls.clear()
        got = updated_plane_bits(previous, after, changed, plane)
        assert got.keys() == expected.keys()
        for name, a in expected.items():
            assert got[name].dtype == a.dtype and np.array_equal(got[name], a), (share, name)
        touched = {n: np.unique(changed[n] // 64).size / (before[n].size // 64) for n in ("a.weight", "b.weight")}
        assert sorted(calls) == sorted(n for n, t in touched.items() if t < share), (share, touched)
    assert all(np.array_equal(previous[n], a) for n, a in plane_bits(before, plane).items())  # previous untouched
