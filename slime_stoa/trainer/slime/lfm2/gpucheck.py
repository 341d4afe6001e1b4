"""The LFM2 provider on one CUDA GPU, as slime runs it (TransformerEngine spec), against transformers.

    python -m slime_stoa.trainer.slime.lfm2.gpucheck --hf DIR [--json PATH]

on an LFM2 / LFM2-MoE folder (a tiny random one: `slime_stoa.quickstart.tiny_model`), in one
process (NCCL, world size 1). Checks, each reported as {"pass": bool, ...}:

- `te_fp32_vs_hf`: the model in float32 (TF32 off; SequentialMLP experts) loaded through
  `convert.hf_tensor_for`, logits vs transformers' float32 forward on the GPU;
- `names_round_trip`: its weights named by the publisher's converter (`hf_names.family_converter`)
  are exactly the folder's tensors (names, values; the expert biases fp32);
- `te_bf16_packed_vs_separate`: in bf16 with grouped experts and the alltoall dispatcher (the
  launch's setup), two sequences packed THD-style (`PackedSeqParams`, what slime feeds) give the
  logits each gives alone: the conv layers see no token of the other sequence;
- `train_step`: ten Adam steps on one batch lower the loss; the expert biases stay fp32 and
  unchanged (`--moe-router-bias-update-rate 0`).

Exit status 0 when every check passes, 1 otherwise. Needs CUDA, megatron-core and
TransformerEngine (slime's image).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

FP32_TOLERANCE = 1e-3  # float32 on both sides, different kernels
PACKED_TOLERANCE = 0.15  # bf16 logits of the same tokens, different batch layouts


def _init() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def _model(hf_cfg: dict[str, Any], state: dict[str, torch.Tensor], *, bf16: bool, grouped: bool) -> Any:
    from . import spec
    from .convert import Lfm2Shape

    overrides: dict[str, Any] = {"params_dtype": torch.bfloat16 if bf16 else torch.float32, "bf16": bf16,
                                 "use_cpu_initialization": False}
    if hf_cfg["model_type"] == "lfm2_moe":
        overrides.update(moe_grouped_gemm=grouped, moe_token_dispatcher_type="alltoall")
    config = spec.transformer_config(hf_cfg, **overrides)
    model = spec.build_model(config, hf_cfg, vocab_size=hf_cfg["vocab_size"], max_sequence_length=512, use_te=True)
    model = model.cuda()
    spec.load_hf_state(model, state, Lfm2Shape.from_hf(hf_cfg))
    return model


def check(folder: Path) -> dict[str, Any]:
    import transformers
    from megatron.core.packed_seq_params import PackedSeqParams
    from safetensors.torch import load_file

    from ..hf_names import family_converter
    from . import spec

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _init()
    hf_cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    state = load_file(str(folder / "model.safetensors"))
    out: dict[str, Any] = {"model_type": hf_cfg["model_type"]}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_cfg["vocab_size"], (2, 32), generator=gen).cuda()

    def run(name: str, fn: Any) -> None:
        started = time.monotonic()
        try:
            out[name] = fn()
        except Exception as exc:  # one failed check does not hide the others
            out[name] = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        out[name]["seconds"] = round(time.monotonic() - started, 2)

    def fp32() -> dict[str, Any]:
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        hf = hf.cuda().eval()
        model = _model(hf_cfg, state, bf16=False, grouped=False).eval()
        positions = torch.arange(32, device="cuda")[None].expand(2, 32)
        with torch.no_grad():
            diff = float((model(ids, positions, attention_mask=None) - hf(ids).logits).abs().max())
        convert = family_converter(hf_cfg)
        assert convert is not None
        weights = spec.named_weights(model)
        names = dict(convert([t.detach() for _, t in weights], [SimpleNamespace(name="module.module." + n) for n, _ in weights]))
        same = sorted(names) == sorted(state) and all(
            torch.equal(names[k].cpu().to(v.dtype), v) and (v.dtype != torch.float32 or names[k].dtype == torch.float32)
            for k, v in state.items()
        )
        out["names_round_trip"] = {"pass": same, "tensors": len(names)}
        return {"pass": diff <= FP32_TOLERANCE, "max_logit_diff": diff, "tolerance": FP32_TOLERANCE}

    def packed() -> dict[str, Any]:
        model = _model(hf_cfg, state, bf16=True, grouped=hf_cfg["model_type"] == "lfm2_moe").eval()
        a, b = ids[0, :20], ids[1, :12]
        cu = torch.tensor([0, 20, 32], dtype=torch.int32, device="cuda")
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=20, max_seqlen_kv=20)
        positions = torch.cat([torch.arange(20), torch.arange(12)]).cuda()[None]
        with torch.no_grad():
            together = model(torch.cat([a, b])[None], positions, attention_mask=None, packed_seq_params=params)[0]
            alone = torch.cat([
                model(x[None], torch.arange(len(x), device="cuda")[None], attention_mask=None)[0] for x in (a, b)
            ])
        diff = float((together.float() - alone.float()).abs().max())
        return {"pass": diff <= PACKED_TOLERANCE, "max_logit_diff": diff, "tolerance": PACKED_TOLERANCE}

    def train() -> dict[str, Any]:
        model = _model(hf_cfg, state, bf16=True, grouped=hf_cfg["model_type"] == "lfm2_moe").train()
        bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        positions = torch.arange(32, device="cuda")[None].expand(2, 32)
        losses = []
        for _ in range(10):
            optimizer.zero_grad()
            loss = model(ids, positions, attention_mask=None, labels=ids).float().mean()
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
        kept = all(b.dtype == torch.float32 and torch.equal(b, bias[n]) for n, b in model.named_buffers() if n in bias)
        return {"pass": losses[-1] < losses[0] and kept, "loss_first": losses[0], "loss_last": losses[-1],
                "expert_bias_fp32_unchanged": kept}

    run("te_fp32_vs_hf", fp32)
    run("te_bf16_packed_vs_separate", packed)
    run("train_step", train)
    out.setdefault("names_round_trip", {"pass": False, "error": "not reached (te_fp32_vs_hf failed first)"})
    checks = [v for v in out.values() if isinstance(v, dict)]
    out["pass"] = bool(checks) and all(v.get("pass") for v in checks)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the LFM2 provider on one CUDA GPU vs transformers")
    parser.add_argument("--hf", type=Path, required=True, help="an LFM2 / LFM2-MoE HF folder (tiny)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 1
    result = check(args.hf)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
