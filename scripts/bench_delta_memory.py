"""Host memory of the trainer's weight path: publishing full host states (`Publisher.publish`) vs
publishing by delta from the weights' device (`Publisher.publish_delta` fed by
`device_delta.PreviousState.sparse_step`), at LFM2.5-8B-A1B's real tensor shapes, a few layers.

Each run is a child process (a fresh heap: one path's memory never counts against the other's),
and the two paths alternate in rounds (full, delta, full, delta, ...). A child builds the layers'
weights as torch bf16 tensors (the stand-in for the trainer's weights: on a GPU box they are on
the device), publishes version 0 (an anchor, from a host copy, on both paths) to a local folder
bucket, then `--versions` versions, each an Adam-like step of `--density` of the elements (1-3
units in the last place, drawn in slices so the step's own temporaries stay small), with no anchor
among them. A thread samples the process's resident
set every 5 ms. Reported per path, min / median / max over rounds:

  weights_mib     the resident set once the weights are built and the heap their construction
                  freed is given back (`heap.return_freed_heap`): the baseline of the figures below
  first_mib       the peak above it while version 0 is published
  start_mib       the resident set above it when version 1 begins: what version 0 left (the delta
                  path's copy of the previous version; on the full path, heap that glibc keeps
                  resident after version 0's copies are freed: it does not return freed chunks
                  below its mmap threshold, which rises to 32 MiB, larger than any tensor here.
                  The delta path gives it back where the wired device path does, once the
                  released baseline is dropped: `heap.return_freed_heap`)
  steady_mib      the peak above it while versions 1.. are published: the per-version cost (at
                  least start_mib; the full path's freed heap counted there is reused by the versions)
  previous_mib    the bytes of the device's copy of the published version (delta path only; on the
                  CPU it is host memory and inside steady_mib; on a GPU box with
                  `stoa_device_budget_bytes` >= the model's bf16 bytes it is device memory)
  model_mib       the bf16 bytes of the layers measured

and the load average at the start and the end. Extrapolation to the whole model (docs/slime.md)
scales the steady figures by the model's bf16 bytes over the layers' (the per-version cost is
per tensor, so linear in parameter count).

Usage: python scripts/bench_delta_memory.py [--layers 0,1,2] [--smoke] [--versions 2] [--rounds 3]
       [--density 0.02] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from benchlib import Incomplete, Session, exit_code, print_spreads, require, spread, write_json

PATHS = ("full", "delta")
MIB = 1 << 20
STEP_SLICE = 1 << 18  # elements of a weight the stand-in step changes at a time


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The resident set's peak since the last `reset`, sampled every 5 ms on a thread."""

    def __init__(self) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def take(self) -> int:
        """The peak so far (the current set included), then start again from now."""
        peak, self.peak = max(self.peak, rss_bytes()), rss_bytes()
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def layer_shapes(smoke: bool, layers: list[int]) -> dict[str, tuple[int, ...]]:
    from bench_stream8b import SMOKE, param_shapes

    from macd.memory_plan import LFM2_5_8B_A1B

    shapes = param_shapes(dict(SMOKE if smoke else LFM2_5_8B_A1B))
    wanted = {f"model.layers.{i}." for i in layers}
    return {n: s for n, s in shapes.items() if (m := re.match(r"model\.layers\.\d+\.", n)) and m.group(0) in wanted}


