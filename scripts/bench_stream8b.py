"""Benchmark the weight plane at the LFM2.5-8B-A1B shape, streamed tensor by tensor so that it fits a
machine far smaller than the model (the whole bf16 model is ~17 GB; the bench holds one batch).

Shapes (`--shape`): "published" is LiquidAI/LFM2.5-8B-A1B's config.json (`macd.memory_plan`:
24 layers, 18 conv and 6 attention, vocabulary 128,000); "defaults" is transformers'
`Lfm2MoeConfig()` (32 layers, vocabulary 65,536; it names no layer types, so every layer is
attention, the rule `Lfm2Config` applies). Tensor names and shapes are the HF checkpoint's
(`quickstart.tiny_model.lfm2_param_shapes`: experts one by one, embeddings tied).

For each batch of tensors (at most `--batch-mib` of bf16, a larger tensor alone): a random bf16
"previous" state (normal weights scaled by 1/sqrt(fan-in)) and a "next" one that differs in
`--density` of the elements (seeded positions; each moves by 1-3 units in the last place, as an
RL step's Adam update does: ~1-3% of bf16 weights change per step). Then, timed:

  trainer, per thread count (`--threads`, the publisher's `threads`), contenders interleaved in
  rounds, each run as the publisher runs a version:
    bf16     `codec.diff`, the digest update of the changed tensors (`StateDigest.update`),
             `frames.encode_delta` ("rel", 16 MiB frames) and the patch's sha256;
    int8/int4  "quantize": the plane's next version from its previous one and the bf16 step's
             changed indices (`plane.updated_plane_bits`: only the touched groups re-quantized,
             a whole tensor once `WHOLE_TENSOR_SHARE` of its groups are touched), then the same
             step over the plane. A sample of tensors (every `PLANE_CHECK_EVERY`-th of a batch,
             the first round) is checked bit for bit against a full `plane.plane_bits`, untimed.
  device, per thread count, in the same rounds right after the numpy contenders (the numpy path
    is the baseline): the torch path (`trainer.device_delta`) on `--device` (the CPU here, CUDA on
    a GPU box) as the slime publisher runs it by delta, keeping the previous version beside the
    weights and no host copy: bf16 "diff" (`PreviousState.diff` and `sparse_step`: the patch and
    its old bits), int8/int4 "quantize" (`PreviousState.plane_step`: both versions' planes of the
    changed tensors quantized on the device, compared there), then "digest" (each changed tensor,
    or its plane arrays, read from the device once and hashed on the host: xxh3 has no parallel
    form a device could run), encode from the old bits and sha256. The first round checks every
    delta bit for bit against the numpy path's. Reported: its wall and CPU seconds per version,
    and the bytes each path moves from the device to the host per version (numpy: the whole bf16
    state, as `publish.gather_state` copies it; torch: the patches, their old bits, and every
    changed tensor and its plane arrays for the digests).
  Not timed: catch-up patches (merge and encode at the distances the schedule picks), uploads,
  anchors, the state digest's root.
  worker, per thread count: `apply.apply_patch` (verify, decode, scatter) of the step patch into
    the held state of each plane, then re-hashing the touched tensors on that many threads.
    Each round is undone with the undo log; the first round checks the result is bit for bit
    the next state.

Reported per version (one train step) of the whole model: bytes of the bf16 step patch and of the
int8 / 4-bit plane patches against the anchors (bf16, int8, int4: the states' bytes); trainer CPU
seconds (process CPU time, all threads; `cpu_ns_per_element` per weight) and wall seconds; worker
apply seconds (wall and CPU); the served-weights memory per plane (bytes of the plane's tensors;
a worker on a quantized plane holds no bf16 master); the share of the quantized tensors' groups a
version touches and of their elements quantized as whole tensors; the bench's own peak RSS; the
load average at the start and the end; the date. min / median / max are over rounds (each
round's figure is a sum over every batch).

`--quick` measures a sample: the top-level tensors (embeddings, final norm) and the first layer
of each kind (layer type x dense / MoE feed-forward: "published" has dense conv, MoE conv and MoE
attention layers), and scales each sampled layer's figures by the number of layers of its kind,
which is scaling by parameter count (layers of one kind have the same tensors). The full run
streams every tensor. `--smoke` is a tiny model of the same family (the test's size). On two
cores, "published" with the defaults: `--quick` ~2 minutes, the full run ~14 minutes; peak RSS
~2.6 GB either way.

Usage: python scripts/bench_stream8b.py [--quick | --smoke] [--shape published|defaults] [--density 0.02]
       [--rounds 3] [--threads 1,2] [--batch-mib 256] [--seed 0] [--device cpu|cuda] [--json PATH]

Exits 1 when a result does not check out, 2 when it cannot run (e.g. `--device cuda` without CUDA).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import sys
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Session, spread

from macd.memory_plan import LFM2_5_8B_A1B
from slime_stoa.protocol.pulse.apply import apply_patch
from slime_stoa.protocol.pulse.codec import Delta, diff, float32_to_bf16_bits, shapes_of
from slime_stoa.protocol.pulse.digest import StateDigest, tensor_digest
from slime_stoa.protocol.pulse.frames import encode_delta, frame_slice
from slime_stoa.protocol.pulse.plane import (
    PLANE_PARAMS,
    WHOLE_TENSOR_SHARE,
    QuantPlane,
    code_names,
    plane_bits,
    updated_plane_bits,
)
from slime_stoa.protocol.pulse.step_diff import sparse_digest
from slime_stoa.protocol.run_trust import content_hash
from slime_stoa.quickstart.tiny_model import lfm2_param_shapes
from slime_stoa.trainer.device_delta import PreviousState

Shape = Literal["published", "defaults"]
SHAPES: tuple[Shape, ...] = ("published", "defaults")
QUANT: tuple[QuantPlane, ...] = ("int8", "int4")
PLANES = ("bf16", *QUANT)
MODEL_TYPE = "lfm2_moe"
#: The plane check compares every this-many-th tensor of a batch (the first included).
PLANE_CHECK_EVERY = 8

#: transformers' `Lfm2MoeConfig()` (5.x), the fields that decide tensor shapes: the published
#: config but for the vocabulary, the layer count and the layer types (none named).
LFM2_MOE_DEFAULTS: dict[str, Any] = {**LFM2_5_8B_A1B, "vocab_size": 65536, "num_hidden_layers": 32, "layer_types": None}

#: `--smoke`: the published layout at a tiny width (the test's size).
SMOKE: dict[str, Any] = {
    **LFM2_5_8B_A1B, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
    "num_dense_layers": 1, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
}


def config_of(shape: Shape) -> dict[str, Any]:
    return dict(LFM2_5_8B_A1B if shape == "published" else LFM2_MOE_DEFAULTS)


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """The config's layer types; none given means every layer is attention (`Lfm2Config`'s rule)."""
    return list(config.get("layer_types") or ["full_attention"] * int(config["num_hidden_layers"]))


def param_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint: name -> shape."""
    return lfm2_param_shapes(
        vocab_size=int(config["vocab_size"]), hidden_size=int(config["hidden_size"]),
        layer_types=layer_types(config), num_heads=int(config["num_attention_heads"]),
        num_kv_heads=int(config["num_key_value_heads"]), ff_dim=int(config["intermediate_size"]),
        conv_kernel=int(config["conv_L_cache"]), num_experts=int(config["num_experts"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]), num_dense_layers=int(config["num_dense_layers"]),
    )


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (None: embeddings, final norm)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def layer_kinds(config: Mapping[str, Any]) -> list[str]:
    """Each layer's kind: its type and whether its feed-forward is dense or MoE."""
    dense = int(config["num_dense_layers"]) if int(config.get("num_experts") or 0) else 10**9
    return [f"{kind}/{'dense' if i < dense else 'moe'}" for i, kind in enumerate(layer_types(config))]


