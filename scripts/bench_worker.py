"""Benchmark macd's rollout generation against mlx-lm's batched path, and its weight swaps.

Model: a random Qwen2 shape built with `build_tiny_model` (hidden 768, 12 layers, 12 query / 2
KV heads, MLP 2048, vocabulary 32000 with tied embeddings: 97.7M parameters; `--quick`: 4
layers, hidden 512, MLP 1408, vocabulary 8192: 15M). On Linux the throughput part computes in
float32, since MLX has no fast bf16 matmul on a CPU (a Mac would run bf16), and MLX's matmuls
get the fast BLAS a worker gets (`macd.cpu_blas`, loaded before MLX; --no-fast-blas keeps MLX's
bundled one, far slower); the header says what it ran with.

Variable response lengths. A random model never stops on its own, so the stop set (the
tokenizer's EOS ids for both contestants) is chosen to spread its response lengths the way a
model's answers to GSM8K spread, many short and a long tail: a random set of token ids whose
probability under the random model sums to about 1 / `--mean-tokens` per step, which gives
geometric lengths (mean ~60 tokens by default, the tail cut at `--max-tokens`), measured and
printed (p10 / p50 / p90 / share at the cap). Real answers are longer (a few hundred tokens);
the scale is cut to fit this machine, the shape (tail / mean) is what matters.

Throughput, same prompts (GSM8K-like chat prompts of ~100 tokens), same G, same sampler and
tempered-logprob recipe (the model's logits divided by T in one op, a keyed categorical sampler),
same batch of B*G sequences, in one process:
  * mlx_lm: a worker loop built on mlx-lm's `batch_generate`, the strongest path a worker can
    use: one call per cohort of B prompts x G samples (it must return between cohorts to change
    weights and label versions), each prompt prefilled once and its KV cache shared by its G
    sequences (`prompt_caches=`), logprobs returned (`return_logprobs=True`). Each call runs
    until its longest sample ends, so the batch runs half empty at its tail.
  * macd: `macd.generate.ContinuousGenerator`, as the worker drives it: groups enter as soon as
    there is room (`room()`: one group queued behind a full batch), so the batch stays full. As
    in a worker, prompts never run out (the list is drawn again); the clock stops once as many
    groups finished as there are prompts, and every token sampled until then counts (in a
    worker the groups still in flight finish later). The table also shows the same prompts
    drained to their last group (no prompt after the last: a tail no worker has).
  * with `--swap-run`, macd again with a version asked for every `--swap-every` seconds and
    installed at the worker's safe points (no new weights: the drain-and-drop policy's cost).

Rounds: the three contenders (mlx_lm, macd, macd drained) run one after the other in each of
`--rounds` rounds (default 3, `--quick` 2), so a load change touches all of them; tok/s figures
are min / median / max over the rounds. Two headline ratios, both ratios of medians:
  * `tokens_per_step_ratio`: tokens per decode step, macd over mlx_lm (a batch_generate call
    steps until its longest sample ends: its steps are the cohort's longest response). What
    keeping the batch full buys, whatever a step costs: on a Mac GPU, memory-bound at these
    batch sizes, a step costs about the same full or half empty, so this is the gain there.
  * `ratio_vs_mlx_lm_median`: wall tokens/s, macd over mlx_lm, on this machine. On a shared
    2-core CPU a step's cost grows with the sequences in it and with the other processes, so
    this one moves with the load: `load_average_rounds` holds the load after each contender's
    run (`load_average_throughput` its min / median / max), and the report says it beside it.

Batch size: B=2 x G=8 = 16 by default. A worker's decode on a Mac GPU is memory-bound at the
batch sizes it uses (a step costs about the same with 4 or 32 sequences), which is what makes a
half-empty tail expensive. This 2-core CPU is only close to that up to ~16 sequences of the
100M model (measured: ~74 ms a step for 1 sequence, ~150 for 8, ~175 for 16, ~190 for 32 with
the prompt cache only, and steeper in a real decode); at 32 it is compute-bound, a step costs
about as much per sequence as a full one, and keeping the batch full buys little
(`--prompts 4`: ratio ~1.0 here).

Worker per plane (`--planes`, default bf16,int8,int4: the worker as it runs on a Mac): a real
`macd.worker.Worker` in a child process per plane against a local-folder bucket, serving bf16
weights (one copy: the subscriber's state is the model's memory) or a quantized plane the run
publishes (held alone, `macd.plane_weights`), while this process publishes a version (1% of the
bf16 elements changed, the publisher's default mode; the planes follow it) each time the worker
has installed the previous one. `rss_over_served` per plane: RSS over the runtime / (served
weights + KV cache); `master_bytes` per plane: what the worker holds apart from the served
weights (0 unless it quantizes bf16 weights itself). MLX's CPU kernels for quantized matrices are
slow (a prefill of the quantized 98M model takes tens of seconds here), so on the planes the
drain waits for one such step and the install delay says little; a Mac runs them on Metal. The
child reports: rss_bytes (its resident memory while generating, over the RSS it had after its imports,
i.e. without the Python/MLX runtime), weight_bytes, kv_bytes (KV cache held, sampled on the MLX
thread), and for each version change the time ready beside generation, the drain, the decode
pause (swap_stall_s: decoding stopped, in-flight groups dropped, MLX synchronised, patch
scattered into the live weights) and the install itself (`install_delay_s_max`: the longest time from a version being ready to its
install done, drain + pause); and mlx_install_s, the time to install
a whole version's tensors into MLX (what an install costs without patching the live weights in
place). On a Linux CPU with a fast BLAS the bf16 worker computes in float32 (`macd.cpu_compute`)
and holds float32 copies of its weights beside them (`copy_bytes`, counted as served); only the
pause and the memory matter here.

macd against transformers (`--vs-transformers`, that comparison alone): a real pretrained model
(`--model`, default SmolLM2-135M-Instruct built by `slime_stoa.quickstart.real_model`), B=2
GSM8K prompts (the GSM8K task's system prompt, the tokenizer's chat template) x G=8 = 16
sequences, `--new-tokens` (128) each with no early stop (macd: no stop token; transformers:
min = max new tokens), T=0.8, top-k and top-p off on both sides. Each side runs in its own
process (so neither's BLAS or threads touch the other's): macd as `macd run` serves (the model
built from its config, the bf16 master installed by `live_weights`, a fast BLAS and float32
compute on a Linux CPU, `ContinuousGenerator` driven as the worker drives it, prompts prefilled
once per group, MLX's compile as the worker has it), transformers' own batched `generate`
(each prompt repeated G times, left padded). transformers first runs a short calibration over
`--hf-threads` (1,2) x `--hf-dtypes` (bfloat16, float32) and is timed at its fastest. Then
`--rounds` interleaved rounds (macd, transformers); tok/s min / median / max, the load average
of each round, each side's RSS; `ratio_vs_transformers_median` is macd's median over
transformers' (target >= 0.5: within 2x). Exits 2 without the model.

Bounded by work: every part runs its whole workload (rounds, groups, versions) however long it
takes. When it cannot finish (a plane's worker or a contender exits, or shows no progress for
`--stall-s`, 900 s by default: its heartbeat or its answers stop moving), the run exits 1 naming
what did not finish and writes no JSON.

Targets: tokens_per_step_ratio >= 1.3 with variable lengths; rss_over_served <= 1.15 (a fixed ~20-30 MiB
of the process's own heap weighs on a 98M model; `bench_plane_memory.py` measures the planes at
the LFM2.5-8B-A1B shape); swap_stall_s <= mlx_install_s.

Usage: python scripts/bench_worker.py [--quick | --smoke] [--json PATH] [--no-fast-blas] [--dtype D] [--rounds N]
       [--cohorts N] [--prompts B] [--group-size G] [--max-tokens M] [--mean-tokens L] [--planes P,..]
       [--stall-s S]
       python scripts/bench_worker.py --vs-transformers [--model DIR] [--new-tokens N] [--rounds N]
       [--hf-threads 1,2] [--hf-dtypes bfloat16,float32] [--stall-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

_WORKER_COMPILE = os.environ.get("MLX_DISABLE_COMPILE")  # what a worker started here would have
if "--contender" not in sys.argv:  # a contender process computes as a worker does (its parent decides)
    os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import (
    STALL_S,
    Incomplete,
    Session,
    StallWatch,
    exit_code,
    exit_on_signals,
    load_average,
    on_signal_exit,
    print_spreads,
    ratio,
    require,
    spread,
    write_json,
)

MODEL_SIZE = dict(
    vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=2,
    intermediate_size=2048,
)  # fmt: skip
QUICK_MODEL_SIZE = dict(
    vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
    intermediate_size=1408,
)  # fmt: skip
TEMPERATURE = 0.8
STEPS_PER_CALL = 16  # as macd.worker drives the generator


# ------------------------------------------------------------------------------- environment


_BLAS_LINE = ""  # what `macd.cpu_blas.use_fast_blas` chose for this process


def _use_fast_blas(argv: list[str]) -> None:
    """Give MLX's CPU matmuls a fast BLAS the way `macd run` does (`macd.cpu_blas`), before MLX
    is imported, unless --no-fast-blas. The transformers contender's process is left alone: torch
    brings its own MKL, and nothing of ours may sit in its global scope."""
    global _BLAS_LINE
    if sys.platform != "linux" or "--no-fast-blas" in argv or "--no-openblas" in argv:
        return
    if "--contender" in argv and argv[argv.index("--contender") + 1 :][:1] == ["hf"]:
        return
    from macd.cpu_blas import use_fast_blas

    _BLAS_LINE = use_fast_blas()


def _blas_note() -> str:
    """The BLAS in use, its library named by file name alone (a results file travels)."""
    if sys.platform != "linux":
        return "platform default (Accelerate/Metal)"
    line = _BLAS_LINE.removeprefix("BLAS for MLX's CPU matmuls: ") or "MLX's bundled reference BLAS"
    return re.sub(r"\(/[^)]*/([^/)]+)\)", r"(\1)", line)


def _rss() -> int:
    """Resident memory of this process now (Linux), else its peak so far."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


