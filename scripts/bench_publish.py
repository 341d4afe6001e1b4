"""Benchmark the trainer-side publish: how long the training loop is blocked per published version,
with the background publisher (the slime hook's default) against the synchronous path.

Workload: a bf16 state shaped like Qwen2.5-1.5B (28 layers, hidden 1536, MLP 8960, 12 query and 2
key/value heads, vocabulary 151,936, tied embeddings: 1.54 B elements, 3.1 GB), random bits, on
CPU. `--layers` scales the depth down for small machines and `--vocab` the vocabulary (`--quick`:
1 layer, vocabulary 5,427 (1/28 of it), 55 M elements, 110 MB, two anchor intervals; `--smoke`: the same with hidden
256 and MLP 1,024, the test's size). Each train step changes `--density`
of the elements (1% by default) by a few low mantissa bits, as optimizer steps do. The store is
a local folder (`file://`, fsync on) or, with `--s3`, the loopback S3 server (SeaweedFS, parts
uploaded in parallel).

Contenders, each publishing the same trajectory to its own run in the same store, interleaved:
per version, the "trainer" applies a step to its live weights, then each contender in turn
gathers them (a copy, as slime's HF weight iterator makes on rank 0: the same for all,
reported apart as `gather_s`) and publishes them:

  sync        `SyncPublisher.publish(state)`: diff, encode, upload, commit; blocked = all of it.
  sync_t1     the same on one thread (`PublisherConfig.threads=1`; only on a machine with more
              than one CPU).
  background  `SyncPublisher.submit(state, copy=False)` (the hook's call): blocked = the hand-off,
              plus any wait for the previous version. The bench then waits for the commit and
              reports how long the background publish took (`background_s_*`): a train step
              longer than that never waits. `snapshot_copy_s` is what `copy=True` would add.

Versions: v0 (the first anchor), then `--cycles` times `--patches` step-patch versions (each with
its catch-up patch) and an anchored version. Figures per kind (patch, anchor) are min / median /
max over its versions; ratios are blocked / synchronous of the medians, in one run (target
<= 0.10). `cpu_s_per_gb`: process CPU seconds of a synchronous publish per GB of bf16 state
(median), per thread count (`PublisherConfig.threads`: diff, digest, merge and encode), and
`wall_s_per_gb` the same for the wall time.

Receive side, per thread count (`SubscriberConfig.threads`: 1 and the default), after the
publishes: one subscriber per thread count follows the `sync` run version by version
(`Subscriber.sync_to`, in turn per version, so load drift touches each alike): fetch, decode,
apply and re-hash of each step patch. `receive`: per thread count, the median wall seconds and
process CPU seconds of a step sync, `wall_s_per_gb` and `cpu_s_per_gb` of bf16 state (every
tensor is touched, so all of it is re-hashed) and `ns_per_change` (wall per changed element).

Per-element rates of each stage, per thread count (`stage_ns`, in memory, one train step of the
same state, contenders interleaved over `--repeat` rounds, medians): the publisher's `diff` and
`digest` (ns per element of the state), `merge` (two steps' deltas into a catch-up) and `encode`
(a base-relative step patch), ns per change; the receiver's `apply` (decode and write in place)
and `stage` (decode, merge and re-hash without writing), ns per change.

The plane quantizer (`quantize_ns_per_element`, per mode, plane (int8, int4), contender and thread
count 1 and 2: min / median / max ns per quantized element, contenders interleaved over `--repeat`
rounds; `quantize_speedup`: baseline / current of the medians): "whole" quantizes every quantized
tensor of the state (a plane's first version, or one after a gap), "touched" only the groups a
train step changed, into copies of the previous plane's arrays (a plane's next version).
Contenders: "current" (`quant.quantize`, `quant.quantize_groups_into`) and "baseline"
(`baseline_quantize`, the quantizer before its rewrite, kept here for the comparison); both give
the same bits (checked first).

Usage: python scripts/bench_publish.py [--quick | --smoke] [--layers 28] [--vocab N] [--patches 2] [--cycles 1]
       [--density 0.01] [--s3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (
    Incomplete,
    Session,
    exit_code,
    exit_on_signals,
    on_signal_exit,
    print_spreads,
    ratio,
    require,
    rounds,
    spread,
    write_json,
)

from slime_stoa.protocol.pulse.apply import apply_patch
from slime_stoa.protocol.pulse.codec import bf16_bits_to_float32, diff, float32_to_bf16_bits, merge_deltas, shapes_of
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.frames import encode_delta
from slime_stoa.protocol.pulse.history import find_manifest
from slime_stoa.protocol.pulse.parallel import ordered_map, thread_count
from slime_stoa.protocol.pulse.plane import PLANE_PARAMS
from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.pulse.quant import plane_layout, quantize, quantize_groups_into
from slime_stoa.protocol.pulse.staged import stage_patches
from slime_stoa.protocol.pulse.subscriber import Subscriber, SubscriberConfig
from slime_stoa.protocol.store import open_store
from slime_stoa.trainer.slime.publish import SyncPublisher

VOCAB, HIDDEN, MLP, HEADS, KV_HEADS, LAYERS = 151_936, 1536, 8960, 12, 2, 28


def qwen_shapes(layers: int, vocab: int = VOCAB, hidden: int = HIDDEN, mlp: int = MLP) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-1.5B's HF tensor shapes (tied embeddings), with `layers` decoder layers."""
    head = hidden // HEADS
    kv = KV_HEADS * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def initial_state(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # bf16 bits of weights of magnitude ~0.01-1: sign, exponents 0x78-0x7F, any mantissa.
    state = {}
    for name, shape in shapes.items():
        bits = rng.integers(0x3C00, 0x3F80, size=shape, dtype=np.uint16)
        bits |= (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)
        state[name] = bits
    return state


def train_step(state: dict[str, np.ndarray], density: float, seed: int) -> None:
    """Change `density` of the elements in place by a few low mantissa bits (as an optimizer step)."""
    rng = np.random.default_rng(seed)
    for bits in state.values():
        flat = bits.reshape(-1)
        k = max(1, int(flat.size * density))
        where = rng.integers(0, flat.size, size=k)
        flat[where] ^= rng.integers(1, 8, size=k, dtype=np.uint16)


def contenders() -> dict[str, int | None]:
    """Contender -> publisher threads (None: the publisher's default, `parallel.thread_count`)."""
    out: dict[str, int | None] = {"sync": None}
    if thread_count(None) > 1:
        out["sync_t1"] = 1
    out["background"] = None
    return out


def receive_threads() -> tuple[int, ...]:
    """The subscriber thread counts timed: 1 and the default (when it is more)."""
    return tuple(sorted({1, thread_count(None)}))


async def receive_rounds(url: str, versions: int, every: int) -> list[dict[str, Any]]:
    """Per version, each thread count's subscriber syncs the `sync` run to it in turn; one row each."""
    rows = []
    async with open_store(url) as store:
        subs = {t: Subscriber(store, "sync", SubscriberConfig(threads=t)) for t in receive_threads()}
        for version in range(versions):
            manifest = await find_manifest(store, "sync", version)
            step = manifest.patch("step")
            for threads, sub in subs.items():
                cpu, start = time.process_time(), time.perf_counter()
                result = await sub.sync_to(manifest)
                rows.append({"threads": threads, "version": version, "kind": kind_of(version, every), "path": result.path,
                             "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu,
                             "changes": step.count if step is not None else 0, "bytes": result.bytes})
                print(f"  receive v{version:<3} {threads} thread(s) {result.path:<8} {rows[-1]['wall_s']:8.3f} s", flush=True)
    return rows


def summarize_receive(rows: list[dict[str, Any]], state_gb: float) -> dict[str, dict[str, float]]:
    """Per thread count: medians over the versions reached by their step patch."""
    out = {}
    for threads in sorted({r["threads"] for r in rows}):
        steps = [r for r in rows if r["threads"] == threads and r["path"] == "step"]
        require(bool(steps), f"the {threads}-thread subscriber reached no version by its step patch")
        wall = spread([r["wall_s"] for r in steps])["median"]
        cpu = spread([r["cpu_s"] for r in steps])["median"]
        changes = spread([r["changes"] for r in steps])["median"]
        out[str(threads)] = {"wall_s": wall, "cpu_s": cpu, "wall_s_per_gb": wall / state_gb, "cpu_s_per_gb": cpu / state_gb,
                             "ns_per_change": 1e9 * ratio(wall, changes), "syncs": len(steps)}
    return out


def stage_rates(shapes: dict[str, tuple[int, ...]], density: float, seed: int, repeat: int) -> dict[str, dict[str, float]]:
    """Median ns per element (diff, digest) or per change (the others) of each stage, per thread count."""
    base = initial_state(shapes, seed)
    mid = {n: b.copy() for n, b in base.items()}
    train_step(mid, density, seed + 1)
    new = {n: b.copy() for n, b in mid.items()}
    train_step(new, density, seed + 2)
    first, step = diff(base, mid), diff(mid, new)
    index, body = encode_delta(step, shapes_of(new), base=mid, mode="rel")
    frames = {i: body[f.offset : f.offset + f.length] for i, f in enumerate(index.frames)}
    digest = StateDigest.of(mid)
    expected = StateDigest.of(new).root()
    elements = sum(b.size for b in base.values())
    changes = sum(i.size for i, _ in step.values())
    target = {n: b.copy() for n, b in mid.items()}

    def applied(threads: int) -> None:
        apply_patch(target, index, frames, threads=threads).rollback(target)

    units = {"diff": elements, "digest": elements, "merge": changes + sum(i.size for i, _ in first.values()),
             "encode": changes, "apply": changes, "stage": changes}
    work = {
        "diff": lambda t: diff(mid, new, threads=t),
        "digest": lambda t: StateDigest.of(new, threads=t),
        "merge": lambda t: merge_deltas([first, step], threads=t),
        "encode": lambda t: encode_delta(step, shapes_of(new), base=mid, mode="rel", threads=t),
        "apply": applied,
        "stage": lambda t: stage_patches(mid, digest, [(index, frames)], expected, threads=t),
    }
    counts = receive_threads()
    def wall(fn: Any, threads: int) -> None:  # `rounds` times a call that returns None
        fn(threads)

    timed = rounds({f"{stage}/{t}": partial(wall, fn, t) for stage, fn in work.items() for t in counts}, repeat)
    return {
        stage: {str(t): 1e9 * spread(timed[f"{stage}/{t}"])["median"] / max(1, units[stage]) for t in counts}
        for stage in work
    }


QUANT_THREADS = (1, 2)


def baseline_quantize(w: np.ndarray, group_size: int, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plane quantizer before its rewrite (bf16 bits in; codes, scales and biases as
    `quant.quantize`'s, unshaped), kept as the contender the current one is measured against."""
    per_word = 32 // bits
    words = group_size // per_word
    groups = w.reshape(-1, group_size)
    n = groups.shape[0]
    codes = np.empty((n, words), dtype=np.uint32)
    scales = np.empty(n, dtype=np.uint16)
    biases = np.empty(n, dtype=np.uint16)
    n_bins = np.float32((1 << bits) - 1)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    for start in range(0, n, 1 << 14):
        part = slice(start, min(start + (1 << 14), n))
        g = bf16_bits_to_float32(groups[part])
        if not np.isfinite(g).all():
            raise ValueError("non-finite value")
        with np.errstate(over="ignore"):
            w_max, w_min = g.max(axis=1), g.min(axis=1)
            scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
            low = np.abs(w_min) > np.abs(w_max)
            scale = np.where(low, scale, -scale)
            edge = np.where(low, w_min, w_max)
            q0 = np.rint(edge / scale)
            at_zero = q0 == 0
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(at_zero, scale, edge / q0)
            s, b = scale.astype(np.float32, copy=False), np.where(at_zero, np.float32(0), edge).astype(np.float32, copy=False)
        broken = ~np.isfinite(s) | (s == 0)
        if broken.any():
            raise ValueError("scale out of float32 range")
        q = np.rint((g - b[:, None]) / s[:, None])
        np.clip(q, 0, n_bins, out=q)
        packed = q.astype(np.uint32).reshape(-1, words, per_word) << shifts
        codes[part] = np.bitwise_or.reduce(packed, axis=2)
        scales[part] = float32_to_bf16_bits(s)
        biases[part] = float32_to_bf16_bits(b)
    return codes, scales, biases


def baseline_touched(
    w: np.ndarray, changed: np.ndarray, planes: tuple[np.ndarray, np.ndarray, np.ndarray], group_size: int, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The touched-group update before the rewrite (`plane.updated_plane_bits`' per-tensor step):
    the groups of the changed elements gathered, quantized by `baseline_quantize` and scattered
    into copies of the previous codes (uint32 rows), scales and biases."""
    groups = np.unique(changed // group_size)
    q_codes, q_scales, q_biases = baseline_quantize(np.ascontiguousarray(w.reshape(-1, group_size)[groups]), group_size, bits)
    codes, scales, biases = (a.copy() for a in planes)
    codes[groups], scales[groups], biases[groups] = q_codes, q_scales, q_biases
    return codes, scales, biases


def current_touched(
    w: np.ndarray, changed: np.ndarray, planes: tuple[np.ndarray, np.ndarray, np.ndarray], group_size: int, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same with the current quantizer, as `plane.updated_plane_bits` does it."""
    codes, scales, biases = (a.copy() for a in planes)
    touched = np.zeros(scales.size, dtype=bool)
    touched[changed // group_size] = True
    quantize_groups_into(w, np.flatnonzero(touched), codes, scales, biases, group_size, bits)
    return codes, scales, biases


Spreads = dict[str, dict[str, float]]


def quantize_rates(shapes: dict[str, tuple[int, ...]], density: float, seed: int, repeat: int) -> dict[str, dict[str, dict[str, Spreads]]]:
    """ns per quantized element of the int8 and int4 planes' quantizer, the current one against
    `baseline_quantize`, per thread count (`QUANT_THREADS`, tensors in parallel as
    `quant.quantized_state` runs them), contenders interleaved over `repeat` rounds:
    "whole": every group of every quantized tensor (`plane.plane_bits`); "touched": only the
    groups holding the elements a train step of `density` changed (a plane's next version,
    including the copies of the previous arrays), per element of the state's quantized tensors.
    Returns {mode: {plane: {contender: {threads: min / median / max}}}}."""
    base = initial_state(shapes, seed)
    new = {n: b.copy() for n, b in base.items()}
    train_step(new, density, seed + 1)
    out: dict[str, dict[str, dict[str, Spreads]]] = {"whole": {}, "touched": {}}
    for plane, (group_size, bits) in PLANE_PARAMS.items():
        names = list(plane_layout(shapes, group_size, bits))
        for mode, got in plane_quantize_rates(base, new, names, group_size, bits, repeat).items():
            out[mode][plane] = got
    return out


def plane_quantize_rates(
    base: dict[str, np.ndarray], new: dict[str, np.ndarray], names: list[str], group_size: int, bits: int, repeat: int
) -> dict[str, dict[str, Spreads]]:
    """`quantize_rates` of one plane: {mode: {contender: {threads: spread}}}, after checking that
    both contenders give the same bits."""
    elements = sum(new[n].size for n in names)
    previous = {}
    for n in names:
        q = quantize(base[n], group_size, bits)
        previous[n] = (q.codes.reshape(-1, group_size * bits // 32), q.scales.reshape(-1), q.biases.reshape(-1))
    changed = {n: np.flatnonzero(new[n].reshape(-1) != base[n].reshape(-1)) for n in names}
    work = {
        "whole": {"current": lambda n: quantize(new[n], group_size, bits),
                  "baseline": lambda n: baseline_quantize(new[n], group_size, bits)},
        "touched": {"current": lambda n: current_touched(new[n], changed[n], previous[n], group_size, bits),
                    "baseline": lambda n: baseline_touched(new[n], changed[n], previous[n], group_size, bits)},
    }
    for n in names:
        ours, theirs = work["whole"]["current"](n), work["whole"]["baseline"](n)
        for a, b in zip((ours.codes, ours.scales, ours.biases), theirs, strict=True):
            require(np.array_equal(a.reshape(-1), b.reshape(-1)), f"{n}: the quantizers disagree")
        for a, b in zip(work["touched"]["current"](n), work["touched"]["baseline"](n), strict=True):
            require(np.array_equal(a, b), f"{n}: the touched-group updates disagree")

    def run(fn: Any, threads: int) -> None:  # `rounds` times a call that returns None
        ordered_map(fn, names, threads)

    out: dict[str, dict[str, Spreads]] = {}
    for mode, contenders_ in work.items():
        timed = rounds({f"{c}/{t}": partial(run, fn, t) for c, fn in contenders_.items() for t in QUANT_THREADS}, repeat)
        out[mode] = {c: {str(t): per_element(spread(timed[f"{c}/{t}"]), elements) for t in QUANT_THREADS} for c in contenders_}
    return out


def per_element(s: dict[str, float], elements: int) -> dict[str, float]:
    """A spread of seconds as ns per element (the count kept)."""
    return {k: v if k == "n" else 1e9 * v / max(1, elements) for k, v in s.items()}


def kind_of(version: int, every: int) -> str:
    return "first" if version == 0 else "anchor" if version % every == 0 else "patch"


def publish_one(path: str, pub: SyncPublisher, live: dict[str, np.ndarray], version: int, every: int) -> dict[str, Any]:
    """Gather `live` and publish it on `pub`'s run; one row."""
    start = time.perf_counter()
    gathered = {n: b.copy() for n, b in live.items()}
    gather_s = time.perf_counter() - start
    kind = kind_of(version, every)
    row: dict[str, Any] = {"path": path, "version": version, "kind": kind, "gather_s": gather_s}
    if path != "background":
        cpu = time.process_time()
        start = time.perf_counter()
        result = pub.publish(gathered)
        row |= {"blocked_s": time.perf_counter() - start, "publish_s": result.seconds,
                "cpu_s": time.process_time() - cpu}
    else:
        if version == 1:
            start = time.perf_counter()
            copied = {n: b.copy() for n, b in gathered.items()}
            row["snapshot_copy_s"] = time.perf_counter() - start
            del copied
        start = time.perf_counter()
        handoff = pub.submit(gathered, copy=False)
        blocked = time.perf_counter() - start
        pub.wait()
        if pub.last is None:
            raise Incomplete(f"the background publish of v{version} left no result")
        result = pub.last
        row |= {"blocked_s": blocked, "wait_s": handoff.wait_s, "background_s": time.perf_counter() - start}
    del gathered
    require(result.version == version and result.anchored == (kind != "patch"),
            f"{path}: v{version} ({kind}) was published as v{result.version}, anchored {result.anchored}")
    row |= {"patch_mib": result.patch_bytes / 2**20, "anchor_mib": result.anchor_bytes / 2**20,
            "density": result.density}
    return row


def run_rounds(url: str, args: argparse.Namespace, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """One round per version: a train step, then every contender publishes it in turn."""
    every = args.patches + 1
    live = initial_state(shapes, args.seed)
    pubs: dict[str, SyncPublisher] = {}
    rows = []
    try:
        for path, threads in contenders().items():
            config = PublisherConfig(anchor_every=every, anchor_fraction=1e9, retain_anchors=0, threads=threads)
            pubs[path] = SyncPublisher(url, path, config, create=True)
        for version in range(args.cycles * every + 1):
            if version:
                train_step(live, args.density, args.seed + version)
            for path, pub in pubs.items():
                row = publish_one(path, pub, live, version, every)
                rows.append(row)
                print(f"  v{version:<3} {row['kind']:<6} {path:<10} blocked {row['blocked_s']:8.3f} s", flush=True)
    finally:
        for pub in pubs.values():
            pub.close()
    return rows


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, shapes: dict[str, tuple[int, ...]], store: str) -> dict[str, Any]:
    def values(path: str, kind: str, field: str) -> list[float]:
        return [r[field] for r in rows if r["path"] == path and r["kind"] == kind]

    elements = sum(int(np.prod(s)) for s in shapes.values())
    state_gb = 2 * elements / 1e9
    spreads: dict[str, Any] = {}
    for kind in ("patch", "anchor"):
        spreads[f"sync_s_{kind}"] = spread(values("sync", kind, "blocked_s"))
        spreads[f"blocked_s_{kind}"] = spread(values("background", kind, "blocked_s"))
        spreads[f"background_s_{kind}"] = spread(values("background", kind, "background_s"))
        if "sync_t1" in contenders():
            spreads[f"sync_t1_s_{kind}"] = spread(values("sync_t1", kind, "blocked_s"))
    out: dict[str, Any] = {key: s["median"] for key, s in spreads.items()}
    out["spreads"] = spreads
    out["gather_s"] = spread([r["gather_s"] for r in rows])["median"]
    out["snapshot_copy_s"] = next(r["snapshot_copy_s"] for r in rows if "snapshot_copy_s" in r)
    out["ratio_patch"] = ratio(out["blocked_s_patch"], out["sync_s_patch"])
    out["ratio_anchor"] = ratio(out["blocked_s_anchor"], out["sync_s_anchor"])
    cpu: dict[str, dict[str, float]] = {}
    wall: dict[str, dict[str, float]] = {}
    for path, threads in contenders().items():
        if path == "background":
            continue
        label = str(thread_count(threads))
        cpu[label] = {kind: spread(values(path, kind, "cpu_s"))["median"] / state_gb for kind in ("patch", "anchor")}
        wall[label] = {kind: spread(values(path, kind, "blocked_s"))["median"] / state_gb for kind in ("patch", "anchor")}
    out["cpu_s_per_gb"] = cpu
    out["wall_s_per_gb"] = wall
    out |= {"layers": args.layers, "vocab": args.vocab, "hidden": args.hidden, "elements": elements,
            "state_gib": 2 * elements / 2**30, "density": args.density, "patch_versions": args.patches,
            "cycles": args.cycles, "store": store, "rows": rows}
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nPublish of a {summary['elements'] / 1e9:.3f} B-element bf16 state ({summary['state_gib']:.2f} GiB, "
          f"{summary['layers']} layers), {summary['density']:.1%} of it changed per step, store: {summary['store']}")
    print(f"{'version':<14}{'sync (s)':>12}{'background: blocked (s)':>26}{'ratio':>9}{'publish in bg (s)':>20}")
    for kind in ("patch", "anchor"):
        print(f"{kind:<14}{summary[f'sync_s_{kind}']:>12.3f}{summary[f'blocked_s_{kind}']:>26.4f}"
              f"{summary[f'ratio_{kind}']:>9.4f}{summary[f'background_s_{kind}']:>20.3f}")
    print("(medians; ratio = blocked / sync of the medians)")
    print_spreads("min / median / max per contender and kind", summary["spreads"])
    for threads, per in summary["cpu_s_per_gb"].items():
        wall = summary["wall_s_per_gb"][threads]
        print(f"sync publish, {threads} thread(s): CPU {per['patch']:.2f} s/GB (patch), {per['anchor']:.2f} s/GB (anchor); "
              f"wall {wall['patch']:.2f} s/GB (patch), {wall['anchor']:.2f} s/GB (anchor)")
    print("ns per element (diff, digest) or per change, per thread count:")
    for stage, per in summary["stage_ns"].items():
        print(f"  {stage:<8}" + "".join(f"{threads:>4} thread(s) {ns:9.2f}" for threads, ns in per.items()))
    print("plane quantizer, ns per quantized element (median; min-max), current vs baseline, per thread count:")
    for mode, planes in summary["quantize_ns_per_element"].items():
        for plane, per in planes.items():
            cells = "".join(
                f"  {t} thread(s): {per['current'][t]['median']:.2f} ({per['current'][t]['min']:.2f}-{per['current'][t]['max']:.2f})"
                f" vs {per['baseline'][t]['median']:.2f} ({per['baseline'][t]['min']:.2f}-{per['baseline'][t]['max']:.2f}),"
                f" {summary['quantize_speedup'][mode][plane][t]:.2f}x"
                for t in per["current"]
            )
            print(f"  {mode:<8}{plane:<6}{cells}")
    for threads, got in summary.get("receive", {}).items():
        print(f"receive a step, {threads} thread(s): {got['wall_s']:.3f} s wall, {got['cpu_s']:.3f} s CPU "
              f"({got['wall_s_per_gb']:.2f} s/GB wall, {got['cpu_s_per_gb']:.2f} s/GB CPU, "
              f"{got['ns_per_change']:.0f} ns per changed element; median of {got['syncs']})")
    print(f"(every contender also gathers the state first: {summary['gather_s']:.2f} s; a hand-off with copy=True "
          f"would add {summary['snapshot_copy_s']:.2f} s; target ratio <= 0.10)")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: bench(argv), "bench_publish")


def bench(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1 layer, vocabulary / 28, 3 patch versions (~110 MB)")
    size.add_argument("--smoke", action="store_true", help="--quick with hidden 256 and MLP 1024 (the test's size)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 28: the 1.5B shape)")
    parser.add_argument("--vocab", type=int, help=f"vocabulary (default {VOCAB})")
    parser.add_argument("--patches", type=int, help="step-patch versions per anchor interval (default 2, quick 3)")
    parser.add_argument("--cycles", type=int, help="anchor intervals published (default 1, quick 2)")
    parser.add_argument("--density", type=float, default=0.01, help="share of elements a train step changes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the per-stage rates")
    parser.add_argument("--s3", action="store_true", help="publish to the loopback S3 server instead of a folder")
    parser.add_argument("--dir", type=Path, help="folder for the local store (default: a temp folder)")
    parser.add_argument("--json", type=Path, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    small = args.quick or args.smoke
    args.layers = args.layers or (1 if small else LAYERS)
    args.vocab = args.vocab or (-(-VOCAB // LAYERS) if small else VOCAB)
    args.hidden, args.mlp = (256, 1024) if args.smoke else (HIDDEN, MLP)
    args.patches = args.patches or (3 if small else 2)
    args.cycles = args.cycles or (2 if small else 1)
    if args.layers < 1 or args.patches < 1 or args.cycles < 1 or args.vocab < 1 or args.repeat < 1 or not 0 < args.density < 1:
        parser.error("--layers, --vocab, --patches, --cycles and --repeat must be >= 1 and --density in (0, 1)")
    logging.basicConfig(level=logging.WARNING)
    shapes = qwen_shapes(args.layers, args.vocab, args.hidden, args.mlp)
    session = Session()
    root = Path(tempfile.mkdtemp(prefix="stoa-bench-publish-", dir=args.dir))
    server = None
    with exit_on_signals():
        on_signal_exit(lambda: shutil.rmtree(root, ignore_errors=True))
        try:
            if args.s3:
                from tests.s3server import LocalS3Server

                server = LocalS3Server().start()
                on_signal_exit(server.stop)
                bucket = server.create_bucket()
                creds = server.credentials()
                os.environ |= {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
                url, store = f"s3://{bucket}/bench?endpoint={server.endpoint_url}", "loopback S3 (SeaweedFS)"
            else:
                url, store = f"file://{root / 'bucket'}", "local folder (fsync)"
            rows = run_rounds(url, args, shapes)
            summary = summarize(rows, args, shapes, store)
            received = asyncio.run(receive_rounds(url, args.cycles * (args.patches + 1) + 1, args.patches + 1))
            summary["receive"] = summarize_receive(received, 2 * summary["elements"] / 1e9)
            summary["receive_rows"] = received
            summary["stage_ns"] = stage_rates(shapes, args.density, args.seed, args.repeat)
            summary["quantize_ns_per_element"] = quantize_rates(shapes, args.density, args.seed, args.repeat)
            summary["quantize_speedup"] = {
                mode: {plane: {t: ratio(per["baseline"][t]["median"], per["current"][t]["median"]) for t in per["current"]}
                       for plane, per in planes.items()}
                for mode, planes in summary["quantize_ns_per_element"].items()
            }
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(root, ignore_errors=True)
    print_table(summary)
    session.print_load()
    if args.json:
        write_json(args.json, session.meta() | summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
