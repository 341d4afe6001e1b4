"""A worker holding a quantized plane of LFM2.5-8B-A1B: its resident memory over what it serves.

The reference fleet serves LFM2.5-8B-A1B (8.47B weights) from 16 and 24 GB Macs on the int4 and
int8 planes the trainer publishes; a worker on a plane holds that plane alone (`macd.plane_weights`:
the subscriber's state is the served model's memory, no bf16 master). This measures it at the real
shape, in a child process per plane whose memory is its own:

  1. imports (mlx, mlx-lm, macd) and one MLX op: the baseline RSS, the runtime a worker has anyway;
  2. the model built from the published config.json by mlx-lm's own classes (parameters are lazy
     placeholders never computed, `macd.generate.build_model`);
  3. the plane state as a sync leaves it: each checkpoint tensor (trained-looking bf16 bits, as in
     `bench_stream8b.py`) quantized to the plane one at a time (`pulse.plane.plane_bits`); the
     bf16 bits of a tensor are dropped as soon as its plane arrays exist;
  4. installed (`PlaneWeights.from_state`: each parameter into MLX, the state lent views of it);
  5. a version applied as a worker commits it: 2% of every tensor's bf16 elements moved by 1-3
     ulp, the plane's next codes/scales/biases from the touched groups
     (`pulse.plane.updated_plane_bits`), the changed uint16 halves written into the lent views and
     `PlaneWeights.apply` (in place: nothing reinstalled); measured while the version's changed
     indices are still held (`version being applied`; a worker holds its patch's as long) and
     after they are dropped;
  6. a short generation: a prompt of `--prompt-tokens` tokens prefilled and `--decode-steps`
     tokens decoded for one sequence (MLX's CPU kernels for quantized matrices are slow: this
     checks that computing allocates no copy of the weights, not speed).

Reported per plane: served bytes (`PlaneWeights.nbytes`), the KV/conv cache held, RSS over the
baseline after each stage and its peak, and `rss_over_served` = RSS over the baseline after the
generation / (served + cache). Target: <= 1.15x. The bf16 master a worker-side int8
would keep (`master_bytes`) is 0 on a published plane by construction; the JSON says so from the
model (`PlaneWeights.master_apart`).

Memory: the int4 plane is ~4.8 GB and the int8 plane ~9.0 GB (plus the bench's own transients), so
both fit this machine's 24 GB one after the other; `--smoke` runs a tiny width of the same layout.

A plane whose child fails (killed for memory, a patch that did not land in the served memory)
ends the run with exit 1 naming the plane; no JSON is written.

Usage: python scripts/bench_plane_memory.py [--planes int4,int8] [--smoke] [--json PATH]
       [--prompt-tokens N] [--decode-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import Session, exit_code, exit_on_signals, require, write_json

PLANES = ("int4", "int8")
DENSITY = 0.02  # share of bf16 elements a version moves (bench_stream8b's default)
SEED = 0


def rss_now() -> int:
    """Resident memory of this process now (Linux /proc), else its peak so far."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss()


