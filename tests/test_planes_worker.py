"""A real MLX worker on a quantized plane the run publishes: it follows the plane alone (no bf16
master), serves mlx-lm's quantized model whose weights equal mx.quantize of the trainer's bf16
weights bit for bit, and labels its groups with the bf16 versions' published state digests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from macd.config import decoding_sequences
from macd.cpu_compute import computes_float32_activations, use_float32_activations
from macd.following import held_plane, served_digest
from macd.plane_choice import choose_plane
from macd.plane_weights import PlaneWeights, plane_structure
from macd.worker import Worker, WorkerOptions
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_manifest, read_pointer
from slime_stoa.protocol.pulse.plane import code_names, plane_bits
from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.pulse.quant import plane_names
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.seeding import seed_run, tiny_synthetic_model
from tests.conftest import async_wait_until
from tests.test_worker import RUN, daemon_config, records


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("tiny") / "model")


def nudged(state: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    new = {k: v.copy() for k, v in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        flat[rng.random(flat.size) < 0.02] ^= 3
    return new


def test_the_plane_a_worker_holds() -> None:
    both = RunManifest(run=RUN, model="m", task="t", plane="int8", planes=("int8", "int4"))
    assert held_plane(both, "int8") == "int8" and held_plane(both, "int4") == "int4" and held_plane(both, "bf16") is None
    plain = RunManifest(run=RUN, model="m", task="t", plane="int8")
    assert held_plane(plain, "int8") is None  # no int8 plane published: quantized here from the bf16 weights
    with pytest.raises(ValueError, match="does not publish the int4 plane"):
        held_plane(plain, "int4")
    with pytest.raises(ValueError, match="does not publish the int8 plane"):  # neither served nor published
        held_plane(RunManifest(run=RUN, model="m", task="t"), "int8")
    assert served_digest(None, "ab") == "ab"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_synthetic_model(tmp_path_factory.mktemp("moe") / "model", "lfm2_moe", num_layers=2)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


@pytest.mark.parametrize("family", ["qwen2", "lfm2_moe"])
@pytest.mark.parametrize("plane", ["int8", "int4"])
def test_the_served_model_is_mlx_lms_quantized_model_of_the_trainers_weights(
    model_dir: Path, moe_dir: Path, family: str, plane: str
) -> None:
    from macd.generate import build_model
    from macd.hf_layout import live_weights

    folder = model_dir if family == "qwen2" else moe_dir
    config = json.loads((folder / "config.json").read_text())
    bf16 = load_hf_state(folder)
    state = plane_bits(bf16, plane, config["model_type"])  # type: ignore[arg-type]
    served, _ = build_model(folder)
    live = PlaneWeights.from_state(served, state, plane)  # type: ignore[arg-type]
    assert live.shares(state) and live.digest_check(state)
    assert bool(live.slots) == (family == "lfm2_moe")  # LFM2: experts' codes are rows of switch_mlp stacks
    reference, _ = build_model(folder)
    live_weights(reference, {n: a.copy() for n, a in bf16.items()}, "bf16")
    quantize_model(reference, config, 64, 8 if plane == "int8" else 4)  # mlx-lm's own rule (the router at 8 bits)
    want = dict(tree_flatten(reference.parameters()))
    got = dict(tree_flatten(served.parameters()))
    assert got.keys() == want.keys()
    for name, array in want.items():
        assert got[name].dtype == array.dtype and np.array_equal(_bits(got[name]), _bits(array)), name
    if computes_float32_activations(served):  # MLX's CPU device: compare like with like
        use_float32_activations(reference)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    assert np.array_equal(np.array(served(tokens).astype(mx.float32)), np.array(reference(tokens).astype(mx.float32)))
    # A patch committed into the state writes the served weights in place (an expert's row of its stack).
    name = next(n for n in state if n.endswith(".scales") and (family == "qwen2" or ".experts." in n))
    state[name].reshape(-1)[0] ^= 1
    assert live.digest_check(state) and live.apply(state, {name: np.array([0])}, (name,)).tensors == 0
    replaced = dict(state)
    replaced[name] = state[name].copy()  # a new array (an anchor's): installed again, then shared
    assert live.apply(replaced, {name: np.array([0])}, (name,)).tensors == 1
    assert live.shares(replaced) and live.digest_check(replaced)


def test_plane_weights_refuse_what_does_not_fit(model_dir: Path) -> None:
    from macd.generate import build_model

    state = plane_bits(load_hf_state(model_dir), "int4", "qwen2")
    assert set(plane_structure(state).values()) == {4}
    bad = dict(state)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:, :12].copy()  # 3 bits
    with pytest.raises(ValueError, match="up_proj"):
        plane_structure(bad)
    model, _ = build_model(model_dir)
    extra = dict(state, **{"model.extra.weight": np.zeros((4, 4), np.uint16)})
    with pytest.raises(ValueError, match=r"model\.extra\.weight: not a parameter"):
        PlaneWeights.from_state(model, extra, "int4")
    model, _ = build_model(model_dir)
    short = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        PlaneWeights.from_state(model, short, "int4")
    model, _ = build_model(model_dir)
    live = PlaneWeights.from_state(model, state, "int4")
    assert live.shares(state) and live.digest_check(state) and not live.master_apart
    assert isinstance(model.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert model.model.layers[0].mlp.up_proj.bits == 4 and model.model.layers[0].mlp.up_proj.group_size == 64
    state["model.layers.0.mlp.up_proj.biases"].reshape(-1)[0] ^= 1  # written into the served memory
    assert live.digest_check(state)
    stranger = dict(state)
    stranger["model.norm.weight"] = state["model.norm.weight"].copy()
    stranger["model.norm.weight"][0] ^= 1
    assert live.mismatches(stranger) == ["model.norm.weight"]


async def test_a_worker_on_the_int8_plane_holds_the_plane_alone(
    store: Store, store_url: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", group_size=4, max_tokens=4, planes=("int8",))
    config = daemon_config(store_url, tmp_path / "data")
    # A Mac whose memory fits the tiny model on the int8 plane but not on the run's bf16 plane.
    monkeypatch.setattr("macd.plane_choice.plan_device", lambda: "gpu")  # a Mac's figures, on any machine
    model_config = json.loads((model_dir / "config.json").read_text())
    sequences = decoding_sequences(config, manifest.group_size)
    needed = {p: choose_plane(model_config, replace(manifest, plane=p), memory=1 << 40, sequences=sequences).needed  # type: ignore[union-attr]
              for p in ("bf16", "int8")}
    assert needed["int8"] < needed["bf16"]
    monkeypatch.setattr("macd.following.memory_bytes", lambda: int((needed["int8"] + needed["bf16"]) / 2 * 1.5))
    pub = await seed_run(
        store, manifest, model_dir, task_count=50,
        publisher=PublisherConfig(extras_dir=model_dir, planes=("int8",)),
    )
    states = [load_hf_state(model_dir)]
    worker = Worker(config, store, WorkerOptions(seed=3))
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await async_wait_until(lambda: worker.cohorts >= 1 or run.done(), timeout=120, message="a first cohort")
    for v in (1, 2):
        states.append(nudged(states[-1], v))
        result = await pub.publish(states[-1])
        assert result.version == v and result.planes == ("int8",)
        await async_wait_until(lambda v=v: worker.weights.installed[0] >= v or run.done(), timeout=120, message=f"v{v} installed")

    async def v2_landed() -> bool:
        return run.done() or any(g.weight_version == 2 for g in await records(store))

    await async_wait_until(v2_landed, timeout=120, interval=0.1, message="a v2 group in the bucket")
    stop.set()
    assert await asyncio.wait_for(run, 120) == 0

    sub, live = worker.sub, worker.live
    assert sub is not None and sub.layout == RunLayout(RUN, "int8") and sub.version == 2
    assert sub.state is None  # the live weights own every weight byte; the subscriber holds none
    assert isinstance(live, PlaneWeights) and live.shares(live.state) and live.digest_check(live.state)
    plane_pointer = await read_pointer(store, RUN, plane="int8")
    assert sub.digest is not None and sub.digest.root() == plane_pointer.state_digest
    # Served weights: mx.quantize of the trainer's bf16 weights at v2, bit for bit; the rest bf16.
    bf16 = states[-1]
    codes = code_names({n: a.shape for n, a in bf16.items()}, "int8", "qwen2")
    modules = dict(live.model.named_modules())
    assert codes and all(isinstance(modules[n.rpartition(".")[0]], nn.QuantizedLinear | nn.QuantizedEmbedding) for n in codes)
    for name, bits in bf16.items():
        served = live._param(name)
        if name not in codes:
            assert served.dtype == mx.bfloat16 and np.array_equal(np.array(served.view(mx.uint16)), bits), name
            continue
        wq, scales, biases = mx.quantize(mx.array(bits).view(mx.bfloat16), 64, 8)
        _, scales_name, biases_name = plane_names(name)
        assert served.dtype == mx.uint32 and np.array_equal(np.array(served), np.array(wq)), name
        for leaf, expected in ((scales_name, scales), (biases_name, biases)):
            assert np.array_equal(np.array(live._param(leaf).view(mx.uint16)), np.array(expected.view(mx.uint16))), leaf
        # The plane alone: under a quantized weight's name the worker holds its codes (1 byte per weight).
        assert live.state[name].nbytes == bits.size, name
    assert live.state.keys() == {n for c in codes for n in plane_names(c)} | (bf16.keys() - codes)
    held = sum(a.nbytes for a in live.state.values())
    assert held == live.nbytes < 0.6 * sum(a.nbytes for a in bf16.values())  # no bf16 master beside it
    # Groups carry the bf16 versions' published digests (what the trainer admits records against).
    published = {}
    for v in range(3):
        plane_v = await read_manifest(store, RunLayout(RUN, "int8").version_manifest(v, _attempt(await _keys(store, v))))
        assert plane_v.source is not None
        published[v] = plane_v.source.state_digest
    assert published[2] == (await read_pointer(store, RUN)).state_digest
    got = await records(store)
    assert got and {g.weight_version for g in got} <= {0, 1, 2}
    assert all(g.state_digest == published[g.weight_version] for g in got)


async def _keys(store: Store, version: int) -> list[str]:
    return [i.key async for i in store.list(RunLayout(RUN, "int8").version_manifests_prefix(version))]


def _attempt(keys: list[str]) -> str:
    assert len(keys) == 1, keys
    parsed = RunLayout(RUN, "int8").parse_version_manifest(keys[0])
    assert parsed is not None
    return parsed[1]
