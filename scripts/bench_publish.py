"""Benchmark the trainer-side publish: how long the training loop is blocked per published version,
with the background publisher (the slime hook's default) against the synchronous path.

Workload: a bf16 state shaped like Qwen2.5-1.5B (28 layers, hidden 1536, MLP 8960, 12 query and 2
key/value heads, vocabulary 151,936, tied embeddings: 1.54 B elements, 3.1 GB), random bits, on
CPU. `--layers` scales the depth down for small machines. Each train step changes `--density`
of the elements (1% by default) by a few low mantissa bits, as optimizer steps do. The store is
a local folder (`file://`, fsync on) or, with `--s3`, the loopback S3 server (SeaweedFS, parts
uploaded in parallel).

Both paths publish the same trajectory to their own run in the same store, one after the other:
v0 (the first anchor), `--patches` step-patch versions (each with its catch-up patch), then an
anchored version. Per version the "trainer" applies a step to its live weights and gathers them
(a copy, as slime's HF weight iterator makes on rank 0: the same in both paths, reported apart
as `gather_s`), then:

  sync        `SyncPublisher.publish(state)`: diff, encode, upload, commit; blocked = all of it.
  background  `SyncPublisher.submit(state, copy=False)` (the hook's call): blocked = the hand-off,
              plus any wait for the previous version. The bench then waits for the commit and
              reports how long the background publish took (`background_s_*`): a train step
              longer than that never waits. `snapshot_copy_s` is what `copy=True` would add.

Ratios are blocked / synchronous, in one run. Target: <= 0.10.

Usage: python scripts/bench_publish.py [--layers 28] [--patches 2] [--density 0.01] [--s3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.trainer.slime.publish import SyncPublisher

VOCAB, HIDDEN, MLP, HEADS, KV_HEADS = 151_936, 1536, 8960, 12, 2


def qwen_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Qwen2.5-1.5B's HF tensor shapes (tied embeddings), with `layers` decoder layers."""
    head = HIDDEN // HEADS
    kv = KV_HEADS * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (kv, HIDDEN), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (MLP, HIDDEN), p + "mlp.up_proj.weight": (MLP, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, MLP),
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
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


def run_path(path: str, url: str, args: argparse.Namespace, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Publish v0, the step-patch versions and one anchored version; one row per version."""
    anchor_at = args.patches + 1
    config = PublisherConfig(anchor_every=anchor_at, anchor_fraction=1e9, retain_anchors=0)
    live = initial_state(shapes, args.seed)
    rows = []
    with SyncPublisher(url, path, config, create=True) as pub:
        for version in range(anchor_at + 1):
            if version:
                train_step(live, args.density, args.seed + version)
            start = time.perf_counter()
            gathered = {n: b.copy() for n, b in live.items()}
            gather_s = time.perf_counter() - start
            kind = "first" if version == 0 else "anchor" if version == anchor_at else "patch"
            row: dict[str, Any] = {"path": path, "version": version, "kind": kind, "gather_s": gather_s}
            if path == "sync":
                start = time.perf_counter()
                result = pub.publish(gathered)
                row |= {"blocked_s": time.perf_counter() - start, "publish_s": result.seconds}
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
            rows.append(row)
            print(f"  {path:<10} v{version} {kind:<6} blocked {row['blocked_s']:8.3f} s", flush=True)
    return rows


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, shapes: dict[str, tuple[int, ...]], store: str) -> dict[str, Any]:
    def mean(path: str, kind: str, field: str) -> float:
        return statistics.fmean(r[field] for r in rows if r["path"] == path and r["kind"] == kind)

    out: dict[str, Any] = {
        "blocked_s_patch": mean("background", "patch", "blocked_s"),
        "blocked_s_anchor": mean("background", "anchor", "blocked_s"),
        "sync_s_patch": mean("sync", "patch", "blocked_s"),
        "sync_s_anchor": mean("sync", "anchor", "blocked_s"),
        "background_s_patch": mean("background", "patch", "background_s"),
        "background_s_anchor": mean("background", "anchor", "background_s"),
        "gather_s": statistics.fmean(r["gather_s"] for r in rows),
        "snapshot_copy_s": next(r["snapshot_copy_s"] for r in rows if "snapshot_copy_s" in r),
    }
    out["ratio_patch"] = out["blocked_s_patch"] / out["sync_s_patch"]
    out["ratio_anchor"] = out["blocked_s_anchor"] / out["sync_s_anchor"]
    elements = sum(int(np.prod(s)) for s in shapes.values())
    out |= {"layers": args.layers, "elements": elements, "state_gib": 2 * elements / 2**30, "density": args.density,
            "patch_versions": args.patches, "store": store, "rows": rows}
    return out


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nPublish of a {summary['elements'] / 1e9:.2f} B-element bf16 state ({summary['state_gib']:.2f} GiB, "
          f"{summary['layers']} layers), {summary['density']:.1%} of it changed per step, store: {summary['store']}")
    print(f"{'version':<14}{'sync (s)':>12}{'background: blocked (s)':>26}{'ratio':>9}{'publish in bg (s)':>20}")
    for kind in ("patch", "anchor"):
        print(f"{kind:<14}{summary[f'sync_s_{kind}']:>12.3f}{summary[f'blocked_s_{kind}']:>26.4f}"
              f"{summary[f'ratio_{kind}']:>9.4f}{summary[f'background_s_{kind}']:>20.3f}")
    print(f"(both paths also gather the state first: {summary['gather_s']:.2f} s; a hand-off with copy=True "
          f"would add {summary['snapshot_copy_s']:.2f} s; target ratio <= 0.10)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (28: the 1.5B shape)")
    parser.add_argument("--patches", type=int, default=2, help="step-patch versions per path")
    parser.add_argument("--density", type=float, default=0.01, help="share of elements a train step changes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3", action="store_true", help="publish to the loopback S3 server instead of a folder")
    parser.add_argument("--dir", type=Path, help="folder for the local store (default: a temp folder)")
    parser.add_argument("--json", type=Path, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.patches < 1 or not 0 < args.density < 1:
        parser.error("--layers and --patches must be >= 1 and --density in (0, 1)")
    logging.basicConfig(level=logging.WARNING)
    shapes = qwen_shapes(args.layers)
    root = Path(tempfile.mkdtemp(prefix="stoa-bench-publish-", dir=args.dir))
    server = None
    try:
        if args.s3:
            import os

            from tests.s3server import LocalS3Server

            server = LocalS3Server().start()
            bucket = server.create_bucket()
            creds = server.credentials()
            os.environ |= {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}
            url, store = f"s3://{bucket}/bench?endpoint={server.endpoint_url}", "loopback S3 (SeaweedFS)"
        else:
            url, store = f"file://{root / 'bucket'}", "local folder (fsync)"
        rows = []
        for path in ("sync", "background"):
            rows += run_path(path, url, args, shapes)
        summary = summarize(rows, args, shapes, store)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
