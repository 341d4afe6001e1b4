"""Quantization groups that exercise every branch of MLX's affine quantization: the numpy
quantizer is checked against ``mx.quantize`` on them (test_quant_plane) and the torch one against
the numpy one (test_device_delta)."""

from __future__ import annotations

import numpy as np

from slime_stoa.protocol.pulse.codec import float32_to_bf16_bits


def hostile_rows(group_size: int, rng: np.random.Generator) -> np.ndarray:
    """bf16 bits, one hostile group per row."""
    g = group_size
    rows: list[np.ndarray] = []

    def add(values: np.ndarray | list[float] | float) -> None:
        rows.append(float32_to_bf16_bits(np.broadcast_to(np.asarray(values, np.float32), (g,)).copy()))

    for value in (0.0, -0.0, 1.0, -3.5, 1e-30, -1e-30, 1e-39, 1e31, -1e31, 2.0**-133, 5e-8, -5e-8):
        add(value)  # all equal (tiny, subnormal, huge, around eps / 2)
    mixed_zero = np.zeros(g, np.float32)
    mixed_zero[::2] = -0.0
    add(mixed_zero)
    add(-np.abs(rng.normal(0, 1, g)))  # negative only
    add(np.abs(rng.normal(0, 1, g)))  # positive only
    add(-np.abs(rng.normal(0, 1, g)) - 10)  # negative only, far from 0
    add(rng.normal(0, 1, g) * 1e37)  # huge, range within float32
    add(rng.normal(0, 1, g) * 1e-36)  # tiny
    add(rng.normal(0, 1, g) * 1e-39)  # subnormal
    add(rng.normal(0, 1, g) * 3e-8)  # range near eps: the scale clamps
    add(rng.normal(0, 1, g) * 3e-9)
    add(np.abs(rng.normal(0, 1, g)) * 3e-8)
    outlier = rng.normal(0, 0.01, g)
    outlier[g // 3] = 40.0
    add(outlier)
    outlier[g // 3] = -40.0
    add(outlier)
    for _ in range(4):  # small integers: many exact halves, rounded to even
        add(rng.integers(-8, 9, g).astype(np.float32))
        add(rng.integers(0, 6, g).astype(np.float32) * 0.25)
    # uniformly random finite bit patterns, one exponent range per group (no float32 overflow)
    for _ in range(16):
        top = int(rng.integers(0, 253))
        exps = np.clip(top - rng.integers(0, 6, g), 0, 253)
        signs = rng.integers(0, 2, g)
        mant = rng.integers(0, 128, g)
        rows.append(((signs << 15) | (exps << 7) | mant).astype(np.uint16))
    return np.stack(rows)
