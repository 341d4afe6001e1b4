"""Check one model family end to end on a tiny random model, on the CPU.

    python scripts/check_model_family.py --family {qwen2,llama,lfm2,lfm2_moe} [--json PATH]

Builds the family's tiny random HF folder (`slime_stoa.quickstart.tiny_model.build_tiny_family`),
loads it the MLX worker's way (`macd.generate.load_model`, which applies `macd.lfm2_fixes` where
the installed mlx-lm needs them) and with transformers, both in float32, and measures (absolute
differences of tempered logprobs, in nats, unless named otherwise):

  mlx_vs_torch_max_logprob_diff_f32         the worker's recorded logprobs (batched generation)
                                            vs transformers' forward over prompt + response
  mlx_padded_vs_single_max_logprob_diff_f32 prompts of different lengths generated together
                                            (mlx-lm's BatchGenerator: right-padded prefill,
                                            left-padded decode) and one left-padded prefill,
                                            vs each sequence alone
  mlx_episode_vs_full_prefix_max_logprob_diff_f32
                                            tool episodes resumed after each observation vs a
                                            fresh forward over the whole prefix (model tokens)
  moe_routing_vs_hf_max_weight_diff_f32     (MoE) the MLX router's top-k weights vs transformers'
  moe_selection_mismatch_fraction           (MoE) tokens whose expert set differs from theirs
  hf_megatron_hf_max_abs_diff               (LFM2) HF -> Megatron -> HF through
                                            `slime_stoa.trainer.slime.lfm2.convert`, every tensor
                                            (expected 0.0; a changed dtype counts as inf)
  megatron_forward                          (LFM2) "ran": the provider's GPTModel
                                            (`lfm2.spec`, megatron-core on the CPU, float32),
                                            or why not ("megatron-core not installed", ...)
  megatron_vs_hf_max_logit_diff_f32         its logits vs transformers' on the same weights;
                                            null where Megatron did not run

`pass` is true when every measured difference is within its tolerance (`tolerances`); the exit
status is 0 then, 1 otherwise. For qwen2 and llama the Megatron fields stay null with their
reason (slime converts and builds those families itself); they never count as a pass.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mlx.core as mx
import numpy as np

from macd.episodes import run_episodes
from macd.generate import SamplingConfig, generate_groups, load_model, teacher_forced_logprobs
from macd.lfm2_fixes import routed_call, routing
from slime_stoa.quickstart.tiny_model import FAMILIES, build_tiny_family
from slime_stoa.tasks.tool_format import ToolFormat
from slime_stoa.tasks.tools import LookupTool

TOLERANCES = {
    # float32 on both sides, different kernels: measured <= 1.2e-5 on the LFM2 tiny models
    "mlx_vs_torch_max_logprob_diff_f32": 1e-4,
    # the same MLX float32 ops on the same rows: measured 0 on CPU
    "mlx_padded_vs_single_max_logprob_diff_f32": 1e-5,
    "mlx_episode_vs_full_prefix_max_logprob_diff_f32": 1e-5,
    "moe_routing_vs_hf_max_weight_diff_f32": 1e-6,
    "moe_selection_mismatch_fraction": 0.0,
    "hf_megatron_hf_max_abs_diff": 0.0,
    # float32 on both sides, Megatron's kernels vs transformers': measured <= 7.2e-6 on the LFM2 tiny models
    "megatron_vs_hf_max_logit_diff_f32": 1e-4,
}
#: null (with its reason) where there is nothing to measure: a family without a stoa Megatron
#: model, or no megatron-core installed; a failure to run is reported in `errors`.
UNMEASURED_OK = frozenset({"hf_megatron_hf_max_abs_diff", "megatron_vs_hf_max_logit_diff_f32"})
FORMAT = ToolFormat(call_open="<q>", call_close="e", answer_close="<|im_start|>", observation_open="[",
                    observation_close="]", max_turns=3, max_observation_tokens=6)


def _prompts(tok: Any) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}],
                                   add_generation_prompt=True)
    return [list(tok.encode("7 + 5 =")), list(chat), list(tok.encode("The answer is 12 and the sum is"))]


def _hf_logprobs(hf: Any, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1 :]
    picked = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return picked.numpy()


def _max_diff(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    return max((float(np.abs(a - b).max()) for a, b in pairs if len(a)), default=0.0)


def _left_padded_diff(model: Any, prompts: list[list[int]]) -> float:
    """Each prompt's logprobs from one left-padded forward (mlx-lm's batch caches carrying the
    padding) vs the prompt alone."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

    n = max(len(p) for p in prompts)
    pad = [n - len(p) for p in prompts]
    cache = [BatchKVCache(pad) if isinstance(c, KVCache) else ArraysCache(1, left_padding=pad) for c in make_prompt_cache(model)]
    logits = model(mx.array([[0] * k + p for k, p in zip(pad, prompts, strict=True)]), cache=cache)
    pairs = []
    for i, (k, p) in enumerate(zip(pad, prompts, strict=True)):
        alone = model(mx.array([p]))[0]
        pairs.append((np.array(_log_softmax(logits[i, k:])), np.array(_log_softmax(alone))))
    return _max_diff(pairs)


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _moe_routing(model: Any, hf: Any, config: dict[str, Any]) -> tuple[float, float]:
    import torch

    layer = config["num_dense_layers"]
    block, hf_block = model.layers[layer].feed_forward, hf.model.layers[layer].feed_forward
    x = np.random.default_rng(1).normal(size=(512, config["hidden_size"])).astype(np.float32)
    inds, weights = routing(block.gate(mx.array(x)), block.expert_bias, block.top_k, block.norm_topk_prob,
                            float(getattr(block, "routed_scaling_factor", 1.0)))
    with torch.no_grad():
        _, hf_weights, hf_inds = hf_block.gate(torch.tensor(x), hf_block.expert_bias)
    i, w = np.array(inds), np.array(weights)
    o = np.argsort(i, -1)
    i, w = np.take_along_axis(i, o, -1), np.take_along_axis(w, o, -1)
    hi, hw = hf_inds.numpy(), hf_weights.numpy()
    ho = np.argsort(hi, -1)
    hi, hw = np.take_along_axis(hi, ho, -1), np.take_along_axis(hw, ho, -1)
    same = (i == hi).all(-1)
    return float(np.abs(w - hw)[same].max()), float(1.0 - same.mean())