# ----------------------------------------------------------------------------------- workload


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` distinct GSM8K-like chat prompts of ~100 tokens."""
    from slime_stoa.quickstart.tiny_model import default_corpus

    lines = default_corpus()
    prompts = []
    for i in range(n):
        j = (4 * i) % (len(lines) - 6)
        question = " ".join(lines[j + 1 : j + 5 : 2] + lines[j : j + 2])
        messages = [{"role": "user", "content": f"{question} Think step by step."}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return prompts


def stop_set(model: Any, prompts: list[list[int]], mean_tokens: float, seed: int) -> list[int]:
    """Random token ids whose probability (at T, averaged over the prompts' positions) sums to
    1 / mean_tokens, so the random model stops after ~mean_tokens tokens (geometric)."""
    import mlx.core as mx
    import numpy as np

    from macd.generate import tempered

    total = None
    for p in prompts:
        logits = tempered(model(mx.array(p)[None])[0], TEMPERATURE)
        probs = mx.softmax(logits, axis=-1).sum(axis=0)
        total = probs if total is None else total + probs
    assert total is not None
    mean = np.array(total / sum(len(p) for p in prompts))
    order = np.random.default_rng(seed).permutation(mean.size)
    k = int(np.searchsorted(np.cumsum(mean[order]), 1.0 / mean_tokens)) + 1
    return sorted(int(i) for i in order[:k])


def lengths_note(lengths: list[int], max_tokens: int) -> dict[str, float]:
    import numpy as np

    a = np.array(lengths)
    return {
        "mean": float(a.mean()), "p10": float(np.percentile(a, 10)), "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)), "at_max_tokens": float((a >= max_tokens).mean()),
    }  # fmt: skip


def run_mlx_lm(model: Any, tok: Any, prompts: list[list[int]], g: int, b: int, max_tokens: int,
               seed: int) -> dict[str, Any]:
    """A worker on mlx-lm's batch_generate: one call per cohort of b prompts x g samples."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.models.cache import make_prompt_cache

    from macd.generate import _KeyedSampler, _TemperedModel

    wrapped, sampler = _TemperedModel(model, TEMPERATURE), _KeyedSampler(seed)
    tokens, lengths, steps = 0, [], 0
    tic = time.perf_counter()
    for start in range(0, len(prompts), b):
        cohort = prompts[start : start + b]
        caches = []
        for p in cohort:  # prefilled once, shared by its g sequences
            cache = make_prompt_cache(model)
            model(mx.array(p[:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
            caches += [cache] * g
        out = batch_generate(
            wrapped, tok, [[p[-1]] for p in cohort for _ in range(g)], prompt_caches=caches,
            max_tokens=max_tokens, return_logprobs=True, sampler=sampler,
            completion_batch_size=len(caches), prefill_batch_size=len(caches),
        )
        tokens += out.stats.generation_tokens
        if out.logprobs is None:
            raise Incomplete("mlx-lm's batch_generate returned no logprobs")
        lengths += [len(x) for x in out.logprobs]
        steps += max((len(x) for x in out.logprobs), default=0)  # the call steps until its longest ends
    return {"tokens": tokens, "seconds": time.perf_counter() - tic, "lengths": lengths, "steps": steps}


def run_macd(model: Any, tok: Any, prompts: list[list[int]], g: int, capacity: int, max_tokens: int,
             seed: int, swap_every_s: float | None = None, drain_steps: int = 0,
             endless: bool = False) -> dict[str, Any]:
    """The continuous generator as the worker drives it, until a group of every prompt finished.

    `endless`: as in a worker, prompts never run out (the list is drawn again in order), and the
    clock stops when as many groups finished as there are prompts; every token sampled until
    then counts (a worker's groups in flight finish later, on the same weights) but those of
    groups dropped at a swap. Otherwise the run drains to the last group. With `swap_every_s`, a version is asked for that often and installed at the worker's
    safe points (`at_safe_point`: a short drain, a group dropped at most once); the weights stay
    the same, so the policy's cost alone is measured."""
    from macd.generate import ContinuousGenerator, SamplingConfig
    from macd.worker import at_safe_point

    cfg = SamplingConfig(temperature=TEMPERATURE, max_tokens=max_tokens, group_size=g, seed=seed)
    gen = ContinuousGenerator(model, tok, cfg, max_batch=capacity)
    queue = [(i, False) for i in range(len(prompts))]  # (prompt index, restarted): the generator's tags
    useful, lengths, swaps, dropped, pauses = 0, [], 0, 0, []
    tic = time.perf_counter()
    next_swap = None if swap_every_s is None else tic + swap_every_s
    asked_at: int | None = None  # decode step at which the pending version was asked for
    n_finished = 0
    while (queue or gen.groups) and not (endless and n_finished >= len(prompts)):
        if endless and not queue:
            queue = [(i, False) for i in range(len(prompts))]
        if asked_at is None and next_swap is not None and time.perf_counter() >= next_swap:
            asked_at = gen.steps
        drained = 0 if asked_at is None else gen.steps - asked_at
        restarted = any(r for _, r in gen.tags())
        if asked_at is not None and at_safe_point(gen.groups, restarted, drained, drain_steps):
            t = time.perf_counter()
            tags = gen.quiesce()
            dropped += len(tags)
            queue[:0] = [(i, True) for i, _ in tags]  # restarted first, as the worker does
            pauses.append(time.perf_counter() - t)
            swaps, asked_at = swaps + 1, None
            next_swap = time.perf_counter() + (swap_every_s or 0)
            continue
        if asked_at is None:
            for _ in range(gen.room(capacity)):
                if queue:
                    tag = queue.pop(0)
                    gen.insert(prompts[tag[0]], tag)
        draining = asked_at is not None and drained < drain_steps
        finished, _ = gen.advance(drain_steps - drained if draining else STEPS_PER_CALL)
        for f in finished[: len(prompts) - n_finished] if endless else finished:
            useful += sum(len(c.tokens) for c in f.completions)
            lengths += [len(c.tokens) for c in f.completions]
            n_finished += 1
    seconds = time.perf_counter() - tic
    if endless:
        useful = gen.tokens - gen.tokens_dropped
    gen.close()
    return {"tokens": useful, "sampled": gen.tokens, "seconds": seconds, "lengths": lengths, "steps": gen.steps,
            "swaps": swaps, "dropped": dropped, "pause_s": sum(pauses) / max(len(pauses), 1)}


def bench_throughput(model: Any, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_prompts(tok, args.cohorts * args.prompts)
    stops = stop_set(model, prompts[:4], args.mean_tokens, seed=0)
    tok.eos_token_ids = stops
    g, b, capacity = args.group_size, args.prompts, args.prompts * args.group_size
    run_mlx_lm(model, tok, prompts[:1], 2, 1, 4, seed=1)  # warm-up
    run_macd(model, tok, prompts[:1], 2, 2, 4, seed=1)
    runs: dict[str, list[dict[str, Any]]] = {"mlx_lm": [], "macd": [], "macd_drained": []}
    loads: list[float] = []  # the 1-minute load average after each contender's run: the load it ran under
    for r in range(args.rounds):  # interleaved: every contender once per round; seeds differ per round
        runs["mlx_lm"].append(run_mlx_lm(model, tok, prompts, g, b, args.max_tokens, seed=r))
        loads.append(load_average())
        runs["macd"].append(run_macd(model, tok, prompts, g, capacity, args.max_tokens, seed=r, endless=True))
        loads.append(load_average())
        runs["macd_drained"].append(run_macd(model, tok, prompts, g, capacity, args.max_tokens, seed=r))
        loads.append(load_average())
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {x[-1]['tokens'] / x[-1]['seconds']:.0f} tok/s" for name, x in runs.items())
            + f" (load {loads[-1]:.1f})", flush=True)
    for name, rs in runs.items():
        require(all(x["tokens"] > 0 and x["steps"] > 0 for x in rs), f"{name} generated no tokens in a round")
    tok_s = {name: spread([x["tokens"] / x["seconds"] for x in rs]) for name, rs in runs.items()}
    per_step = {name: spread([x["tokens"] / max(x["steps"], 1) for x in rs]) for name, rs in runs.items()}

    def median_run(name: str) -> dict[str, Any]:
        """The round whose tok/s is the median (the lower middle for an even count)."""
        ordered = sorted(runs[name], key=lambda x: x["tokens"] / x["seconds"])
        return ordered[(len(ordered) - 1) // 2]

    base, ours, drained = median_run("mlx_lm"), median_run("macd"), median_run("macd_drained")
    swapping = ours if not args.swap_run else run_macd(
        model, tok, prompts, g, capacity, args.max_tokens, seed=0, swap_every_s=args.swap_every,
        drain_steps=args.drain_steps, endless=True,
    )
    return {
        "stop_tokens": len(stops), "prompt_tokens": [len(p) for p in prompts],
        "lengths_mlx_lm": lengths_note(base["lengths"], args.max_tokens),
        "lengths_macd": lengths_note(ours["lengths"], args.max_tokens),
        "tokens_mlx_lm": base["tokens"], "seconds_mlx_lm": base["seconds"],
        "tokens_macd": ours["tokens"], "seconds_macd": ours["seconds"],
        "tok_s_mlx_lm": tok_s["mlx_lm"]["median"], "tok_s_macd": tok_s["macd"]["median"],
        "ratio_vs_mlx_lm": ratio(tok_s["macd"]["median"], tok_s["mlx_lm"]["median"]),
        "ratio_vs_mlx_lm_median": ratio(tok_s["macd"]["median"], tok_s["mlx_lm"]["median"]),
        "ratio_drained_vs_mlx_lm_median": ratio(tok_s["macd_drained"]["median"], tok_s["mlx_lm"]["median"]),
        "tokens_per_step_ratio": ratio(per_step["macd"]["median"], per_step["mlx_lm"]["median"]),
        "tok_s_spread": tok_s, "tokens_per_step_spread": per_step, "rounds": args.rounds,
        "load_average_rounds": loads, "load_average_throughput": spread(loads),
        "tok_s_macd_drained": tok_s["macd_drained"]["median"], "lengths_macd_drained":
        lengths_note(drained["lengths"], args.max_tokens), "tokens_macd_drained": drained["tokens"],
        "seconds_macd_drained": drained["seconds"],
        "tok_s_macd_swapping": swapping["tokens"] / swapping["seconds"],
        "swapping_swaps": swapping["swaps"], "swapping_dropped_groups": swapping["dropped"],
        "swapping_tokens_dropped": swapping["sampled"] - swapping["tokens"],
        "swapping_lost_s_per_swap": (swapping["seconds"] - ours["seconds"] * swapping["tokens"] / ours["tokens"])
        / max(swapping["swaps"], 1),
        "swap_every": args.swap_every,
    }  # fmt: skip


# ------------------------------------------------------------------------- a worker per plane


async def _seed_bucket(bucket: Path, model_dir: Path, args: argparse.Namespace, plane: str) -> None:
    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.protocol.store import open_store
    from slime_stoa.quickstart.seeding import seed_run

    manifest = RunManifest(
        run="bench", model="random-qwen2", task="synthetic", group_size=args.bf16_group_size,
        max_tokens=args.bf16_max_tokens, temperature=TEMPERATURE,
        planes=() if plane == "bf16" else (plane,),  # type: ignore[arg-type]  # checked by parse_args
    )
    async with open_store(f"file://{bucket}") as store:
        await seed_run(store, manifest, model_dir, task_count=64)


async def _publish_while_serving(bucket: Path, model_dir: Path, swaps: int, child: subprocess.Popen,
                                 watch: StallWatch) -> int:
    """Publish a 1% patch each time the worker's heartbeat says it serves the latest version,
    `swaps` of them, and wait until it installed the last. Bounded by that work: `Incomplete`
    if the child exits first or its heartbeat stops moving for the stall limit."""
    import numpy as np

    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.hf.folders import load_hf_state
    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
    from slime_stoa.protocol.store import NotFound, open_store

    rng = np.random.default_rng(0)
    state = load_hf_state(model_dir)
    layout = RunLayout("bench")
    seen: tuple[Any, ...] = ()
    async with open_store(f"file://{bucket}") as store:

        async def beat() -> Heartbeat | None:
            """The worker's heartbeat, after checking the work can still finish."""
            nonlocal seen
            done = f"{published} of {swaps} versions published, v{version} the latest"
            if child.poll() is not None:
                raise Incomplete(f"{watch.what} exited with {child.returncode} ({done})")
            try:
                got = Heartbeat.from_bytes(await store.get_bytes(layout.heartbeat("bench-mac-000000")))
            except (NotFound, ValueError):
                got = None
            moved = () if got is None else (got.status, got.version, got.tokens_generated, got.swaps)
            if moved != seen:
                seen = moved
                watch.progressed()
            watch.check(done)
            return got

        pub = Publisher(store, "bench", PublisherConfig(extras_dir=model_dir))
        opened = await pub.open()
        require(opened is not None, "the seeded run has no published version")
        version, published = int(opened or 0), 0
        while published < swaps:
            await asyncio.sleep(0.25)
            got = await beat()
            if got is None or got.version != version or got.status not in ("generating", "waiting"):
                continue
            await asyncio.sleep(1.0)  # let it generate on this version for a while
            for bits in state.values():
                flat = bits.reshape(-1)
                at = np.flatnonzero(rng.random(flat.size) < 0.01)
                flat[at] ^= rng.integers(1, 8, size=at.size, dtype=np.uint16)
            version = (await pub.publish(state)).version
            published += 1
        while (got := await beat()) is None or got.version != version:  # until the last one is installed
            await asyncio.sleep(0.25)
        return published


def bench_plane_worker(model_dir: Path, args: argparse.Namespace, plane: str) -> dict[str, Any]:
    """A real worker serving `plane` (bf16, or a quantized plane the run publishes and the worker
    holds alone) in a child process while `args.swaps` versions are published."""
    with tempfile.TemporaryDirectory() as tmp:
        bucket, out, stop_file = Path(tmp) / "bucket", Path(tmp) / "child.json", Path(tmp) / "stop"
        bucket.mkdir()
        asyncio.run(_seed_bucket(bucket, model_dir, args, plane))
        spec = {"bucket": str(bucket), "data": str(Path(tmp) / "data"), "out": str(out), "stop": str(stop_file),
                "batch": args.bf16_prompts, "drain": args.drain_steps, "plane": plane}
        child = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)])
        on_signal_exit(child.kill)
        watch = StallWatch(f"the {plane} worker", args.stall_s)
        try:
            published = asyncio.run(_publish_while_serving(bucket, model_dir, args.swaps, child, watch))
            stop_file.touch()  # it stops at its next check, then measures a whole install
            code = _wait_child(child, watch)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        require(code == 0 and out.exists(), f"the {plane} worker exited with {code} after its {published} versions")
        result = json.loads(out.read_text())
    result["published"] = published
    swapped = len(result["swaps"])
    require(swapped >= published, f"the {plane} worker recorded {swapped} version changes of the {published} published")
    return result


def _wait_child(child: subprocess.Popen, watch: StallWatch) -> int:
    """The child's exit status, once it exits; `Incomplete` past the stall limit."""
    watch.progressed()
    while True:
        try:
            return child.wait(timeout=min(1.0, watch.left_s()) or 0.01)
        except subprocess.TimeoutExpired:
            watch.check("stopping after its last version")


async def _child_worker(spec: dict[str, Any]) -> None:
    """A plane's worker, in its own process so its memory is its own."""
    import mlx.core as mx
    import mlx_lm  # noqa: F401  # the runtime a worker has loaded before any weights

    from macd.config import DaemonConfig
    from macd.worker import Worker, WorkerOptions
    from slime_stoa.protocol.store import open_store

    mx.eval(mx.ones(8) @ mx.ones(8))
    baseline = _rss()

    config = DaemonConfig(store=f"file://{spec['bucket']}", run="bench", name="bench-mac", worker_id="bench-mac-000000",
                          data_dir=Path(spec["data"]), batch=spec["batch"], plane=spec["plane"])
    options = WorkerOptions(seed=0, heartbeat_s=0.25, weights_poll_s=0.1, swap_drain_steps=spec["drain"])
    async with open_store(config.store) as store:
        worker = Worker(config, store, options)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        rss, kv, copies, mlx_active, mlx_cache, samples = 0, 0, 0, 0, 0, []
        start = time.monotonic()
        while not Path(spec["stop"]).exists() and not run.done():
            await asyncio.sleep(0.25)
            if worker.groups_in_flight:
                now = _rss()
                rss = max(rss, now)
                kv = max(kv, await worker.mlx.run(lambda: worker._gen.cache_bytes if worker._gen else 0))
                copies = max(copies, await worker.mlx.run(lambda: worker.live.copy_nbytes if worker.live else 0))
                mlx_active, mlx_cache = max(mlx_active, mx.get_active_memory()), max(mlx_cache, mx.get_cache_memory())
                samples.append((round(time.monotonic() - start, 2), now - baseline, mx.get_active_memory(),
                                mx.get_cache_memory(), len(worker.swaps)))
        stop.set()
        await run
    live = worker.live
    if live is None or not live.state or not live.shares(live.state):  # its bits are the served memory: one copy
        raise SystemExit("the worker's served weights are not the bits it holds")
    state = live.state
    installs = []
    for _ in range(3):  # a whole version into MLX, from its own arrays
        copy = {name: bits.copy() for name, bits in state.items()}
        tic = time.perf_counter()
        live.install(copy)
        installs.append(time.perf_counter() - tic)
    mlx_install_s = sorted(installs)[1]
    master = sum(bits.nbytes for bits in state.values()) if live.master_apart else 0
    Path(spec["out"]).write_text(json.dumps({
        "plane": worker.weights.plane, "master_bytes": master,
        "rss_baseline_bytes": baseline, "rss_bytes": rss - baseline, "weight_bytes": live.nbytes, "kv_bytes": kv,
        "copy_bytes": copies,  # float32 copies the layers computed with (the installs below drop them)
        "mlx_install_s": mlx_install_s, "groups": worker.groups_recorded,
        "mlx_active_bytes": mlx_active, "mlx_cache_bytes": mlx_cache, "rss_samples": samples,
        "swaps": [asdict(r) for r in worker.swaps],
    }))


# ----------------------------------------------------- macd against transformers, a real model

# GSM8K-style word problems (from the GSM8K training set), asked with the GSM8K task's system prompt.
GSM8K_QUESTIONS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
    "she earn?",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
    "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How "
    "much more money does Betty need to buy the wallet?",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
)


def gsm8k_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """`n` GSM8K chat prompts (system prompt + question) through the tokenizer's chat template."""
    from slime_stoa.tasks.gsm8k import SYSTEM_PROMPT

    out = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": GSM8K_QUESTIONS[i % len(GSM8K_QUESTIONS)]}]
        out.append([int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True)])
    return out


class _MacdContender:
    """The worker's generation at its served settings: the model built from the folder's config,
    the bf16 master installed as a worker installs it (`macd.hf_layout.live_weights`: on the CPU
    device with a fast BLAS, float32 compute), groups decoded by `ContinuousGenerator` driven
    `STEPS_PER_CALL` steps a call. No stop token: every sequence runs to `max_tokens`."""

    def __init__(self, folder: Path) -> None:
        from macd import cpu_compute
        from macd.generate import build_model
        from macd.hf_layout import live_weights
        from slime_stoa.protocol.hf.folders import load_hf_state

        self.model, self.tok = build_model(folder)
        self.live = live_weights(self.model, dict(load_hf_state(folder)), "bf16")
        self.tok.eos_token_ids = []  # the same lengths as the other side's min = max new tokens
        self.info = {"blas": _blas_note(), "float32_compute": cpu_compute.computes_in_float32(self.model),
                     "weight_bytes": self.live.nbytes}

    def run(self, prompts: list[list[int]], group_size: int, new_tokens: int, seed: int, **_: Any) -> dict[str, Any]:
        from macd.generate import ContinuousGenerator, SamplingConfig

        cfg = SamplingConfig(temperature=TEMPERATURE, max_tokens=new_tokens, group_size=group_size, seed=seed)
        tic = time.perf_counter()
        gen = ContinuousGenerator(self.model, self.tok, cfg, max_batch=len(prompts) * group_size)
        for i, p in enumerate(prompts):
            gen.insert(p, i)
        finished: list[Any] = []
        while len(finished) < len(prompts):
            finished += gen.advance(STEPS_PER_CALL)[0]
        seconds = time.perf_counter() - tic
        gen.close()
        tokens = sum(len(c.tokens) for f in finished for c in f.completions)
        return {"tokens": tokens, "seconds": seconds, "copy_bytes": self.live.copy_nbytes}


class _HFContender:
    """transformers' own batched `generate` on torch's CPU: each prompt repeated G times (left
    padded), sampled at T with top-k and top-p off, min = max new tokens."""

    def __init__(self, folder: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        config = self.model.generation_config
        self.pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
        if isinstance(self.pad, list):
            self.pad = self.pad[0]
        self.info = {"torch": torch.__version__, "mkl": torch.backends.mkl.is_available()}

    def run(self, prompts: list[list[int]], group_size: int, new_tokens: int, seed: int, threads: int = 1,
            dtype: str = "bfloat16") -> dict[str, Any]:
        torch = self.torch
        torch.set_num_threads(threads)
        self.model.to(getattr(torch, dtype))  # bf16 -> float32 -> bf16 is exact: the same weights
        rows = [p for p in prompts for _ in range(group_size)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        torch.manual_seed(seed)
        tic = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                                      top_k=None, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.pad)
        seconds = time.perf_counter() - tic
        return {"tokens": int((out.shape[1] - width) * out.shape[0]), "seconds": seconds, "threads": threads,
                "dtype": dtype}


def serve_contender(kind: str, folder: Path | None) -> int:
    """A contender's process: load, say so, then run each JSON request read from stdin and answer
    with one JSON line on the original stdout (everything else the libraries print goes to stderr)."""
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if folder is None:
        raise SystemExit("--contender needs --model")
    contender: Any = _MacdContender(folder) if kind == "macd" else _HFContender(folder)
    answer.write(json.dumps({"ready": True, **contender.info, "rss_bytes": _rss()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if "prompts_for" in request:  # the macd side's tokenizer (mlx-lm's wrapper of the folder's)
            result: dict[str, Any] = {"prompts": gsm8k_prompts(contender.tok, request["prompts_for"])}
        else:
            result = {**contender.run(**request), "rss_bytes": _rss(), "load_average": load_average()}
        answer.write(json.dumps(result) + "\n")
    return 0


class _Contender:
    """The parent's handle on a contender's process: requests answered within the stall limit."""

    def __init__(self, kind: str, folder: Path, stall_s: float) -> None:
        self.kind = kind
        self.watch = StallWatch(f"the {kind} contender", stall_s)
        env = dict(os.environ)
        if _WORKER_COMPILE is None:  # as `macd run` computes: MLX's compile left on
            env.pop("MLX_DISABLE_COMPILE", None)
        self.proc = subprocess.Popen([sys.executable, __file__, "--contender", kind, "--model", str(folder)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        on_signal_exit(self.proc.kill)
        self.info = self._read()

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        """The contender's next answer: each one is progress, so the limit is per request."""
        import select

        assert self.proc.stdout is not None  # Popen(stdout=PIPE)
        self.watch.progressed()
        ready = select.select([self.proc.stdout], [], [], self.watch.left_s())[0]
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            if not ready:
                self.watch.check("no answer to its last request")
            raise Incomplete(f"the {self.kind} contender exited with {self.proc.returncode}")
        result: dict[str, Any] = json.loads(line)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def bench_vs_transformers(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """macd's generation against transformers' `generate` in interleaved rounds (module docstring)."""
    macd = _Contender("macd", folder, args.stall_s)
    hf = None
    try:
        hf = _Contender("hf", folder, args.stall_s)
        prompts = macd.ask(prompts_for=args.prompts)["prompts"]
        work = {"prompts": prompts, "group_size": args.group_size}
        warm = max(4, min(16, args.new_tokens))
        macd.ask(**work, new_tokens=warm, seed=99)  # warm-up: the float32 copies, allocator
        calibration = []
        for threads in [int(t) for t in args.hf_threads.split(",") if t]:
            for dtype in [d for d in args.hf_dtypes.split(",") if d]:
                hf.ask(**work, new_tokens=4, seed=99, threads=threads, dtype=dtype)  # warm-up
                got = hf.ask(**work, new_tokens=warm, seed=99, threads=threads, dtype=dtype)
                calibration.append({"threads": threads, "dtype": dtype, "tok_s": got["tokens"] / got["seconds"]})
                print(f"  transformers, {threads} thread(s), {dtype}: {calibration[-1]['tok_s']:.1f} tok/s "
                      f"({warm} new tokens, load {load_average():.1f})", flush=True)
        best = max(calibration, key=lambda c: c["tok_s"])
        setting = {"threads": best["threads"], "dtype": best["dtype"]}
        runs: dict[str, list[dict[str, Any]]] = {"macd": [], "transformers": []}
        for r in range(args.rounds):  # interleaved; both sides sample with the round's seed
            runs["macd"].append(macd.ask(**work, new_tokens=args.new_tokens, seed=r))
            runs["transformers"].append(hf.ask(**work, new_tokens=args.new_tokens, seed=r, **setting))
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{name} {x[-1]['tokens'] / x[-1]['seconds']:.1f} tok/s" for name, x in runs.items())
                + f" (load {load_average():.1f})", flush=True)
    finally:
        macd.close()
        if hf is not None:
            hf.close()
    expected = len(prompts) * args.group_size * args.new_tokens
    for name, rs in runs.items():
        require(all(x["tokens"] == expected for x in rs),
                f"{name} generated {[x['tokens'] for x in rs]} tokens, not {expected} each")
    tok_s = {name: spread([x["tokens"] / x["seconds"] for x in rs]) for name, rs in runs.items()}
    return {
        "model_folder_name": folder.name, "batch": len(prompts) * args.group_size, "prompts": len(prompts),
        "group_size": args.group_size, "new_tokens": args.new_tokens, "prompt_tokens": [len(p) for p in prompts],
        "rounds": args.rounds, "temperature": TEMPERATURE, "tok_s_spread": tok_s,
        "tok_s_macd": tok_s["macd"]["median"], "tok_s_transformers": tok_s["transformers"]["median"],
        "ratio_vs_transformers_median": ratio(tok_s["macd"]["median"], tok_s["transformers"]["median"]),
        "transformers_setting": setting, "transformers_calibration": calibration,
        "load_average_rounds": [x["load_average"] for rs in runs.values() for x in rs],
        "macd": {k: v for k, v in macd.info.items() if k != "ready"} | {
            "copy_bytes": runs["macd"][-1]["copy_bytes"], "rss_bytes": max(x["rss_bytes"] for x in runs["macd"])},
        "transformers": {k: v for k, v in hf.info.items() if k != "ready"} | {
            "rss_bytes": max(x["rss_bytes"] for x in runs["transformers"])},
    }  # fmt: skip


def main_vs_transformers(args: argparse.Namespace) -> int:
    session = Session()
    folder = args.model
    if folder is None:
        from slime_stoa.quickstart.real_model import RealModelUnavailable, smollm2_folder

        try:
            folder = smollm2_folder()
        except RealModelUnavailable as exc:
            print(f"error: {exc} (or pass --model)", file=sys.stderr)
            return 2
    print(f"macd vs transformers generate: {folder.name}, {args.prompts} GSM8K prompts x G={args.group_size} "
          f"(batch {args.prompts * args.group_size}), {args.new_tokens} new tokens each, T={TEMPERATURE}; "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load_average():.1f}", flush=True)
    with exit_on_signals():
        result = bench_vs_transformers(folder, args)
    m = result["macd"]
    print(f"macd: BLAS {m['blas']}; float32 compute: {m['float32_compute']}; weights {m['weight_bytes'] / 2**20:.0f} "
          f"MiB bf16 + {m['copy_bytes'] / 2**20:.0f} MiB float32 copies; RSS {m['rss_bytes'] / 2**20:.0f} MiB "
          f"(transformers: {result['transformers']['rss_bytes'] / 2**20:.0f} MiB)")
    setting = result["transformers_setting"]
    print_spreads(f"tok/s over {args.rounds} rounds (transformers at its fastest: {setting['threads']} thread(s), "
                  f"{setting['dtype']})", result["tok_s_spread"], unit="tok/s", digits=1)
    print(f"ratio of medians macd / transformers: {result['ratio_vs_transformers_median']:.2f}x (target >= 0.5)")
    session.print_load()
    result.update(session.meta())
    if args.json:
        write_json(args.json, result)
    return 0


# --------------------------------------------------------------------------------------- main


def _print_throughput(gen: dict[str, Any]) -> None:
    print(f"{'':22} {'tokens':>8} {'seconds':>8} {'tok/s':>8} {'mean len':>8} {'p10':>5} {'p50':>5} "
          f"{'p90':>5} {'at max':>6}")
    for name, key in (("mlx-lm batch_generate", "mlx_lm"), ("macd continuous", "macd"),
                      ("macd, to the last group", "macd_drained")):
        n = gen[f"lengths_{key}"]
        print(f"{name:22} {gen[f'tokens_{key}']:>8} {gen[f'seconds_{key}']:>8.1f} {gen[f'tok_s_{key}']:>8.0f} "
              f"{n['mean']:>8.1f} {n['p10']:>5.0f} {n['p50']:>5.0f} {n['p90']:>5.0f} {n['at_max_tokens']:>6.0%}")
    print("(the round with the median tok/s of each contender)")
    print_spreads("tok/s over the rounds", gen["tok_s_spread"], unit="tok/s", digits=1)
    print_spreads("tokens per decode step over the rounds", gen["tokens_per_step_spread"], unit="tokens", digits=2)
    load = gen["load_average_throughput"]
    print(f"tokens per decode step, macd / mlx-lm: {gen['tokens_per_step_ratio']:.2f}x (ratio of medians: the "
          f"batch kept full; what a step costs does not enter it)")
    print(f"wall tokens/s, macd / mlx-lm: {gen['ratio_vs_mlx_lm_median']:.2f}x (ratio of medians) at load "
          f"{load['min']:.1f}-{load['max']:.1f} during the rounds on {os.cpu_count()} CPUs; draining to the last "
          f"group (no prompt after the last, which a worker never sees): {gen['ratio_drained_vs_mlx_lm_median']:.2f}x")
    if not gen["swapping_swaps"]:
        return
    print(f"macd with a version change every ~{gen['swap_every']:.0f} s ({gen['swapping_swaps']} changes, "
          f"{gen['swapping_dropped_groups']} groups dropped, {gen['swapping_tokens_dropped']} tokens): "
          f"{gen['tok_s_macd_swapping']:.0f} tok/s of finished groups, "
          f"{gen['swapping_lost_s_per_swap']:.2f} s of generation lost per change")


def _print_worker(w: dict[str, Any]) -> None:
    total = w["weight_bytes"] + w["kv_bytes"]
    copies = f" + {w['copy_bytes'] / 2**20:.0f} MiB of float32 copies (CPU compute)" if w["copy_bytes"] else ""
    print(f"{w['plane']} worker: RSS {w['rss_bytes'] / 2**20:.0f} MiB over its runtime "
          f"({w['rss_baseline_bytes'] / 2**20:.0f} MiB after imports) for {w['weight_bytes'] / 2**20:.0f} MiB "
          f"of served weights{copies} + {w['kv_bytes'] / 2**20:.0f} MiB of KV cache: {w['rss_ratio']:.2f}x "
          f"(target <= 1.15x; two copies would be >= {(2 * w['weight_bytes'] + w['kv_bytes']) / total:.2f}x); "
          f"master apart from the served weights {w['master_bytes'] / 2**20:.0f} MiB; MLX held "
          f"{w['mlx_active_bytes'] / 2**20:.0f} MiB active + {w['mlx_cache_bytes'] / 2**20:.0f} MiB cached")
    print(f"{'version':>7} {'path':>7} {'ready s':>8} {'drain s':>8} {'pause s':>8} {'install s':>9} {'dropped':>7}")
    for r in w["swaps"]:
        print(f"{r['version']:>7} {r['path']:>7} {r['ready_s']:>8.3f} {r['drain_s']:>8.3f} {r['pause_s']:>8.3f} "
              f"{r['install_s']:>9.4f} {r['dropped']:>7}")
    delay = w["install_delay_s"]
    if delay["n"]:
        print(f"ready -> installed (drain + pause): median {delay['median']:.3f} s, max {delay['max']:.3f} s")
    print(f"swap stall (decoding paused per version change) {w['swap_stall_s']:.4f} s vs MLX install of a whole "
          f"version {w['mlx_install_s']:.3f} s (target: stall <= install)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 15M model and a smaller workload")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-fast-blas", "--no-openblas", action="store_true",
                        help="keep MLX's bundled BLAS (no macd.cpu_blas)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        default="float32" if sys.platform == "linux" else "bfloat16",
                        help="compute dtype of the throughput part (default: float32 on Linux)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the throughput contenders (default 3, "
                        "--quick 2)")
    parser.add_argument("--cohorts", type=int, default=3, help="cohorts of prompts (mlx-lm: one call each)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per cohort (B)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=192, help="longest response")
    parser.add_argument("--mean-tokens", type=float, default=60.0, help="mean response length the stop set aims at")
    parser.add_argument("--swap-every", type=float, help="seconds between version changes in the swapping "
                        "run (default 20, --quick 8)")
    parser.add_argument("--drain-steps", type=int, default=32, help="the worker's swap_drain_steps")
    parser.add_argument("--swaps", type=int, help="versions published to each plane's worker (default 3, --smoke 1)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the worker part (every plane)")
    parser.add_argument("--planes", default="bf16,int8,int4", help="planes the worker part serves, one worker "
                        "each (int8 and int4 as planes the run publishes, held alone); default bf16,int8,int4")
    parser.add_argument("--no-throughput", action="store_true", help="skip the throughput part")
    parser.add_argument("--swap-run", action="store_true", help="also time macd with version changes "
                        "every --swap-every seconds (the drop-and-restart policy's cost)")
    parser.add_argument("--stall-s", type=float, default=STALL_S, help="the run fails (exit 1) when a plane's "
                        "worker or a --vs-transformers contender shows no progress for this long (default "
                        f"{STALL_S:.0f}); the work itself is bounded by its size, not by time")
    parser.add_argument("--smoke", action="store_true", help="--quick cut to one cohort of short responses, one "
                        "round, and the bf16 worker with one version (the test's size)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    vs = parser.add_argument_group("--vs-transformers: macd on a real model against transformers' generate")
    vs.add_argument("--vs-transformers", action="store_true", help="only this comparison (see the docstring)")
    vs.add_argument("--model", type=Path, help="an HF model folder (default: SmolLM2-135M-Instruct, "
                    "slime_stoa.quickstart.real_model)")
    vs.add_argument("--new-tokens", type=int, help="tokens generated per sequence, no early stop (default 128, "
                    "--quick 32)")
    vs.add_argument("--hf-threads", default="1,2", help="torch thread counts tried; the fastest is timed")
    vs.add_argument("--hf-dtypes", default="bfloat16,float32", help="torch dtypes tried; the fastest is timed")
    parser.add_argument("--contender", choices=["macd", "hf"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.bf16_prompts, args.bf16_group_size, args.bf16_max_tokens = 2, 4, 16
    args.planes = [p for p in args.planes.split(",") if p]
    for plane in args.planes:
        if plane not in ("bf16", "int8", "int4"):
            parser.error(f"--planes: unknown plane {plane!r} (bf16, int8, int4)")
    if args.smoke:
        args.quick = True
        args.cohorts, args.max_tokens, args.mean_tokens = 1, 32, 12.0
        if args.planes == ["bf16", "int8", "int4"]:
            args.planes = ["bf16"]
    elif args.quick:
        args.cohorts, args.max_tokens, args.mean_tokens = 2, 128, 40.0
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 2 if args.quick else 3
    if args.swaps is None:
        args.swaps = 1 if args.smoke else 3
    if args.new_tokens is None:
        args.new_tokens = 32 if args.quick else 128
    if args.new_tokens < 1 or args.rounds < 1 or args.swaps < 1 or not args.stall_s > 0:
        parser.error("--new-tokens, --rounds and --swaps must be >= 1 and --stall-s > 0")
    if args.swap_every is None:
        args.swap_every = 8.0 if args.quick else 20.0
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as a script: a fast BLAS first, as a worker has
        argv = sys.argv[1:]
        _use_fast_blas(argv)
    args = parse_args(argv)
    return exit_code(lambda: run(args), "bench_worker")


def run(args: argparse.Namespace) -> int:
    if args.child:
        asyncio.run(_child_worker(json.loads(args.child)))
        return 0
    if args.contender:
        return serve_contender(args.contender, args.model)
    if args.vs_transformers:
        return main_vs_transformers(args)
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    from slime_stoa.quickstart.tiny_model import build_tiny_model

    size = QUICK_MODEL_SIZE if args.quick else MODEL_SIZE
    session = Session()
    with exit_on_signals(), tempfile.TemporaryDirectory() as tmp:
        on_signal_exit(lambda: shutil.rmtree(tmp, ignore_errors=True))
        path = build_tiny_model(Path(tmp) / "model", **size)
        model, tok = mlx_lm.load(str(path))
        n_params = sum(a.size for _, a in tree_flatten(model.parameters()))
        model.set_dtype(getattr(mx, args.dtype))
        print(f"model: random Qwen2 {size} ({n_params / 1e6:.1f}M parameters), throughput computed in {args.dtype}"
              f"{' (Linux CPUs have no fast bf16 matmul; a Mac runs bf16)' if args.dtype == 'float32' else ''}; "
              f"BLAS: {_blas_note()}; {platform.machine()}, {os.cpu_count()} CPUs, load average {load_average():.1f}")
        print(f"workload: {args.cohorts} cohorts of B={args.prompts} prompts x G={args.group_size}, "
              f"batch {args.prompts * args.group_size}, max_tokens={args.max_tokens}, stop set aiming at a mean of "
              f"{args.mean_tokens:.0f} tokens, T={TEMPERATURE}")
        gen: dict[str, Any] = {}
        if not args.no_throughput:
            gen = bench_throughput(model, tok, args)
            _print_throughput(gen)
        del model
        workers: dict[str, dict[str, Any]] = {}
        for plane in [] if args.no_bf16 else args.planes:
            print(f"{plane} worker: B={args.bf16_prompts} x G={args.bf16_group_size}, max_tokens={args.bf16_max_tokens}, "
                  f"{args.swaps} versions published while it generates ...", flush=True)
            w = workers[plane] = bench_plane_worker(path, args, plane)
            w["rss_ratio"] = w["rss_bytes"] / (w["weight_bytes"] + w["copy_bytes"] + w["kv_bytes"])
            w["swap_stall_s"] = spread([r["pause_s"] for r in w["swaps"]])["median"]  # >= 1 swap: bench_plane_worker
            w["install_delay_s"] = spread([r["drain_s"] + r["pause_s"] for r in w["swaps"]])
    for w in workers.values():
        _print_worker(w)
    session.print_load()
    result = {
        "quick": args.quick, "model": size, "params": n_params, "dtype": args.dtype, "blas": _blas_note(),
        **session.meta(), "load_average": load_average(), "cohorts": args.cohorts, "prompts": args.prompts, "group_size": args.group_size,
        "max_tokens": args.max_tokens, "mean_tokens_target": args.mean_tokens, "temperature": TEMPERATURE, **gen,
    }  # fmt: skip
    if workers:
        result["rss_over_served"] = {p: w["rss_ratio"] for p, w in workers.items()}
        result["master_bytes"] = {p: w["master_bytes"] for p, w in workers.items()}
        result["workers"] = {p: {k: w[k] for k in (
            "rss_bytes", "rss_baseline_bytes", "weight_bytes", "copy_bytes", "kv_bytes", "master_bytes", "rss_ratio", "swap_stall_s",
            "install_delay_s", "mlx_install_s", "mlx_active_bytes", "mlx_cache_bytes", "published", "rss_samples")} for p, w in workers.items()}
    bf16 = workers.get("bf16")
    if bf16 is not None:
        result.update({
            "rss_bytes": bf16["rss_bytes"], "weight_bytes": bf16["weight_bytes"], "kv_bytes": bf16["kv_bytes"],
            "rss_ratio": bf16["rss_ratio"], "rss_baseline_bytes": bf16["rss_baseline_bytes"],
            "swap_stall_s": bf16["swap_stall_s"], "mlx_install_s": bf16["mlx_install_s"], "bf16_swaps": bf16["swaps"],
            "install_delay_s": bf16["install_delay_s"],
            **({"install_delay_s_max": bf16["install_delay_s"]["max"]} if bf16["install_delay_s"]["n"] else {}),
            "bf16_rss_samples": bf16["rss_samples"], "bf16_mlx_active_bytes": bf16["mlx_active_bytes"],
            "bf16_mlx_cache_bytes": bf16["mlx_cache_bytes"],
        })  # fmt: skip
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