@dataclass(frozen=True, slots=True)
class Unit:
    """Tensors measured together, each standing for `weight` tensors of the whole model."""

    weight: int
    names: tuple[str, ...]


def plan_units(
    shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], *, quick: bool, batch_bytes: int
) -> tuple[list[Unit], list[int]]:
    """Batches of tensors to measure, and the layers measured. Quick: the top-level tensors and
    the first layer of each kind, weighted by its kind's layer count; else every tensor, weight 1."""
    kinds = layer_kinds(config)
    counts: dict[str, int] = defaultdict(int)
    for kind in kinds:
        counts[kind] += 1
    first = {kind: kinds.index(kind) for kind in counts}
    weight_of: dict[int | None, int] = {None: 1}
    for i, kind in enumerate(kinds):
        if not quick:
            weight_of[i] = 1
        elif first[kind] == i:
            weight_of[i] = counts[kind]
    groups: dict[int | None, list[str]] = defaultdict(list)
    for name in shapes:
        layer = layer_of(name)
        if layer in weight_of:
            groups[layer].append(name)
    units = []
    for layer, names in groups.items():
        batch: list[str] = []
        used = 0
        for name in names:
            size = 2 * math.prod(shapes[name])
            if batch and used + size > batch_bytes:
                units.append(Unit(weight_of[layer], tuple(batch)))
                batch, used = [], 0
            batch.append(name)
            used += size
        if batch:
            units.append(Unit(weight_of[layer], tuple(batch)))
    return units, sorted(i for i in weight_of if i is not None)


