"""Benchmark macd's rollout generation and weight swap on a small random Qwen2.

Workload: a random Qwen2-shaped model built with `build_tiny_model` at a larger size (hidden 512,
8 layers, 8 query / 2 KV heads, MLP 1408, vocabulary 8192 with tied embeddings: ~27M
parameters; `--quick`: 4 layers, ~15M), so the matmuls dominate. B chat prompts (~100 tokens)
each get G samples at temperature 0.8 with up to `max_tokens` tokens (B=4 and 48 tokens;
`--quick`: B=2 and 16); a random model rarely emits EOS, so nearly every sample runs to
`max_tokens`.

For G = 4, 8 and 16, in the same process on the same prompts:
  * batched: `macd.generate.generate_groups` (mlx-lm's BatchGenerator, all B*G sequences in one
    batch, prompt prefilled once per group);
  * single: mlx-lm's `stream_generate` once per sample (what a naive worker does), with the same
    tempered-logprob recipe (sampler at temperature 1 plus a logits processor dividing by T) and
    the sampled token's logprob read back.
At G = 8 it also times `generate_groups` without prefill sharing and mlx-lm's `batch_generate`
with a per-sequence logits processor, to show what each design choice buys.

Weight swap, on the model as stored (bf16, as a Mac holds it):
  * swap_s_reload: `mlx_lm.load` of the folder, weights evaluated;
  * swap_s_patch: change 1% of the elements of every tensor of a uint16 (bf16 bits) numpy state
    in place, convert those tensors with `mx.array(u16).view(mx.bfloat16)`, `load_weights(...,
    strict=False)` after our own name/shape/dtype check, then `mx.eval`.

On Linux, MLX's bundled BLAS is far slower than OpenBLAS, so the script re-executes itself with
Debian's OpenBLAS (`libopenblas0-pthread`) in LD_PRELOAD when it can find it and says whether it
ran with it. Linux CPUs have no fast bf16 matmul either, so generation runs in float32 there
(`--dtype`); a Mac would run bf16.

Usage: python scripts/bench_worker.py [--quick] [--json PATH] [--no-openblas] [--dtype D]
"""

from __future__ import annotations

import argparse
import ctypes.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_PRELOAD_MARK = "STOA_BENCH_BLAS_PRELOADED"
MODEL_SIZE = dict(
    vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2,
    intermediate_size=1408,
)  # fmt: skip
QUICK_MODEL_SIZE = dict(MODEL_SIZE, num_layers=4)
TEMPERATURE = 0.8
GROUP_SIZES = (4, 8, 16)


# ------------------------------------------------------------------------------- environment


def _maybe_reexec_with_openblas(argv: list[str]) -> None:
    """On Linux, re-run this script with OpenBLAS preloaded (once), if the library exists."""
    if sys.platform != "linux" or os.environ.get(_PRELOAD_MARK) or "--no-openblas" in argv:
        return
    lib = ctypes.util.find_library("openblas")
    if lib is None:
        return
    env = dict(os.environ, **{_PRELOAD_MARK: lib})
    env["LD_PRELOAD"] = " ".join(filter(None, [lib, os.environ.get("LD_PRELOAD")]))
    os.execve(sys.executable, [sys.executable, *argv], env)


def _blas_note() -> str:
    if sys.platform != "linux":
        return "platform default (Accelerate/Metal)"
    lib = os.environ.get(_PRELOAD_MARK)
    if lib:
        return f"OpenBLAS preloaded ({lib})"
    return "MLX bundled BLAS (no OpenBLAS preloaded: expect much slower matmuls)"


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _sgemm_gflops() -> float:
    """A quick float32 matmul rate, to show which BLAS is in effect."""
    import mlx.core as mx

    a, b = mx.random.normal((256, 512)), mx.random.normal((512, 1408))
    mx.eval(a, b, a @ b)
    n, tic = 20, time.perf_counter()
    for _ in range(n):
        mx.eval(a @ b)
    return 2 * 256 * 512 * 1408 * n / (time.perf_counter() - tic) / 1e9


