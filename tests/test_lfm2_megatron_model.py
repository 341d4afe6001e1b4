"""The LFM2 / LFM2-MoE Megatron model (`slime_stoa.trainer.slime.lfm2.spec`) on the CPU, against
transformers on tiny random models: forward logits, the HF names of its weights, one training
step. Needs megatron-core (0.16); slow (Megatron's import and build)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core")

from safetensors.torch import load_file

from slime_stoa.quickstart.tiny_model import build_tiny_family
from slime_stoa.trainer.slime.lfm2 import spec
from slime_stoa.trainer.slime.lfm2.convert import Lfm2Shape, iter_hf
from slime_stoa.trainer.slime.lfm2.cpu import causal_mask, megatron_on_cpu

pytestmark = pytest.mark.slow


def _build(folder: Path) -> tuple[object, dict[str, torch.Tensor], dict[str, object]]:
    hf_cfg = json.loads((folder / "config.json").read_text())
    config = spec.transformer_config(hf_cfg, use_cpu_initialization=True, params_dtype=torch.float32,
                                     moe_token_dispatcher_type="allgather")
    model = spec.build_model(config, hf_cfg, vocab_size=hf_cfg["vocab_size"], max_sequence_length=256)
    state = load_file(str(folder / "model.safetensors"))
    spec.load_hf_state(model, state, Lfm2Shape.from_hf(hf_cfg))
    return model, state, hf_cfg


def acted(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The HF tensor as the trainer acts with it: the fp32 expert bias holds its bf16 rounding (the
    value the weight plane carries to the workers), everything else is unchanged."""
    if hf_name.endswith("feed_forward.expert_bias"):
        assert tensor.dtype == torch.float32
        return tensor.to(torch.bfloat16).to(torch.float32)
    return tensor


@pytest.mark.parametrize("family", ["lfm2", "lfm2_moe"])
def test_megatron_forward_matches_transformers(tmp_path: Path, family: str) -> None:
    folder = build_tiny_family(tmp_path / family, family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with megatron_on_cpu():
        model, state, hf_cfg = _build(folder)
        model.eval()  # type: ignore[attr-defined]
        with torch.no_grad():
            logits = model(ids, torch.arange(16)[None].expand(2, 16), attention_mask=causal_mask(16))  # type: ignore[operator]
            want = hf(ids).logits
        assert logits.shape == want.shape
        assert (logits - want).abs().max().item() < 1e-4
        # the publisher's names: Megatron -> HF gives back the folder's tensors exactly
        shape = Lfm2Shape.from_hf(hf_cfg)
        back = dict(iter_hf(((n, t.detach()) for n, t in spec.named_weights(model)), shape))  # type: ignore[arg-type]
        assert sorted(back) == sorted(state)
        for name, tensor in state.items():
            assert back[name].dtype == (torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype)
            assert torch.equal(back[name].to(tensor.dtype), acted(name, tensor)), name


def test_megatron_training_step_keeps_the_expert_bias(tmp_path: Path) -> None:
    folder = build_tiny_family(tmp_path / "moe", "lfm2_moe")
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    with megatron_on_cpu():
        model, _state, _cfg = _build(folder)
        model.train()  # type: ignore[attr-defined]
        bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}  # type: ignore[attr-defined]
        assert bias and all(b.dtype == torch.float32 for b in bias.values())
        loss = model(ids, torch.arange(12)[None], attention_mask=causal_mask(12), labels=ids).mean()  # type: ignore[operator]
        loss.backward()
        params = dict(model.named_parameters())  # type: ignore[attr-defined]
        for name in ("decoder.layers.0.self_attention.conv.weight", "decoder.layers.0.self_attention.in_proj.weight",
                     "decoder.layers.2.mlp.router.weight", "decoder.layers.2.self_attention.linear_qkv.weight"):
            assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
        for n, b in model.named_buffers():  # type: ignore[attr-defined]
            if n in bias:
                assert torch.equal(b, bias[n])


def test_parallelism_limits_are_refused() -> None:
    ok = SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1, num_moe_experts=8,
                         expert_model_parallel_size=4)
    spec.check_parallelism(ok)  # type: ignore[arg-type]
    for bad, match in ((dict(tensor_model_parallel_size=2), "tensor parallelism"),
                       (dict(context_parallel_size=2), "context parallelism"),
                       (dict(expert_model_parallel_size=3), "must divide")):
        with pytest.raises(ValueError, match=match):
            spec.check_parallelism(SimpleNamespace(**{**vars(ok), **bad}))  # type: ignore[arg-type]