# ---------------------------------------------------------------------------------------------
# States


def tensor_rng(seed: int, name: str, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), stream])


def previous_bits(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """bf16 bits of a trained-looking tensor: norms near 1, weights N(0, 1/fan-in)."""
    rng = tensor_rng(seed, name, 0)
    values = rng.standard_normal(shape, dtype=np.float32)
    if "norm" in name:
        values *= np.float32(0.05)
        values += np.float32(1.0)
    else:
        values *= np.float32((shape[-1] if len(shape) > 1 else 16) ** -0.5)
    return float32_to_bf16_bits(values)


def next_bits(name: str, prev: np.ndarray, density: float, seed: int) -> np.ndarray:
    """`prev` with `density` of its elements (seeded positions, a repeat cancels rarely) moved by
    1-3 units in the last place: low mantissa bits flipped, never leaving the binade."""
    rng = tensor_rng(seed, name, 1)
    new = prev.copy()
    flat = new.reshape(-1)
    k = round(flat.size * density)
    if k:
        where = rng.integers(0, flat.size, size=k)
        flat[where] ^= rng.integers(1, 4, size=k, dtype=np.uint16)
    return new


# ---------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Process CPU and wall seconds of named parts, added up for one contender run."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def time(self, part: str, fn: Callable[[], Any]) -> Any:
        cpu, wall = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu[part] = self.cpu.get(part, 0.0) + time.process_time() - cpu
        self.wall[part] = self.wall.get(part, 0.0) + time.perf_counter() - wall
        return out


def digests(state: Mapping[str, np.ndarray], names: list[str], threads: int) -> list[bytes]:
    """Re-hash tensors `names` of `state` on `threads` threads (xxh3 releases the GIL)."""
    if threads <= 1 or len(names) <= 1:
        return [tensor_digest(n, state[n]) for n in names]
    with ThreadPoolExecutor(min(threads, len(names))) as pool:
        return list(pool.map(lambda n: tensor_digest(n, state[n]), names))


def publish_step(
    clock: Clock, base: dict[str, np.ndarray], new: dict[str, np.ndarray], digest: StateDigest, threads: int
) -> tuple[Delta, Any, bytes]:
    """The publisher's per-version work on one batch: diff, digest update, encode, content hash."""
    delta = clock.time("diff", lambda: diff(base, new, threads=threads))
    clock.time("digest", lambda: digest.update(new, delta.keys(), threads=threads))
    index, body = clock.time(
        "encode", lambda: encode_delta(delta, shapes_of(new), base=base, mode="rel", threads=threads)
    )
    clock.time("sha256", lambda: content_hash(body))
    return delta, index, body


def plane_mismatches(new: Mapping[str, np.ndarray], plane: Mapping[str, np.ndarray], names: list[str], q: QuantPlane) -> int:
    """How many plane arrays of tensors `names` (codes, scales, biases, or the bf16 tensor kept)
    differ from a full `plane_bits` of `new`, in dtype, shape or bits."""
    full = plane_bits({n: new[n] for n in names}, q, MODEL_TYPE)
    return sum(not (plane[k].dtype == a.dtype and np.array_equal(plane[k], a)) for k, a in full.items())


def group_counts(delta: Delta, shapes: Mapping[str, tuple[int, ...]], q: QuantPlane) -> tuple[int, int, int, int]:
    """Over the plane's quantized tensors: groups, groups a version touches, elements, and
    elements of tensors `updated_plane_bits` quantizes whole (`WHOLE_TENSOR_SHARE`)."""
    size = PLANE_PARAMS[q][0]
    groups = touched = elements = whole = 0
    for name in code_names(shapes, q, MODEL_TYPE):
        n = math.prod(shapes[name])
        hit = int(np.unique(delta[name][0] // size).size) if name in delta else 0
        groups, touched, elements = groups + n // size, touched + hit, elements + n
        whole += n if hit and hit >= WHOLE_TENSOR_SHARE * (n // size) else 0
    return groups, touched, elements, whole


def receive_step(clock: Clock, held: dict[str, np.ndarray], index: Any, body: bytes, threads: int) -> Any:
    """The worker's per-version work on one batch: verify, decode and scatter the patch in place,
    re-hash the touched tensors. Returns the undo log."""
    frames = {i: frame_slice(index, i, body) for i in range(len(index.frames))}
    undo = clock.time("apply", lambda: apply_patch(held, index, frames))
    clock.time("digest", lambda: digests(held, list(undo.touched), threads))
    return undo


class Totals:
    """Per-version sums: key -> round -> seconds (each batch's figure times its weight)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.values: dict[tuple[str, ...], list[float]] = defaultdict(lambda: [0.0] * rounds)

    def add(self, key: tuple[str, ...], r: int, seconds: float, weight: int) -> None:
        self.values[key][r] += weight * seconds

    def add_clock(self, prefix: tuple[str, ...], r: int, clock: Clock, weight: int) -> None:
        for part, s in clock.cpu.items():
            self.add((*prefix, part, "cpu"), r, s, weight)
            self.add((*prefix, part, "wall"), r, clock.wall[part], weight)

    def summed(self, prefix: tuple[str, ...], measure: str) -> list[float]:
        """Per round, the sum over every part under `prefix` of one measure ("cpu", "wall")."""
        out = [0.0] * self.rounds
        for key, values in self.values.items():
            if key[: len(prefix)] == prefix and key[-1] == measure:
                out = [a + b for a, b in zip(out, values, strict=True)]
        return out


def same_delta(a: Delta, b: Delta) -> bool:
    """Two deltas with the same names, index bytes and value bytes."""
    return a.keys() == b.keys() and all(
        a[n][0].dtype == b[n][0].dtype and a[n][0].tobytes() == b[n][0].tobytes()
        and a[n][1].dtype == b[n][1].dtype and a[n][1].tobytes() == b[n][1].tobytes()
        for n in b
    )


def device_step(
    previous: PreviousState, state: Mapping[str, Any], held: Mapping[str, dict[str, np.ndarray]],
    digests_of: Mapping[str, StateDigest], threads: int, device: str,
) -> dict[str, tuple[Delta, StateDigest, Clock]]:
    """The torch path's per-version work on one batch, per plane, as the slime publisher runs it by
    delta (`ChainPublisher.publish_delta`, no host copy of the state): the device diff and its
    old bits (bf16, `PreviousState.sparse_step`) or the plane's step (`PreviousState.plane_step`),
    then the digest over each changed tensor read from the device (`sparse_digest`), encode from
    the old bits, and sha256. Returns each plane's delta, new digest and the clock that timed it."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, tuple[Delta, StateDigest, Clock]] = {}
    for p in PLANES:
        clock = Clock()
        if p == "bf16":
            step = clock.time("diff", lambda: previous.sparse_step(previous.diff(state)))
        else:
            step = clock.time("quantize", partial(previous.plane_step, p, MODEL_TYPE, device))
        if device != "cpu":
            torch.cuda.synchronize()
        digest = clock.time("digest", partial(sparse_digest, digests_of[p], step, threads=threads))
        _, body = clock.time(
            "encode", partial(encode_delta, step.delta, shapes_of(held[p]), old=step.old, mode="rel", threads=threads)
        )
        clock.time("sha256", partial(content_hash, body))
        out[p] = (step.delta, digest, clock)
    return out


def measure_unit(
    unit: Unit, shapes: Mapping[str, tuple[int, ...]], args: argparse.Namespace, threads: list[int],
    totals: Totals, sizes: dict[str, float], check: dict[str, int],
) -> None:
    """Build one batch's states and time every contender on it for every round."""
    w = unit.weight
    prev = {n: previous_bits(n, shapes[n], args.seed) for n in unit.names}
    new = {n: next_bits(n, prev[n], args.density, args.seed) for n in unit.names}
    elements = sum(a.size for a in prev.values())
    sizes["elements"] += w * elements
    sizes["anchor_bf16"] += w * 2 * elements
    held: dict[str, dict[str, np.ndarray]] = {"bf16": prev}
    for q in QUANT:
        held[q] = plane_bits(prev, q, MODEL_TYPE)
        sizes[f"anchor_{q}"] += w * sum(a.nbytes for a in held[q].values())  # what a worker on it holds
    digests_of = {p: StateDigest.of(held[p]) for p in PLANES}  # the publisher's digest of the previous version
    sample = list(unit.names[::PLANE_CHECK_EVERY])
    previous, device_state = device_states(prev, new, args.device)
    sizes["to_host_numpy"] += w * 2 * elements  # the numpy path gathers every bf16 weight to the host
    for r in range(args.rounds):
        patches: dict[str, tuple[Any, bytes]] = {}
        targets: dict[str, dict[str, np.ndarray]] = {"bf16": new}
        for t in threads:
            clock = Clock()
            delta, index, body = publish_step(clock, held["bf16"], new, digests_of["bf16"], t)
            patches["bf16"] = (index, body)
            totals.add_clock(("trainer", str(t), "bf16"), r, clock, w)
            changed = {n: indices for n, (indices, _) in delta.items()}
            for q in QUANT:
                clock = Clock()
                targets[q] = clock.time(
                    "quantize", partial(updated_plane_bits, held[q], new, changed, q, MODEL_TYPE, threads=t)
                )
                _, index, body = publish_step(clock, held[q], targets[q], digests_of[q], t)
                patches[q] = (index, body)
                totals.add_clock(("trainer", str(t), q), r, clock, w)
                if r == 0 and t == threads[0]:
                    check["plane_tensors"] += len(sample)
                    check["plane_mismatched"] += plane_mismatches(new, targets[q], sample, q)
                    counts = group_counts(delta, {n: shapes[n] for n in unit.names}, q)
                    for key, count in zip(("groups", "touched", "quantized", "whole"), counts, strict=True):
                        sizes[f"{q}_{key}"] += w * count
        for t in threads:  # the torch path, in the same round
            handed = previous.transfer.device_to_host
            done = device_step(previous, device_state, held, digests_of, t, args.device)
            for p, (_, _, clock) in done.items():
                totals.add_clock(("device", str(t), p), r, clock, w)
            if r == 0 and t == threads[0]:
                sizes["to_host_torch"] += w * (previous.transfer.device_to_host - handed)
                check["device_deltas"] += len(PLANES)
                check["device_mismatched"] += sum(
                    not same_delta(done[p][0], delta := diff(held[p], targets[p]))
                    or done[p][1].root() != digests_of[p].update(targets[p], delta.keys()).root() for p in PLANES
                )
        for t in threads:
            for p in PLANES:
                clock = Clock()
                index, body = patches[p]
                undo = receive_step(clock, held[p], index, body, t)
                totals.add_clock(("worker", str(t), p), r, clock, w)
                if r == 0 and t == threads[0]:
                    check["tensors"] += len(held[p])
                    check["mismatched"] += sum(not np.array_equal(held[p][n], targets[p][n]) for n in held[p])
                undo.rollback(held[p])
        if r == 0:
            sizes["changed"] += w * sum(int(np.count_nonzero(prev[n] != new[n])) for n in unit.names)
            for p in PLANES:
                sizes[f"patch_{p}"] += w * len(patches[p][1])
        del patches, targets


def device_states(
    prev: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], device: str
) -> tuple[PreviousState, dict[str, Any]]:
    """The previous version kept by a `PreviousState` (all of it on the device: the budget is the
    batch's bytes) and the new version as bf16 torch tensors on `device`."""
    import torch

    from slime_stoa.trainer.device_delta import DeviceDeltaConfig

    def tensors(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {n: torch.from_numpy(a.view(np.int16)).to(device).view(torch.bfloat16) for n, a in state.items()}

    budget = sum(2 * a.size for a in prev.values())
    previous = PreviousState(DeviceDeltaConfig(device_budget_bytes=budget))
    previous.reset(tensors(prev))
    return previous, tensors(new)


# ---------------------------------------------------------------------------------------------
# Report


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def summarize(totals: Totals, sizes: Mapping[str, float], threads: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side in ("trainer", "worker"):
        for measure in ("cpu", "wall"):
            per: dict[str, Any] = {}
            for t in threads:
                row: dict[str, Any] = {p: spread(totals.summed((side, str(t), p), measure)) for p in PLANES}
                parts = sorted({k[3] for k in totals.values if k[:2] == (side, str(t))})
                row["parts"] = {
                    p: {part: spread(totals.summed((side, str(t), p, part), measure))["median"] for part in parts
                        if (side, str(t), p, part, measure) in totals.values}
                    for p in PLANES
                }
                per[str(t)] = row
            out[f"{side}_{measure}_s_per_version"] = per
    elements = sizes["elements"]
    out["bytes_per_version"] = {
        "bf16_step_patch": sizes["patch_bf16"], "int8_plane_patch": sizes["patch_int8"],
        "int4_plane_patch": sizes["patch_int4"], "anchor_bf16": sizes["anchor_bf16"],
        "anchor_int8": sizes["anchor_int8"], "anchor_int4": sizes["anchor_int4"],
    }
    out["served_bytes"] = {"bf16": sizes["anchor_bf16"], "int8": sizes["anchor_int8"], "int4": sizes["anchor_int4"]}
    out["served_bytes_per_weight"] = {p: b / elements for p, b in out["served_bytes"].items()}
    out["changed_fraction"] = sizes["changed"] / elements
    out["plane_update"] = {  # what `updated_plane_bits` re-quantized, per plane, over its quantized tensors
        q: {"groups_touched_fraction": sizes[f"{q}_touched"] / sizes[f"{q}_groups"],
            "whole_tensor_fraction": sizes[f"{q}_whole"] / sizes[f"{q}_quantized"],
            "whole_tensor_share": WHOLE_TENSOR_SHARE}
        for q in QUANT
    }
    out["device_path"] = {
        "baseline": "numpy (the trainer_* figures)",
        "trainer_wall_s_per_version": {
            str(t): {p: spread(totals.summed(("device", str(t), p), "wall")) for p in PLANES} for t in threads
        },
        "trainer_cpu_s_per_version": {
            str(t): {p: spread(totals.summed(("device", str(t), p), "cpu")) for p in PLANES} for t in threads
        },
        "parts_wall_median": {
            str(t): {p: {k[3]: spread(v)["median"] for k, v in totals.values.items()
                         if k[:3] == ("device", str(t), p) and k[-1] == "wall"} for p in PLANES}
            for t in threads
        },
        "bytes_to_host_per_version": {"numpy": sizes["to_host_numpy"], "torch": sizes["to_host_torch"]},
    }
    out["cpu_ns_per_element"] = {  # medians per version over the model's elements, per thread count
        side: {t: {p: 1e9 * row[p]["median"] / elements for p in PLANES} for t, row in out[f"{side}_cpu_s_per_version"].items()}
        for side in ("trainer", "worker")
    }
    return out


def print_report(doc: dict[str, Any]) -> None:
    gb = 1e9
    print(f"{doc['date']}  LFM2-MoE shape {doc['shape']!r}: {doc['elements'] / 1e9:.3f} B elements, "
          f"{doc['changed_fraction'] * 100:.2f}% changed per version")
    print(f"  {doc['scaling']}")
    b = doc["bytes_per_version"]
    print("bytes per version (MB):        patch      anchor   patch/anchor")
    for p in PLANES:
        patch = b["bf16_step_patch"] if p == "bf16" else b[f"{p}_plane_patch"]
        anchor = b[f"anchor_{p}"]
        print(f"  {p:<6}                  {patch / 1e6:10.1f}  {anchor / 1e6:10.1f}   {patch / anchor:8.4f}")
    for side, label in (("trainer", "trainer CPU s per version"), ("worker", "worker apply s per version (wall)")):
        key = f"{side}_{'cpu' if side == 'trainer' else 'wall'}_s_per_version"
        print(f"{label}, median (min-max) over {doc['rounds']} round(s):")
        for t, row in doc[key].items():
            cells = "  ".join(f"{p} {row[p]['median']:7.2f} ({row[p]['min']:.2f}-{row[p]['max']:.2f})" for p in PLANES)
            print(f"  threads {t}:  {cells}")
    for t, row in doc["trainer_cpu_s_per_version"].items():
        parts = "; ".join(f"{p}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["parts"][p].items()) for p in PLANES)
        print(f"  trainer CPU parts, threads {t}: {parts}")
    dev = doc["device_path"]
    moved = dev["bytes_to_host_per_version"]
    print(f"torch path on {doc['device']} (numpy above is the baseline), wall s per version, median (min-max):")
    for t, row in dev["trainer_wall_s_per_version"].items():
        base = doc["trainer_wall_s_per_version"][t]
        cells = "  ".join(f"{p} {row[p]['median']:7.2f} ({row[p]['min']:.2f}-{row[p]['max']:.2f}; numpy "
                          f"{base[p]['median']:.2f})" for p in PLANES)
        print(f"  threads {t}:  {cells}")
    print(f"  device -> host per version: numpy {moved['numpy'] / 1e9:.3f} GB (the bf16 state), "
          f"torch {moved['torch'] / 1e9:.3f} GB (the patches, their old bits, each changed tensor and its plane arrays for the digests); deltas checked bit for bit: "
          f"{doc['device_check']['mismatched']} of {doc['device_check']['deltas']} differ")
    for q, u in doc["plane_update"].items():
        print(f"  {q} plane update: {u['groups_touched_fraction'] * 100:.1f}% of groups touched, "
              f"{u['whole_tensor_fraction'] * 100:.1f}% of quantized elements re-quantized as whole tensors")
    served = doc["served_bytes"]
    print("worker served weights: " + ", ".join(
        f"{p} {served[p] / gb:.2f} GB ({doc['served_bytes_per_weight'][p]:.3f} B/weight)" for p in PLANES)
        + f"; this bench's peak RSS {doc['peak_rss_bytes'] / gb:.2f} GB (streamed)")
    print(f"load average {doc['load_average_start']:.2f} at the start, {doc['load_average_end']:.2f} at the end "
          f"({doc['cpus']} CPUs); {doc['wall_s']:.0f} s; results checked bit for bit: {doc['verified']} "
          f"(plane updates against full plane_bits on {doc['plane_check']['tensors']} sampled tensors)")


def parse_threads(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads wants comma-separated counts, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--threads wants counts >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a sample of layers, scaled to the whole model")
    size.add_argument("--smoke", action="store_true", help="a tiny model of the same family (tests)")
    ap.add_argument("--shape", choices=SHAPES, default="published")
    ap.add_argument("--density", type=float, default=0.02, help="fraction of elements a version changes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=parse_threads, default=None, help="thread counts, e.g. 1,2 (default: 1 and all CPUs)")
    ap.add_argument("--batch-mib", type=float, default=256, help="bf16 MiB measured at a time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="the torch path's device: cpu, cuda, cuda:1, ...")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not 0 < args.density < 1:
        ap.error(f"--density must be in (0, 1), got {args.density}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if not args.batch_mib > 0:
        ap.error(f"--batch-mib must be positive, got {args.batch_mib}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    session = Session()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    config = dict(SMOKE) if args.smoke else config_of(args.shape)
    shapes = param_shapes(config)
    threads = args.threads or sorted({1, os.cpu_count() or 1})
    units, layers = plan_units(shapes, config, quick=args.quick, batch_bytes=int(args.batch_mib * 2**20))
    totals = Totals(args.rounds)
    sizes: dict[str, float] = defaultdict(float)
    check = {"tensors": 0, "mismatched": 0, "plane_tensors": 0, "plane_mismatched": 0, "device_deltas": 0,
             "device_mismatched": 0}
    for i, unit in enumerate(units):
        measure_unit(unit, shapes, args, threads, totals, sizes, check)
        print(f"  batch {i + 1}/{len(units)}: {len(unit.names)} tensors x{unit.weight}", flush=True)
    total = sum(math.prod(s) for s in shapes.values())
    measured = sum(math.prod(shapes[n]) for u in units for n in u.names)
    assert sizes["elements"] == total, (sizes["elements"], total)
    scaling = (f"measured {measured / 1e9:.3f} B of {total / 1e9:.3f} B elements (top-level tensors and layers "
               f"{layers}), each layer's figures scaled by the number of layers of its kind (by parameter count)"
               if args.quick else "every tensor streamed, nothing scaled")
    doc: dict[str, Any] = {
        "date": date, "shape": "smoke" if args.smoke else args.shape, "config": config, "quick": args.quick,
        "scaling": scaling, "elements": total, "elements_measured": measured, "tensors": len(shapes),
        "density": args.density, "rounds": args.rounds, "threads": threads, "seed": args.seed,
        "batch_mib": args.batch_mib, "mode": "rel", "device": args.device,
    }
    doc |= summarize(totals, sizes, threads)
    doc["plane_check"] = {"every": PLANE_CHECK_EVERY, "tensors": check["plane_tensors"],
                          "mismatched_arrays": check["plane_mismatched"]}
    doc["device_check"] = {"deltas": check["device_deltas"], "mismatched": check["device_mismatched"]}
    doc["verified"] = (check["mismatched"] == 0 and check["tensors"] > 0
                       and check["plane_mismatched"] == 0 and check["plane_tensors"] > 0
                       and check["device_mismatched"] == 0 and check["device_deltas"] > 0)
    doc["peak_rss_bytes"] = peak_rss_bytes()
    doc |= session.meta()
    return doc


def device_problem(device: str) -> str | None:
    """Why the torch path cannot run on `device` (None: it can)."""
    import torch

    try:
        where = torch.device(device)
    except RuntimeError as exc:
        return f"--device {device!r}: {exc}"
    if where.type == "cuda" and not torch.cuda.is_available():
        return f"--device {device!r}: this torch has no CUDA device; run with --device cpu"
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        return f"--device {device!r}: there are {torch.cuda.device_count()} CUDA devices"
    if where.type not in ("cpu", "cuda"):
        return f"--device {device!r}: only cpu and cuda are measured"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = device_problem(args.device)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    doc = run(args)
    print_report(doc)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0 if doc["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