def child(path: str, smoke: bool, layers: list[int], versions: int, density: float, seed: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
    from slime_stoa.protocol.store import open_store
    from slime_stoa.trainer.device_delta import PreviousState, bf16_view
    from slime_stoa.trainer.heap import return_freed_heap

    torch.set_num_threads(1)
    shapes = layer_shapes(smoke, layers)
    gen = torch.Generator().manual_seed(seed)
    weights = {n: (torch.randn(s, generator=gen) / math.sqrt(s[-1])).to(torch.bfloat16) for n, s in shapes.items()}
    model_bytes = sum(w.numel() * 2 for w in weights.values())
    # The float32 draws the weights were built from are the stand-in's, not the trainer's: freed,
    # glibc may keep them resident (some runs 670 MiB, some none), inside the baseline below, where
    # the delta path's trim would give them back and take them off its figures.
    return_freed_heap()
    sampler = PeakSampler()
    base = sampler.take()

    def host_bits() -> dict[str, np.ndarray]:
        return {n: bf16_view(n, w).numpy().view(np.uint16).copy() for n, w in weights.items()}

    def step() -> None:
        # In slices of STEP_SLICE elements: the stand-in optimizer's temporaries (float32 draws of a
        # whole tensor are 2x its bytes) are not the publisher's, and freed whole-tensor temporaries
        # would stay resident (glibc keeps freed chunks below its mmap threshold) inside the figures.
        for w in weights.values():
            flat = w.view(torch.int16).reshape(-1)
            for at in range(0, flat.numel(), STEP_SLICE):
                part = flat[at : at + STEP_SLICE]
                moved = (torch.rand(part.shape, generator=gen) < density).view(torch.uint8).to(torch.int16)
                units = torch.randint(1, 4, part.shape, generator=gen, dtype=torch.int16)
                part.add_(moved * units)  # 1-3 units in the last place, where moved

    async def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="stoa-bench-delta-") as bucket:
            async with open_store(f"file://{bucket}") as store:
                publisher = Publisher(store, "bench", PublisherConfig(anchor_every=versions + 10, planes=(), threads=1))
                await publisher.publish(host_bits())
                previous = PreviousState()
                if path == "delta":
                    previous.reset_from_host(publisher.release_baseline(), "cpu")
                    # where the wired device path drops the released host copy (device_publish's
                    # `_rebuild`): the same call gives the freed heap back to the OS
                    return_freed_heap()
                first = sampler.take() - base
                start = rss_bytes() - base
                changed = 0
                for _ in range(versions):
                    step()
                    if path == "full":
                        result = await publisher.publish(host_bits())
                    else:
                        delta = previous.diff(weights)
                        assert publisher.state_digest is not None
                        result = await publisher.publish_delta(previous.sparse_step(delta), base=publisher.state_digest)
                        previous.commit()
                    require(not result.anchored, "a version anchored: raise anchor_every")
                    changed += result.changed
                steady = sampler.take() - base
                return {"weights_mib": base / MIB, "first_mib": first / MIB, "start_mib": start / MIB,
                        "steady_mib": steady / MIB,
                        "previous_mib": (model_bytes if path == "delta" else 0) / MIB, "model_mib": model_bytes / MIB,
                        "changed_fraction": changed / (versions * model_bytes / 2), "digest": publisher.state_digest}

    try:
        return asyncio.run(run())
    finally:
        sampler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", default="0,1,2", help="comma-separated layer numbers (0,1: dense conv; 2: MoE attention)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the family (the test's size)")
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--density", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench-delta-memory.json"))
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers: comma-separated layer numbers, got {args.layers!r}")
    if min(args.versions, args.rounds) < 1 or not 0 < args.density <= 1:
        parser.error("--versions and --rounds must be >= 1, --density in (0, 1]")
    if not layer_shapes(args.smoke, layers):
        parser.error(f"--layers {args.layers}: no such layers in the model")
    if args.child:
        print(json.dumps(child(args.child, args.smoke, layers, args.versions, args.density, args.seed)))
        return 0
    meter = Session()
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PATHS}
    for r in range(args.rounds):
        for path in PATHS:
            cmd = [sys.executable, __file__, "--child", path, "--layers", args.layers, "--versions", str(args.versions),
                   "--density", str(args.density), "--seed", str(args.seed), *(["--smoke"] if args.smoke else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise Incomplete(f"round {r + 1}, {path}: the child failed: {proc.stderr.strip()[-400:]}")
            runs[path].append(json.loads(proc.stdout.splitlines()[-1]))
            print(f"round {r + 1} {path}: steady {runs[path][-1]['steady_mib']:.0f} MiB above the weights", flush=True)
    digests = {run["digest"] for p in PATHS for run in runs[p]}
    require(len(digests) == 1, f"the paths published different states: {sorted(digests)}")
    figures = {p: {k: spread([run[k] for run in runs[p]]) for k in ("weights_mib", "first_mib", "start_mib",
                                                                  "steady_mib", "previous_mib", "changed_fraction")} for p in PATHS}
    model_mib = runs["full"][0]["model_mib"]
    for key in ("first_mib", "start_mib", "steady_mib"):
        print_spreads(f"{key} (MiB above the weights; layers {args.layers}, {model_mib:.0f} MiB bf16)",
                      {p: figures[p][key] for p in PATHS}, unit="MiB", digits=0)
    meter.print_load()
    doc = {"layers": layers, "smoke": args.smoke, "versions": args.versions, "rounds": args.rounds,
           "density": args.density, "model_mib": model_mib, "paths": figures,
           "steady_per_model_byte": {p: figures[p]["steady_mib"]["median"] / model_mib for p in PATHS},
           "date": time.strftime("%Y-%m-%d"), **meter.meta()}
    write_json(args.json, doc)
    print(f"figures in {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main, "bench_delta_memory"))