# ----------------------------------------------------------------------------------- workload


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` distinct GSM8K-like chat prompts of ~100 tokens."""
    from slime_stoa.quickstart.tiny_model import default_corpus

    lines = default_corpus()
    prompts = []
    for i in range(n):
        question = " ".join(lines[4 * i + 1 : 4 * i + 5 : 2] + lines[4 * i : 4 * i + 2])
        messages = [{"role": "user", "content": f"{question} Think step by step."}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return prompts


def run_batched(model: Any, tok: Any, prompts: list[list[int]], g: int, max_tokens: int,
                **kwargs: Any) -> tuple[int, float]:
    """(tokens generated, seconds) for `generate_groups`."""
    from macd.generate import SamplingConfig, generate_groups

    cfg = SamplingConfig(temperature=TEMPERATURE, max_tokens=max_tokens, group_size=g, seed=0)
    tic = time.perf_counter()
    groups = generate_groups(model, tok, prompts, cfg, **kwargs)
    return sum(len(c.tokens) for grp in groups for c in grp), time.perf_counter() - tic


def run_single(model: Any, tok: Any, prompts: list[list[int]], g: int,
               max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) for mlx-lm's `stream_generate`, once per sample."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(temp=1.0)
    processors = [lambda _tokens, logits: logits / TEMPERATURE]
    n, tic = 0, time.perf_counter()
    for prompt in prompts:
        for _ in range(g):
            logprobs = []
            for r in stream_generate(model, tok, prompt, max_tokens=max_tokens,
                                     sampler=sampler, logits_processors=processors):
                logprobs.append(r.logprobs[r.token].item())
            n += len(logprobs)
    return n, time.perf_counter() - tic


def run_batch_generate_processor(model: Any, tok: Any, prompts: list[list[int]], g: int,
                                 max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) for mlx-lm's `batch_generate` with a T-dividing logits processor."""
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    seqs = [p for p in prompts for _ in range(g)]
    tic = time.perf_counter()
    out = batch_generate(
        model, tok, seqs, max_tokens=max_tokens, return_logprobs=True,
        sampler=make_sampler(temp=1.0),
        logits_processors=[lambda _tokens, logits: logits / TEMPERATURE],
        completion_batch_size=len(seqs), prefill_batch_size=len(seqs),
    )
    return sum(len(x) for x in out.logprobs), time.perf_counter() - tic


def bench_generation(model: Any, tok: Any, n_prompts: int, max_tokens: int) -> dict[str, Any]:
    """Batched vs single-stream throughput for each G, plus the G=8 design ablations."""
    prompts = make_prompts(tok, n_prompts)
    run_batched(model, tok, prompts[:1], 2, 4)  # warm-up
    run_single(model, tok, prompts[:1], 1, 4)
    rows = []
    for g in GROUP_SIZES:
        bt, bs = run_batched(model, tok, prompts, g, max_tokens)
        st, ss = run_single(model, tok, prompts, g, max_tokens)
        rows.append({
            "G": g, "sequences": n_prompts * g,
            "batched_tokens_per_s": bt / bs, "batched_groups_per_s": n_prompts / bs,
            "single_tokens_per_s": st / ss, "single_groups_per_s": n_prompts / ss,
            "speedup": (bt / bs) / (st / ss),
        })
    nt, ns = run_batched(model, tok, prompts, 8, max_tokens, share_prefill=False)
    pt, ps = run_batch_generate_processor(model, tok, prompts, 8, max_tokens)
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "rows": rows,
        "g8_no_share_prefill_tokens_per_s": nt / ns,
        "g8_batch_generate_processor_tokens_per_s": pt / ps,
    }


# ---------------------------------------------------------------------------------- swapping


def bench_reload(path: Path, repeats: int) -> float:
    """Median seconds for `mlx_lm.load` of the folder, weights evaluated."""
    import mlx.core as mx
    import mlx_lm

    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        model, _ = mlx_lm.load(str(path))
        mx.eval(model.parameters())
        times.append(time.perf_counter() - tic)
    return sorted(times)[len(times) // 2]


def _check_against(model: Any, updates: list[tuple[str, Any]]) -> None:
    """`load_weights(strict=False)` checks nothing: names, shapes and dtypes checked here."""
    from mlx.utils import tree_flatten

    current = dict(tree_flatten(model.parameters()))
    for name, value in updates:
        have = current.get(name)
        if have is None or have.shape != value.shape or have.dtype != value.dtype:
            raise ValueError(f"patch tensor {name} does not fit the model")


def bench_patch(path: Path, density: float, repeats: int) -> tuple[float, int]:
    """Median seconds to change `density` of every tensor in place and swap them into MLX."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np
    from mlx.utils import tree_flatten

    from slime_stoa.protocol.hf.folders import load_hf_state

    model, _ = mlx_lm.load(str(path))
    state = load_hf_state(path)
    rng = np.random.default_rng(0)
    patches = []
    for name, bits in state.items():  # a patch: new bf16 bits at 1% of the positions
        idx = rng.choice(bits.size, size=max(1, int(bits.size * density)), replace=False)
        patches.append((name, idx, bits.reshape(-1)[idx] ^ np.uint16(1)))
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        for name, idx, new in patches:
            state[name].reshape(-1)[idx] = new
        updates = [(name, mx.array(state[name]).view(mx.bfloat16)) for name, _, _ in patches]
        _check_against(model, updates)
        model.load_weights(updates, strict=False)
        mx.eval(model.parameters())
        times.append(time.perf_counter() - tic)
        patches = [(n, i, v ^ np.uint16(1)) for n, i, v in patches]  # next round flips back
    params = dict(tree_flatten(model.parameters()))
    name = next(iter(state))
    if not np.array_equal(np.array(params[name].view(mx.uint16)), state[name]):
        raise AssertionError("patched MLX weights differ from the numpy state")
    return sorted(times)[len(times) // 2], sum(b.size for b in state.values())


# --------------------------------------------------------------------------------------- main


def _print_table(gen: dict[str, Any]) -> None:
    print(f"{'G':>3} {'seqs':>5} {'batched tok/s':>14} {'single tok/s':>13} "
          f"{'batched grp/s':>14} {'single grp/s':>13} {'speedup':>8}")
    for r in gen["rows"]:
        print(f"{r['G']:>3} {r['sequences']:>5} {r['batched_tokens_per_s']:>14.0f} "
              f"{r['single_tokens_per_s']:>13.0f} {r['batched_groups_per_s']:>14.3f} "
              f"{r['single_groups_per_s']:>13.3f} {r['speedup']:>7.2f}x")
    print(f"G=8 without prefill sharing: {gen['g8_no_share_prefill_tokens_per_s']:.0f} tok/s; "
          f"mlx-lm batch_generate + per-sequence logits processor: "
          f"{gen['g8_batch_generate_processor_tokens_per_s']:.0f} tok/s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-openblas", action="store_true", help="do not preload OpenBLAS")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        default="float32" if sys.platform == "linux" else "bfloat16",
                        help="compute dtype for generation (default: float32 on Linux)")
    parser.add_argument("--prompts", type=int, help="prompts per batch (B)")
    parser.add_argument("--max-tokens", type=int, help="tokens per sample")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a script: may re-execute itself with OpenBLAS preloaded
        argv = sys.argv[1:]
        _maybe_reexec_with_openblas([sys.argv[0], *argv])
    args = parse_args(argv)
    import mlx.core as mx
    import mlx_lm

    from slime_stoa.quickstart.tiny_model import build_tiny_model

    size = QUICK_MODEL_SIZE if args.quick else MODEL_SIZE
    n_prompts = args.prompts or (2 if args.quick else 4)
    max_tokens = args.max_tokens or (16 if args.quick else 48)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "model", **size)
        model, tok = mlx_lm.load(str(path))
        model.set_dtype(getattr(mx, args.dtype))
        print(f"model: random Qwen2 {size}, compute {args.dtype}; BLAS: {_blas_note()} "
              f"(float32 matmul {_sgemm_gflops():.0f} GFLOP/s); {platform.machine()}, "
              f"{os.cpu_count()} CPUs")
        print(f"workload: B={n_prompts} prompts, max_tokens={max_tokens}, T={TEMPERATURE}; "
              f"load average {_load():.1f} (a busy machine skews the numbers)")
        gen = bench_generation(model, tok, n_prompts, max_tokens)
        _print_table(gen)
        swap_reload = bench_reload(path, repeats=3)
        swap_patch, n_params = bench_patch(path, density=0.01, repeats=3)
    print(f"load average at the end: {_load():.1f}")
    print(f"weight swap ({n_params / 1e6:.1f}M bf16 params): reload {swap_reload * 1e3:.1f} ms, "
          f"1% in-place patch {swap_patch * 1e3:.1f} ms")
    g8 = next(r for r in gen["rows"] if r["G"] == 8)
    result = {
        "quick": args.quick, "model": size, "params": n_params, "dtype": args.dtype,
        "blas": _blas_note(), "openblas_preloaded": bool(os.environ.get(_PRELOAD_MARK)),
        "load_average": _load(),
        "prompts": n_prompts, "max_tokens": max_tokens, "temperature": TEMPERATURE,
        **gen,
        "speedup_g8": g8["speedup"], "tokens_per_s_g8": g8["batched_tokens_per_s"],
        "groups_per_s_g8": g8["batched_groups_per_s"],
        "swap_s_reload": swap_reload, "swap_s_patch": swap_patch,
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
