"""The LFM2 / LFM2-MoE Megatron model: slime's `--custom-model-provider-path` target.

    --custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider

A GPTModel whose layers are Megatron's GPT layers (TransformerEngine spec when slime runs with
it, the local spec otherwise), changed where LFM2 differs:

- conv layers: the `self_attention` slot holds `conv.ShortConvMixer` (the gated short
  convolution), with its own input norm (`input_layernorm`: the TE spec fuses the attention
  layers' norm into linear_qkv and has none of its own);
- attention layers: Megatron's GQA attention with q/k RMSNorms (`--qk-layernorm`), rotary
  embeddings on the whole head (`rotate_half` style, `--rotary-base` = rope_theta);
- the first `num_dense_layers` layers a dense SwiGLU MLP (`--moe-layer-freq`), the others a
  `num_experts` MoE whose router is `Lfm2Router`: transformers' routing (`moe.lfm2_topk`), the
  fp32 `expert_bias` buffer selecting only;
- the final norm is HF's `model.embedding_norm`; the output head is tied to the embedding.

Parallelism: TP must be 1 (the conv layers are not tensor-parallel; LFM2.5-8B-A1B fits one
GPU), context parallelism 1; experts shard over EP (`--expert-model-parallel-size`, dividing
`num_experts`); pipeline stages split the layers as for any GPT model. `check_args` says so
before anything is built.

Dense MLP width: slime's `--ffn-hidden-size` is the HF config's `intermediate_size` (slime's
start-up check compares the two); the provider builds the width transformers' `Lfm2MLP` builds
from it (`flags.model_ffn_size`), which differs for dense LFM2 with `block_auto_adjust_ff_dim`.

Importing this module registers `convert.hf_tensor_for` as slime's HF loader for `lfm2` and
`lfm2_moe` (`slime.backends.megatron_utils.hf_to_megatron._LOADERS`) when slime is importable,
so slime's `tools/convert_hf_to_torch_dist.py` (given `--custom-model-provider-path`) reads LFM2
folders into the `torch_dist` checkpoint the launch takes as `--ref-load`.
Needs megatron-core (0.16).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from .conv import ShortConvMixer
from .convert import Lfm2Shape, hf_tensor_for
from .flags import _get, dense_ffn_size, model_ffn_size, rope_theta, tie_word_embeddings
from .moe import dense_routing, lfm2_topk


def transformer_config(hf: Mapping[str, Any] | Any, **overrides: Any) -> TransformerConfig:
    """Megatron's TransformerConfig for an LFM2 HF config (what `slime_model_args` gives slime),
    for building the model outside slime (tests, checks); `overrides` win."""
    shape = Lfm2Shape.from_hf(hf)
    kw: dict[str, Any] = {
        "num_layers": len(shape.layer_types), "hidden_size": shape.hidden_size,
        "ffn_hidden_size": dense_ffn_size(hf), "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads, "kv_channels": shape.head_dim, "qk_layernorm": True,
        "normalization": "RMSNorm", "layernorm_epsilon": float(_get(hf, "norm_eps", 1e-5)),
        "gated_linear_unit": True, "activation_func": torch.nn.functional.silu, "add_bias_linear": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "bias_activation_fusion": False,
        "apply_rope_fusion": False, "masked_softmax_fusion": False, "gradient_accumulation_fusion": False,
        "persist_layer_norm": False, "bias_dropout_fusion": False,
    }
    if shape.moe:
        kw.update({
            "num_moe_experts": shape.num_experts, "moe_ffn_hidden_size": int(_get(hf, "moe_intermediate_size")),
            "moe_router_topk": int(_get(hf, "num_experts_per_tok")),
            "moe_layer_freq": [0] * shape.num_dense_layers + [1] * (len(shape.layer_types) - shape.num_dense_layers),
            "moe_router_score_function": "sigmoid",
            "moe_router_topk_scaling_factor": float(_get(hf, "routed_scaling_factor", 1.0) or 1.0),
            "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0,
            "moe_router_enable_expert_bias": bool(_get(hf, "use_expert_bias", True)),
            "moe_router_bias_update_rate": 0.0, "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
        })
    kw.update(overrides)
    return TransformerConfig(**kw)


class Lfm2Router(TopKRouter):
    """Megatron's TopKRouter with transformers' LFM2-MoE routing (`moe.lfm2_topk`): the same
    gating weight (`weight`) and fp32 `expert_bias` buffer, the same outputs (probs, routing
    map). Megatron's expert-bias update runs as configured (`--moe-router-bias-update-rate`; the
    recipe sets 0: the bias stays the checkpoint's). On a machine without CUDA its buffers live
    on the CPU."""

    def __init__(self, config: TransformerConfig, pg_collection: Any = None, *, norm_topk_prob: bool = True) -> None:
        cpu = not torch.cuda.is_available() and config.moe_router_enable_expert_bias
        if cpu:  # TopKRouter allocates its bias buffers on the current CUDA device
            plain = copy.copy(config)
            plain.moe_router_enable_expert_bias = False
            super().__init__(config=plain, pg_collection=pg_collection)
            self.config = config
            self.enable_expert_bias = True
            zeros = torch.zeros(config.num_moe_experts, dtype=torch.float32)
            del self.local_tokens_per_expert, self.expert_bias  # the plain attributes (None) TopKRouter set
            self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
            self.register_buffer("expert_bias", zeros.clone())
        else:
            super().__init__(config=config, pg_collection=pg_collection)
        self.norm_topk_prob = norm_topk_prob

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """transformers' router logits, `F.linear(hidden, weight)` in the hidden states' dtype
        (fp32/fp64 with `--moe-router-dtype`); Megatron's own gating needs TransformerEngine."""
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype or "", input.dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype))

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        weights, selected = lfm2_topk(
            logits, self.expert_bias, self.topk, norm_topk_prob=self.norm_topk_prob,
            scaling=float(self.config.moe_router_topk_scaling_factor or 1.0),
        )
        probs, routing_map = dense_routing(weights, selected, self.config.num_moe_experts)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map