def _stand_in_megatron_training(monkeypatch: pytest.MonkeyPatch, folder: Path, **config: object) -> dict[str, object]:
    """megatron.training's `get_args` (slime's args for `folder`) and `core_transformer_config_from_args`
    (`spec.transformer_config` with `config` over it), stood in; the HF config."""
    import sys
    import types

    hf_cfg = json.loads((folder / "config.json").read_text())
    args = SimpleNamespace(hf_checkpoint=str(folder), padded_vocab_size=hf_cfg["vocab_size"],
                           max_position_embeddings=256, transformer_impl="local")
    training = types.ModuleType("megatron.training")
    training.get_args = lambda: args  # type: ignore[attr-defined]
    arguments = types.ModuleType("megatron.training.arguments")
    arguments.core_transformer_config_from_args = lambda a: spec.transformer_config(  # type: ignore[attr-defined]
        hf_cfg, use_cpu_initialization=True, params_dtype=torch.float32, moe_token_dispatcher_type="allgather",
        **config)
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.arguments", arguments)
    return hf_cfg


def test_provider_builds_the_dense_mlp_transformers_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's `--ffn-hidden-size` is the HF config's intermediate_size (its start-up check wants
    it); the provider builds dense LFM2's adjusted width, so the HF weights load."""
    from slime_stoa.trainer.slime.lfm2.flags import dense_ffn_size, slime_model_args

    folder = build_tiny_family(tmp_path / "dense", "lfm2")
    hf_cfg = json.loads((folder / "config.json").read_text())
    flags = slime_model_args(hf_cfg)
    flag = int(flags[flags.index("--ffn-hidden-size") + 1])
    assert flag != dense_ffn_size(hf_cfg)
    _stand_in_megatron_training(monkeypatch, folder, ffn_hidden_size=flag)
    with megatron_on_cpu():
        model = spec.provider(pre_process=True, post_process=True)
        fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
        assert fc1.shape[0] == 2 * dense_ffn_size(hf_cfg)  # [w1; w3]
        spec.load_hf_state(model, load_file(str(folder / "model.safetensors")), Lfm2Shape.from_hf(hf_cfg))
    _stand_in_megatron_training(monkeypatch, folder, ffn_hidden_size=flag + 1)
    with megatron_on_cpu(), pytest.raises(ValueError, match="--ffn-hidden-size"):
        spec.provider()


def test_provider_and_slime_loader_with_slime_standins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`spec.provider` reads slime's args (megatron.training's get_args, stood in here) and the
    `--hf-checkpoint` config; `register_with_slime` makes slime's HF loader read the folder."""
    import sys
    import types

    from slime_stoa.trainer.slime.lfm2.conv import ShortConvMixer

    folder = build_tiny_family(tmp_path / "moe", "lfm2_moe")
    hf_cfg = _stand_in_megatron_training(monkeypatch, folder)
    loaders: dict[str, object] = {}
    for name in ("slime", "slime.backends", "slime.backends.megatron_utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    hf_to_megatron = types.ModuleType("slime.backends.megatron_utils.hf_to_megatron")
    hf_to_megatron._LOADERS = loaders  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "slime.backends.megatron_utils.hf_to_megatron", hf_to_megatron)
    sys.modules["slime.backends.megatron_utils"].hf_to_megatron = hf_to_megatron  # type: ignore[attr-defined]
    assert spec.register_with_slime() and set(loaders) == {"lfm2", "lfm2_moe"}

    with megatron_on_cpu():
        model = spec.provider(pre_process=True, post_process=True)
        assert isinstance(model.decoder.layers[0].self_attention, ShortConvMixer)
        assert isinstance(model.decoder.layers[2].mlp.router, spec.Lfm2Router)
        state = load_file(str(folder / "model.safetensors"))
        reader = SimpleNamespace(get_tensor=state.__getitem__)
        load = loaders["lfm2_moe"]
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.no_grad():
            for name, target in spec.named_weights(model):
                target.copy_(load("module.module." + name, reader, config).to(target.dtype))  # type: ignore[operator]
        back = dict(iter_hf(((n, t.detach()) for n, t in spec.named_weights(model)), Lfm2Shape.from_hf(hf_cfg)))
        assert all(torch.equal(back[k].to(v.dtype), acted(k, v)) for k, v in state.items())