def peak_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def model_folder(folder: Path, config: dict[str, Any]) -> Path:
    """A model folder of `config`'s shape without weight files: a tiny LFM2-MoE's config.json and
    tokenizer, its shape fields replaced by `config`'s."""
    from slime_stoa.quickstart.tiny_model import build_tiny_family

    path = build_tiny_family(folder, "lfm2_moe")
    for weights in path.glob("*.safetensors"):
        weights.unlink()
    index = path / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config)
    cfg["full_attn_idxs"] = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One plane's worker memory, in this process (module doc, steps 1-6)."""
    import mlx.core as mx
    import mlx_lm  # noqa: F401  # the runtime a worker has loaded before any weights
    import numpy as np
    from bench_stream8b import next_bits, param_shapes, previous_bits
    from mlx_lm.models.cache import make_prompt_cache

    from macd.generate import build_model
    from macd.mlx_thread import return_freed_memory
    from macd.plane_weights import PlaneWeights
    from slime_stoa.protocol.pulse.plane import plane_bits, updated_plane_bits

    mx.eval(mx.ones(8) @ mx.ones(8))
    baseline = rss_now()
    stages: dict[str, int] = {}
    seconds: dict[str, float] = {}
    plane, config = spec["plane"], spec["config"]

    tic = time.perf_counter()
    model, _ = build_model(spec["folder"])
    stages["model built"] = rss_now() - baseline
    shapes = param_shapes(config)
    state: dict[str, np.ndarray] = {}
    keys: dict[str, list[str]] = {}  # checkpoint tensor -> its plane tensors
    for name, shape in shapes.items():
        arrays = plane_bits({name: previous_bits(name, shape, SEED)}, plane, "lfm2_moe")
        keys[name] = list(arrays)
        state.update(arrays)
        del arrays
    return_freed_memory()
    stages["plane state held"] = rss_now() - baseline
    seconds["build"] = time.perf_counter() - tic

    tic = time.perf_counter()
    live = PlaneWeights.from_state(model, state, plane)
    return_freed_memory()
    stages["installed"] = rss_now() - baseline
    seconds["install"] = time.perf_counter() - tic
    served = live.nbytes

    tic = time.perf_counter()
    touched: list[str] = []
    changed: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        old = previous_bits(name, shape, SEED)
        new = next_bits(name, old, DENSITY, SEED)
        moved = np.flatnonzero(old.reshape(-1) != new.reshape(-1))
        before = {key: state[key] for key in keys[name]}
        after = updated_plane_bits(before, {name: new}, {name: moved}, plane, "lfm2_moe")
        for key, bits in after.items():
            flat, target = bits.reshape(-1), state[key].reshape(-1)
            at = np.flatnonzero(flat != target)
            if at.size:
                target[at] = flat[at]  # written into the served weights' memory (a lent view)
                changed[key] = at
                touched.append(key)
        del old, new, after
    stats = live.apply(state, changed, touched)
    stages["version being applied"] = rss_now() - baseline  # the version's changed indices still held
    index_bytes = sum(at.nbytes for at in changed.values())
    patched = len(touched)
    del changed, touched  # as a worker drops the sync's result after the install
    return_freed_memory()
    stages["version applied"] = rss_now() - baseline
    seconds["apply"] = time.perf_counter() - tic
    require(live.shares(state) and stats.tensors == 0, f"{plane}: the patch did not land in the served memory "
            f"({stats.tensors} tensors reinstalled)")

    tic = time.perf_counter()
    cache = make_prompt_cache(model)
    prompt = mx.array([list(range(1, spec["prompt_tokens"] + 1))])
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    for _ in range(spec["decode_steps"]):
        token = mx.argmax(logits[:, -1:], axis=-1)
        logits = model(token, cache=cache)
        mx.eval(logits)
    cache_bytes = sum(c.nbytes for c in cache)
    stages["generated"] = rss_now() - baseline
    seconds["generate"] = time.perf_counter() - tic
    return {
        "plane": plane, "served_bytes": served, "cache_bytes": cache_bytes,
        "master_bytes": 0 if not live.master_apart else sum(a.nbytes for a in state.values()),
        "rss_baseline_bytes": baseline, "rss_stages_bytes": stages, "peak_rss_over_baseline_bytes": peak_rss() - baseline,
        "rss_over_served": stages["generated"] / (served + cache_bytes),
        "mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
        "patched_tensors": patched, "changed_index_bytes": index_bytes, "seconds": seconds,
        "weights": sum(int(np.prod(s)) for s in shapes.values()),
    }  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", default=",".join(PLANES), help="planes to measure, one child each (int4,int8)")
    parser.add_argument("--smoke", action="store_true", help="the published layout at a tiny width (seconds)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--prompt-tokens", type=int, default=4, help="prompt tokens prefilled (default 4)")
    parser.add_argument("--decode-steps", type=int, default=2, help="tokens decoded after the prompt (default 2)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.planes = [p for p in args.planes.split(",") if p]
    for plane in args.planes:
        if plane not in PLANES:
            parser.error(f"--planes: unknown plane {plane!r} ({', '.join(PLANES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        return exit_code(lambda: write_child(spec), f"bench_plane_memory's {spec['plane']} child")
    return exit_code(lambda: bench(args), "bench_plane_memory")


def write_child(spec: dict[str, Any]) -> int:
    Path(spec["out"]).write_text(json.dumps(child(spec)))
    return 0


def bench(args: argparse.Namespace) -> int:
    from bench_stream8b import SMOKE, config_of

    config = dict(SMOKE if args.smoke else config_of("published"))
    session = Session()
    results: dict[str, Any] = {}
    with exit_on_signals(), tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(Path(tmp) / "model", config)
        for plane in args.planes:
            out = Path(tmp) / f"{plane}.json"
            spec = {"plane": plane, "config": config, "folder": str(folder), "out": str(out),
                    "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps}
            print(f"{plane}: building, installing, patching and generating in a child process ...", flush=True)
            code = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)]).returncode
            require(code == 0 and out.exists(), f"the {plane} child exited with {code}")
            r = results[plane] = json.loads(out.read_text())
            gib = 2**30
            print(f"{plane}: served {r['served_bytes'] / gib:.2f} GiB + cache {r['cache_bytes'] / 2**20:.1f} MiB; RSS over "
                  f"the runtime's {r['rss_baseline_bytes'] / 2**20:.0f} MiB: " + ", ".join(
                      f"{k} {v / gib:.2f}" for k, v in r["rss_stages_bytes"].items())
                  + f" GiB (peak {r['peak_rss_over_baseline_bytes'] / gib:.2f}); rss_over_served "
                  f"{r['rss_over_served']:.3f} (target <= 1.15); master {r['master_bytes']} B; "
                  f"{r['patched_tensors']} plane tensors patched in place", flush=True)
    session.print_load()
    doc = {
        "smoke": args.smoke, "config": config, **session.meta(), "planes": results,
        "rss_over_served": {p: r["rss_over_served"] for p, r in results.items()},
        "master_bytes": {p: r["master_bytes"] for p, r in results.items()},
    }
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