def check_parallelism(config: TransformerConfig) -> None:
    """ValueError unless the parallel layout is one this model supports (see the module doc)."""
    if config.tensor_model_parallel_size != 1:
        raise ValueError(f"LFM2: tensor parallelism must be 1 (the conv layers are replicated), got {config.tensor_model_parallel_size}")
    if config.context_parallel_size != 1:
        raise ValueError(f"LFM2: context parallelism must be 1, got {config.context_parallel_size}")
    experts, ep = config.num_moe_experts, config.expert_model_parallel_size
    if experts and experts % ep:
        raise ValueError(f"LFM2-MoE: --expert-model-parallel-size {ep} must divide num_experts {experts}")


def layer_spec(
    config: TransformerConfig, hf: Mapping[str, Any] | Any, *, use_te: bool, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The block spec of this pipeline stage: Megatron's GPT layers, conv mixers in the conv
    layers, `Lfm2Router` in the MoE layers."""
    shape = Lfm2Shape.from_hf(hf)
    if config.num_layers != len(shape.layer_types):
        raise ValueError(f"--num-layers {config.num_layers} but the HF config has {len(shape.layer_types)} layers")
    if shape.moe and list(config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else []) != (
        [0] * shape.num_dense_layers + [1] * (len(shape.layer_types) - shape.num_dense_layers)
    ):
        raise ValueError(f"--moe-layer-freq must make the first {shape.num_dense_layers} layers dense, the rest MoE")
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=use_te)
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm as norm
    else:
        from megatron.core.models.gpt.gpt_layer_specs import LNImpl as norm
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    conv_kernel = int(_get(hf, "conv_L_cache", 3))
    router = functools.partial(Lfm2Router, norm_topk_prob=bool(_get(hf, "norm_topk_prob", True)))
    local = []
    for layer in range(offset, offset + count):
        spec = copy.deepcopy(specs[layer])
        if shape.layer_types[layer] == "conv":
            spec.submodules.self_attention = ModuleSpec(module=ShortConvMixer, params={"conv_kernel": conv_kernel})
            spec.submodules.input_layernorm = norm
        if shape.is_moe_layer(layer):
            spec.submodules.mlp.submodules.router = router
        local.append(spec)
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=norm)


def build_model(
    config: TransformerConfig, hf: Mapping[str, Any] | Any, *, vocab_size: int, max_sequence_length: int,
    pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None, use_te: bool = False,
) -> GPTModel:
    """The GPTModel for `hf` under `config` (what `provider` builds from slime's args)."""
    check_parallelism(config)
    kwargs: dict[str, Any] = {}
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, hf, use_te=use_te, vp_stage=vp_stage),
        vocab_size=vocab_size, max_sequence_length=max_sequence_length, pre_process=pre_process,
        post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=tie_word_embeddings(hf),
        position_embedding_type="rope", rotary_base=int(rope_theta(hf)), **kwargs,
    )


def provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> GPTModel:
    """slime's custom model provider: the model for slime's args and `--hf-checkpoint` config,
    its dense MLP as wide as transformers builds it (`flags.model_ffn_size`)."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    hf = json.loads((Path(args.hf_checkpoint) / "config.json").read_text(encoding="utf-8"))
    config = core_transformer_config_from_args(args)
    config.ffn_hidden_size = model_ffn_size(int(config.ffn_hidden_size), hf)
    return build_model(
        config, hf, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
        use_te=args.transformer_impl == "transformer_engine",
    )


def acted_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the trainer acts with for Megatron tensor `name`: the expert bias rounded to bf16 and
    kept in its fp32 dtype, since the weight plane carries bf16 only and the workers route with that
    bf16 bias (never trained in RL, so both halves then select the same experts); any other tensor
    as it is."""
    if name.endswith("mlp.router.expert_bias"):
        return tensor.to(torch.bfloat16).to(tensor.dtype)
    return tensor


def slime_loader(name: str, reader: Any, config: Any) -> Any:
    """slime's HF-loader signature (`hf_to_megatron._LOADERS`) over `convert.hf_tensor_for`, the
    expert bias as the workers get it (`acted_tensor`)."""
    return acted_tensor(name, hf_tensor_for(name, reader.get_tensor, Lfm2Shape.from_hf(config)))


def register_with_slime() -> bool:
    """Make slime's HF loader read LFM2 folders; False when slime is not importable."""
    try:
        from slime.backends.megatron_utils import hf_to_megatron
    except ImportError:
        return False
    for model_type in ("lfm2", "lfm2_moe"):
        hf_to_megatron._LOADERS.setdefault(model_type, slime_loader)
    return True


register_with_slime()


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and expert-bias buffers by name (experts by local index: the
    global one at expert parallelism 1), as slime gathers them."""
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    named += [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")]
    return named


def load_hf_state(model: torch.nn.Module, hf: Mapping[str, torch.Tensor], shape: Lfm2Shape) -> None:
    """Copy an HF state into a Megatron LFM2 model at parallelism 1 (`convert.hf_tensor_for` per
    parameter, cast to the parameter's dtype; the expert biases stay fp32, holding their bf16
    rounding: `acted_tensor`)."""
    with torch.no_grad():
        for name, target in named_weights(model):
            tensor = acted_tensor(name, hf_tensor_for(name, hf.__getitem__, shape))
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{name}: HF shape {tuple(tensor.shape)}, Megatron {tuple(target.shape)}")
            target.copy_(tensor.to(dtype=target.dtype))
