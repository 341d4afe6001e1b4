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
  sync_t1     the same with one compression thread (`PublisherConfig.threads=1`; only on a
              machine with more than one CPU).
  background  `SyncPublisher.submit(state, copy=False)` (the hook's call): blocked = the hand-off,
              plus any wait for the previous version. The bench then waits for the commit and
              reports how long the background publish took (`background_s_*`): a train step
              longer than that never waits. `snapshot_copy_s` is what `copy=True` would add.

Versions: v0 (the first anchor), then `--cycles` times `--patches` step-patch versions (each with
its catch-up patch) and an anchored version. Figures per kind (patch, anchor) are min / median /
max over its versions; ratios are blocked / synchronous of the medians, in one run (target
<= 0.10). `cpu_s_per_gb`: process CPU seconds of a synchronous publish per GB of bf16 state
(median), per compression thread count (diff, digest and merge use one thread whatever it is).

Usage: python scripts/bench_publish.py [--quick | --smoke] [--layers 28] [--vocab N] [--patches 2] [--cycles 1]
       [--density 0.01] [--s3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Session, exit_on_signals, on_signal_exit, print_spreads, ratio, spread

from slime_stoa.protocol.pulse.publisher import PublisherConfig
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
    """Contender -> compression threads (None: the publisher's default, one per CPU)."""
    out: dict[str, int | None] = {"sync": None}
    if (os.cpu_count() or 1) > 1:
        out["sync_t1"] = 1
    out["background"] = None
    return out


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
        assert pub.last is not None
        result = pub.last
        row |= {"blocked_s": blocked, "wait_s": handoff.wait_s, "background_s": time.perf_counter() - start}
    del gathered
    assert result.version == version and result.anchored == (kind != "patch"), result
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
    for path, threads in contenders().items():
        if path == "background":
            continue
        label = str(threads if threads is not None else os.cpu_count() or 1)
        cpu[label] = {kind: spread(values(path, kind, "cpu_s"))["median"] / state_gb for kind in ("patch", "anchor")}
    out["cpu_s_per_gb"] = cpu
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
        print(f"sync publish CPU, {threads} compression thread(s): {per['patch']:.2f} s/GB (patch), "
              f"{per['anchor']:.2f} s/GB (anchor)")
    print(f"(every contender also gathers the state first: {summary['gather_s']:.2f} s; a hand-off with copy=True "
          f"would add {summary['snapshot_copy_s']:.2f} s; target ratio <= 0.10)")


def main(argv: list[str] | None = None) -> int:
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
    if args.layers < 1 or args.patches < 1 or args.cycles < 1 or args.vocab < 1 or not 0 < args.density < 1:
        parser.error("--layers, --vocab, --patches and --cycles must be >= 1 and --density in (0, 1)")
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
        finally:
            if server is not None:
                server.stop()
            shutil.rmtree(root, ignore_errors=True)
    print_table(summary)
    session.print_load()
    if args.json:
        args.json.write_text(json.dumps(session.meta() | summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
