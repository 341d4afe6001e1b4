"""A quantized plane through PULSE: the trainer's signed patches over the codes, scales and biases
of the int8 / 4-bit plane, a subscriber holding the plane alone, served weights equal to
mx.quantize of the trainer's bf16 weights at the head, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

import mlx.core as mx

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.pulse.plane import PLANE_PARAMS, check_plane, code_names, plane_bits, served
from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.protocol.pulse.quant import mlx_lm_predicate, plane_layout, plane_names
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.tiny_model import build_tiny_family, build_tiny_model

State = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, State]]:
    root = tmp_path_factory.mktemp("planes")
    out = {}
    for family, folder in (
        ("qwen2", build_tiny_model(root / "qwen2")),
        ("lfm2_moe", build_tiny_family(root / "lfm2_moe", "lfm2_moe")),
    ):
        model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
        out[family] = (model_type, load_hf_state(folder))
    return out


def nudged(state: State, seed: int) -> State:
    """1% of the weights moved by an optimizer-step-sized change."""
    rng = np.random.default_rng(seed)
    new = {k: v.copy() for k, v in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        at = np.flatnonzero(rng.random(flat.size) < 0.01)
        flat[at] ^= rng.integers(1, 8, size=at.size, dtype=np.uint16)
    return new


def test_plane_names_are_checked() -> None:
    assert check_plane("int8") == "int8" and check_plane("int4") == "int4"
    for bad in ("bf16", "int3", "INT8", "int8 "):
        with pytest.raises(ValueError, match="quantized plane"):
            check_plane(bad)


@pytest.mark.parametrize("family", ["qwen2", "lfm2_moe"])
@pytest.mark.parametrize("plane", ["int8", "int4"])
async def test_a_subscriber_on_a_plane_serves_mx_quantize_of_the_trainers_weights(
    store: Store, models: dict[str, tuple[str, State]], family: str, plane: str
) -> None:
    model_type, state = models[family]
    p = check_plane(plane)
    run = f"{family.replace('_', '-')}-{plane}"
    key = SigningKey.generate()
    pub = Publisher(store, run, key=key)
    sub = Subscriber(store, run, trust=RunTrust(run, key.public))
    states = [state]
    for seed in range(3):
        states.append(nudged(states[-1], seed))
    for v, bf16 in enumerate(states):
        result = await pub.publish(plane_bits(bf16, p, model_type))
        assert result.version == v
        synced = await sub.sync()
        assert synced is not None and synced.version == v
    assert synced.path == "step" and 0 < synced.bytes < result.full_bytes / 20  # patches, not the plane
    assert sub.state is not None and sub.digest is not None and sub.digest.root() == pub.state_digest
    shapes = {n: a.shape for n, a in state.items()}
    codes = code_names(shapes, p, model_type)
    params = plane_layout(shapes, *PLANE_PARAMS[p], mlx_lm_predicate(model_type))  # with mlx-lm's overrides
    assert codes == params.keys() and codes < state.keys()
    if family == "lfm2_moe":
        assert any(b == 8 for _, b in params.values())  # the MoE router stays at 8 bits on every plane
    weights = served(sub.state, codes)
    for name, bf16 in states[-1].items():
        if name not in codes:
            assert np.array_equal(weights[name], bf16), name  # kept bf16, as mlx-lm keeps it
            continue
        group_size, bits = params[name]
        wq, scales, biases = mx.quantize(mx.array(bf16).view(mx.bfloat16), group_size, bits)
        _, scales_name, biases_name = plane_names(name)
        assert weights[name].dtype == np.uint32 and np.array_equal(weights[name], np.array(wq)), name
        assert np.array_equal(weights[scales_name], np.array(scales.view(mx.uint16))), name
        assert np.array_equal(weights[biases_name], np.array(biases.view(mx.uint16))), name
        # The plane alone: under a quantized weight's name the subscriber holds its codes, no bf16 copy.
        assert sub.state[name].size == bf16.size * bits // 16, name
    plane_names_all = {n for name in codes for n in plane_names(name)} | (state.keys() - codes)
    assert sub.state.keys() == plane_names_all
