"""What a real pretrained model does to the numbers the trainer and the workers depend on.

On SmolLM2-135M-Instruct (built offline from its package, `slime_stoa.quickstart.real_model`) and
real GSM8K prompts:

1. **Logprob gap per plane.** Completions are sampled by the worker's generator (macd) on the bf16
   weights; each plane's worker model (bf16, the run's int8 and int4 planes as `PlaneWeights`
   serves them) then scores those same tokens (teacher-forced, one forward pass), and the CPU
   learner (torch, float32 compute on the bf16 weights) scores them too. Reported per plane: the
   mean, p99 and max of |learner - worker| per token, and each group's mean (what the trainer's
   quarantine is fed), against the quarantine's limit for that plane
   (`canary.max_logprob_gap` + the plane's allowance).
2. **PULSE at real learning rates.** From the same weights, AdamW RL steps (the learner's DPPO
   loss) at each learning rate; after each step the bf16 state is diffed against the previous one:
   the fraction of weights whose bf16 bits changed and the patch's bytes per changed element
   (`encode_patch`, as the publisher encodes a version).

Bounded by work (prompts, samples, tokens, steps); writes its figures as JSON (--json) and prints
a table. The numbers in docs/real-model.md come from one run of this script.

    python scripts/real_model_check.py --json real-model.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PLANES = ("bf16", "int8", "int4")
LRS = (1e-6, 3e-6, 1e-5)


def gsm8k_prompts(folder: Path, tokenizer: Any, count: int) -> tuple[Any, list[list[int]]]:
    from slime_stoa.tasks.gsm8k import GSM8K, load_gsm8k_jsonl
    from slime_stoa.tasks.prompting import prompt_tokens

    task = GSM8K(load_gsm8k_jsonl(folder / "test.jsonl", limit=count))
    return task, [prompt_tokens(tokenizer, task, item) for item in task.items]


def sample(model_dir: Path, prompts: list[list[int]], *, group: int, max_tokens: int, seed: int) -> list[list[Any]]:
    """Completions sampled by macd's generator on the bf16 weights."""
    from macd.generate import SamplingConfig, build_model, generate_groups
    from macd.hf_layout import live_weights
    from slime_stoa.protocol.hf.folders import load_hf_state

    model, tokenizer = build_model(model_dir)
    live_weights(model, dict(load_hf_state(model_dir)), "bf16")
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, group_size=group, seed=seed)
    return generate_groups(model, tokenizer, prompts, sampling)


def plane_logprobs(model_dir: Path, plane: str, prompts: list[list[int]], groups: list[list[Any]]) -> list[list[np.ndarray]]:
    """Each completion's logprobs under the worker model of `plane` (teacher-forced)."""
    from macd.generate import build_model, teacher_forced_logprobs
    from macd.hf_layout import live_weights
    from macd.plane_weights import PlaneWeights
    from slime_stoa.protocol.hf.folders import load_hf_state
    from slime_stoa.protocol.pulse.plane import plane_bits

    state = load_hf_state(model_dir)
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    model, _ = build_model(model_dir)
    if plane == "bf16":
        live_weights(model, dict(state), "bf16")
    else:
        PlaneWeights.from_state(model, dict(plane_bits(state, plane, model_type)), plane)  # type: ignore[arg-type]
    return [[teacher_forced_logprobs(model, p, c.tokens, 1.0) for c in g] for p, g in zip(prompts, groups, strict=True)]


def gap_figures(learner_lps: list[list[np.ndarray]], worker_lps: list[list[np.ndarray]], plane: str) -> dict[str, Any]:
    from slime_stoa.trainer.consumer.canary import CanaryConfig
    from slime_stoa.trainer.consumer.quarantine import QuarantineConfig

    per_token = np.concatenate([np.abs(a - b) for la, lw in zip(learner_lps, worker_lps, strict=True)
                                for a, b in zip(la, lw, strict=True)])
    group_means = [float(np.mean(np.concatenate([np.abs(a - b) for a, b in zip(la, lw, strict=True)])))
                   for la, lw in zip(learner_lps, worker_lps, strict=True)]
    limit = CanaryConfig().max_logprob_gap + QuarantineConfig().allowance(plane)
    return {
        "tokens": int(per_token.size), "mean": float(per_token.mean()), "p99": float(np.quantile(per_token, 0.99)),
        "max": float(per_token.max()), "largest_group_mean": max(group_means), "quarantine_limit": limit,
    }