def _megatron_checks(folder: Path, hf: Any, config: dict[str, Any], errors: dict[str, str]) -> dict[str, Any]:
    """The Megatron fields (see the module doc) for an LFM2 folder; null with a reason otherwise."""
    if config["model_type"] not in ("lfm2", "lfm2_moe"):
        reason = f"no stoa Megatron model for {config['model_type']} (slime's own family)"
        return {"hf_megatron_hf_max_abs_diff": None, "hf_megatron_hf_reason": reason,
                "megatron_forward": reason, "megatron_vs_hf_max_logit_diff_f32": None}
    import torch
    from safetensors.torch import load_file

    from slime_stoa.trainer.slime.lfm2.convert import Lfm2Shape, hf_to_megatron, megatron_to_hf

    out: dict[str, Any] = {"megatron_vs_hf_max_logit_diff_f32": None}
    shape = Lfm2Shape.from_hf(config)
    state = load_file(str(folder / "model.safetensors"))
    worst = 0.0
    for layout in ("te", "local"):
        back = megatron_to_hf(hf_to_megatron(state, shape, layout), shape)
        for name, tensor in state.items():
            got = back.get(name)
            if got is None or got.dtype != tensor.dtype:
                worst = float("inf")
            else:
                worst = max(worst, float((got.float() - tensor.float()).abs().max()))
    out["hf_megatron_hf_max_abs_diff"] = worst
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        out["megatron_forward"] = "megatron-core not installed"
        return out
    try:
        from slime_stoa.trainer.slime.lfm2 import spec
        from slime_stoa.trainer.slime.lfm2.cpu import causal_mask, megatron_on_cpu

        ids = torch.randint(0, config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
        with megatron_on_cpu():
            mconfig = spec.transformer_config(config, use_cpu_initialization=True, params_dtype=torch.float32,
                                              moe_token_dispatcher_type="allgather")
            model = spec.build_model(mconfig, config, vocab_size=config["vocab_size"], max_sequence_length=256)
            spec.load_hf_state(model, state, shape)
            model.eval()
            with torch.no_grad():
                logits = model(ids, torch.arange(24)[None].expand(2, 24), attention_mask=causal_mask(24))
                want = hf(ids).logits
        out["megatron_forward"] = "ran"
        out["megatron_vs_hf_max_logit_diff_f32"] = float((logits - want).abs().max())
    except Exception as exc:  # the reason is the field's value
        out["megatron_forward"] = f"failed: {type(exc).__name__}: {exc}"
        errors["megatron_forward"] = out["megatron_forward"]
    return out


def check(family: str, folder: Path) -> dict[str, Any]:
    import torch
    import transformers

    started = time.monotonic()
    build_tiny_family(folder, family)
    config = json.loads((folder / "config.json").read_text())
    model, tok = load_model(folder)
    model.set_dtype(mx.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = _prompts(tok)
    out: dict[str, Any] = {
        "family": family,
        "model_type": config["model_type"],
        "layer_types": config.get("layer_types"),
        "mlx_lm_version": importlib.metadata.version("mlx-lm"),
        "transformers_version": transformers.__version__,
        "mlx_fixes_applied": ["lfm2_moe routing"] if any(
            type(getattr(layer, "feed_forward", None)).__call__ is routed_call for layer in model.layers) else [],
    }
    errors: dict[str, str] = {}

    def measure(key: str, fn: Any) -> None:
        try:
            out[key] = fn()
        except Exception as exc:  # a broken check is reported, not a crash of the others
            out[key] = None
            errors[key] = f"{type(exc).__name__}: {exc}"

    def vs_torch() -> float:
        cfg = SamplingConfig(temperature=0.7, max_tokens=24, group_size=2, seed=4)
        groups = generate_groups(model, tok, prompts, cfg)
        return _max_diff([(c.logprobs, _hf_logprobs(hf, p, c.tokens.tolist(), cfg.temperature))
                          for p, g in zip(prompts, groups, strict=True) for c in g])

    def padded() -> float:
        cfg = SamplingConfig(temperature=0.8, max_tokens=16, group_size=2, seed=7)
        worst = _left_padded_diff(model, prompts)
        for share in (False, True):
            groups = generate_groups(model, tok, prompts, cfg, share_prefill=share, max_batch=4)
            worst = max(worst, _max_diff([(c.logprobs, teacher_forced_logprobs(model, p, c.tokens, cfg.temperature))
                                          for p, g in zip(prompts, groups, strict=True) for c in g]))
        return worst

    def episodes() -> float:
        cfg = SamplingConfig(temperature=1.0, max_tokens=40, group_size=3, seed=3)
        tool = LookupTool({}, default="look: the answer is 12")
        groups = asyncio.run(run_episodes(model, tok, prompts[:2], cfg, FORMAT, tool, max_batch=4))
        out["episode_tool_calls"] = sum(c.tool_calls for g in groups for c in g)
        pairs = []
        for p, g in zip(prompts[:2], groups, strict=True):
            for c in g:
                own = c.mask == 1
                pairs.append((c.logprobs[own], teacher_forced_logprobs(model, p, c.tokens, cfg.temperature)[own]))
        return _max_diff(pairs)

    measure("mlx_vs_torch_max_logprob_diff_f32", vs_torch)
    measure("mlx_padded_vs_single_max_logprob_diff_f32", padded)
    measure("mlx_episode_vs_full_prefix_max_logprob_diff_f32", episodes)
    if config["model_type"] == "lfm2_moe":
        try:
            weight_diff, mismatch = _moe_routing(model, hf, config)
            out["moe_routing_vs_hf_max_weight_diff_f32"] = weight_diff
            out["moe_selection_mismatch_fraction"] = mismatch
        except Exception as exc:
            errors["moe_routing"] = f"{type(exc).__name__}: {exc}"
    out.update(_megatron_checks(folder, hf, config, errors))
    out.update({
        "tolerances": {k: v for k, v in TOLERANCES.items() if k in out and not (k in UNMEASURED_OK and out[k] is None)},
        "errors": errors,
    })
    within = all(out[k] is not None and out[k] <= v for k, v in out["tolerances"].items())
    out["pass"] = within and not errors
    out["seconds"] = round(time.monotonic() - started, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=FAMILIES)
    parser.add_argument("--json", type=Path, help="write the results here (as well as to stdout)")
    parser.add_argument("--folder", type=Path, help="build the tiny model here (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = check(args.family, args.folder or Path(tmp) / args.family)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