def pulse_steps(model_dir: Path, prompts: list[list[int]], groups: list[list[Any]], rewards: list[list[float]],
                lr: float, steps: int) -> list[dict[str, float]]:
    """AdamW RL steps at `lr` from the model's weights; per step the changed fraction of bf16
    weights and the patch's bytes per changed element."""
    import torch

    from slime_stoa.protocol.pulse.frames import encode_patch
    from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence

    torch.manual_seed(0)
    learner = Learner(model_dir, LearnerConfig(lr=lr, temperature=1.0))
    batch = [[TrainSequence(prompt=np.asarray(p), response=np.asarray(c.tokens), worker_logprobs=c.logprobs, reward=r)
              for c, r in zip(g, rs, strict=True)] for p, g, rs in zip(prompts, groups, rewards, strict=True)]
    before = learner.bf16_state()
    elements = sum(a.size for a in before.values())
    out = []
    for _ in range(steps):
        learner.step(batch)
        after = learner.bf16_state()
        changed = sum(int(np.count_nonzero(after[n] != before[n])) for n in after)
        index, body = encode_patch(before, after)
        patch = len(body) + len(index.to_bytes())  # the frames and their index, as a version ships them
        out.append({"changed_frac": changed / elements, "changed": changed, "patch_bytes": patch,
                    "bits_per_changed": 8 * patch / max(changed, 1)})
        before = after
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", type=Path, default=Path(os.environ.get("STOA_GSM8K_DIR", Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")),
                        help="folder with GSM8K's test.jsonl ($STOA_GSM8K_DIR)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2, help="RL steps per learning rate")
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--planes", nargs="+", default=list(PLANES), choices=PLANES)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from macd.cpu_blas import use_fast_blas

    print(f"MLX's BLAS: {use_fast_blas()}", flush=True)  # before MLX loads: the worker's own choice
    import torch

    from slime_stoa.quickstart.real_model import RealModelUnavailable, smollm2_folder
    from slime_stoa.trainer.learner import Learner, LearnerConfig, TrainSequence

    torch.set_num_threads(1)
    started = time.time()
    load_before = os.getloadavg()
    try:
        model_dir = smollm2_folder()
    except RealModelUnavailable as exc:
        print(f"real_model_check: {exc}", file=sys.stderr)
        return 2
    if not (args.gsm8k / "test.jsonl").is_file():
        print(f"real_model_check: no GSM8K test split at {args.gsm8k / 'test.jsonl'} (--gsm8k DIR)", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    task, prompts = gsm8k_prompts(args.gsm8k, AutoTokenizer.from_pretrained(model_dir), args.prompts)
    print(f"sampling {args.prompts} x {args.group} completions of up to {args.max_tokens} tokens (bf16 worker)", flush=True)
    groups = sample(model_dir, prompts, group=args.group, max_tokens=args.max_tokens, seed=args.seed)
    # the steps' reward: GSM8K's, plus small bonuses for the answer line the system prompt asks
    # for and for working with numbers at all, so that groups whose samples all miss the answer
    # still carry a signal within a few tokens (Adam's step size hardly depends on the reward's scale)
    rewards = [[task.reward(c.text, item.label) + 0.5 * ("####" in c.text) + 0.25 * any(ch.isdigit() for ch in c.text)
                for c in g] for g, item in zip(groups, task.items, strict=True)]
    if args.lrs and all(len(set(rs)) == 1 for rs in rewards):
        # GRPO's advantage is zero in a group of equal rewards: the steps would measure nothing
        print("real_model_check: no group has unequal rewards, so RL steps change nothing: "
              "raise --max-tokens or --prompts", file=sys.stderr)
        return 1
    learner = Learner(model_dir, LearnerConfig(temperature=1.0))
    learner_lps = [learner.logprobs([TrainSequence(prompt=np.asarray(p), response=np.asarray(c.tokens),
                                                   worker_logprobs=c.logprobs, reward=0.0) for c in g])
                   for p, g in zip(prompts, groups, strict=True)]
    del learner
    result: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bf16 from the packaged Q4_1 GGUF)", "prompts": args.prompts,
        "group": args.group, "max_tokens": args.max_tokens, "tokens": int(sum(len(c.tokens) for g in groups for c in g)),
        "finish_stop": sum(c.finish_reason == "stop" for g in groups for c in g),
        "sampled_gap": {"bf16": gap_figures(learner_lps, [[c.logprobs for c in g] for g in groups], "bf16")},
        "planes": {}, "pulse": {},
    }
    print(f"{'plane':>6} {'mean':>8} {'p99':>8} {'max':>8} {'group max':>10} {'limit':>6}")
    for plane in args.planes:
        print(f"scoring the completions on the {plane} plane", flush=True)
        figures = gap_figures(learner_lps, plane_logprobs(model_dir, plane, prompts, groups), plane)
        result["planes"][plane] = figures
        print(f"{plane:>6} {figures['mean']:8.4f} {figures['p99']:8.4f} {figures['max']:8.4f} "
              f"{figures['largest_group_mean']:10.4f} {figures['quarantine_limit']:6.2f}", flush=True)
    for lr in args.lrs:
        print(f"{args.steps} AdamW RL step(s) at lr {lr:g}", flush=True)
        result["pulse"][f"{lr:g}"] = steps = pulse_steps(model_dir, prompts, groups, rewards, lr, args.steps)
        for i, s in enumerate(steps, 1):
            print(f"  step {i}: changed {s['changed_frac']:.2%} of bf16 weights, {s['bits_per_changed']:.1f} bits per "
                  f"changed element ({s['patch_bytes'] / 1e6:.2f} MB)", flush=True)
    result.update(seconds=time.time() - started, load_before=load_before, load_after=os.getloadavg(),
                  date=time.strftime("%Y-%m-%d"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
