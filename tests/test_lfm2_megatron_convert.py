"""LFM2 / LFM2-MoE on the trainer, without Megatron: the HF <-> Megatron conversion and the layer
math of the provider's own modules (short conv, router) against transformers on tiny random
models."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file

from slime_stoa.quickstart.tiny_model import build_tiny_family
from slime_stoa.trainer.slime.lfm2.conv import ShortConvMixer, position_in_sequence, short_conv
from slime_stoa.trainer.slime.lfm2.convert import (
    Lfm2Shape,
    hf_to_megatron,
    main,
    megatron_names,
    megatron_to_hf,
    merge_qkv,
    split_qkv,
    to_hf,
)
from slime_stoa.trainer.slime.lfm2.moe import dense_routing, lfm2_topk


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lfm2")
    return {f: build_tiny_family(root / f, f) for f in ("lfm2", "lfm2_moe")}


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def _shape(folder: Path) -> Lfm2Shape:
    return Lfm2Shape.from_hf(json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("family", ["lfm2", "lfm2_moe"])
@pytest.mark.parametrize("layout", ["te", "local"])
def test_round_trip_hf_megatron_hf_is_exact(folders: dict[str, Path], family: str, layout: str) -> None:
    hf = _state(folders[family])
    shape = _shape(folders[family])
    mega = hf_to_megatron(hf, shape, layout)  # type: ignore[arg-type]
    assert sorted(mega) == sorted(megatron_names(shape, layout))  # type: ignore[arg-type]
    back = megatron_to_hf({"module.module." + k: v for k, v in mega.items()}, shape)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(back[name], tensor), name


def test_expert_bias_stays_fp32_and_experts_use_global_names(folders: dict[str, Path]) -> None:
    hf = _state(folders["lfm2_moe"])
    shape = _shape(folders["lfm2_moe"])
    assert shape.num_dense_layers == 2 and shape.num_experts == 8
    mega = hf_to_megatron(hf, shape, "te")
    bias = mega["decoder.layers.2.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, hf["model.layers.2.feed_forward.expert_bias"])
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mega  # dense layer: fused norm (te)
    assert "decoder.layers.2.pre_mlp_layernorm.weight" in mega  # MoE layer: its own norm
    fc1 = mega["decoder.layers.3.mlp.experts.linear_fc1.weight7"]
    e = "model.layers.3.feed_forward.experts.7."
    assert torch.equal(fc1, torch.cat([hf[e + "w1.weight"], hf[e + "w3.weight"]]))
    assert "decoder.layers.0.mlp.router.weight" not in mega


def test_qkv_layout_is_megatrons_grouped_order() -> None:
    shape = Lfm2Shape("lfm2", hidden_size=2, num_heads=4, num_kv_heads=2, head_dim=1, vocab_size=3,
                      layer_types=("full_attention",))
    q = np.array([[10, 10], [11, 11], [12, 12], [13, 13]])
    k = np.array([[20, 20], [21, 21]])
    v = np.array([[30, 30], [31, 31]])
    qkv = merge_qkv(q, k, v, shape)
    assert qkv[:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]  # per KV group: its q heads, k, v
    for got, want in zip(split_qkv(qkv, shape), (q, k, v), strict=True):
        assert np.array_equal(got, want)


def test_to_hf_strips_vocab_padding_and_names_the_tied_head(folders: dict[str, Path]) -> None:
    shape = _shape(folders["lfm2"])
    padded = torch.randn(shape.vocab_size + 128, shape.hidden_size)
    [(name, emb)] = to_hf("module.module.embedding.word_embeddings.weight", padded, shape)
    assert name == "model.embed_tokens.weight" and torch.equal(emb, padded[: shape.vocab_size])
    assert to_hf("module.module.output_layer.weight", padded, shape)[0][0] == "lm_head.weight"
    with pytest.raises(KeyError, match="not an LFM2"):
        to_hf("module.module.decoder.layers.0.mlp.shared_experts.linear_fc1.weight", padded, shape)


def test_shape_refuses_other_families() -> None:
    with pytest.raises(ValueError, match="not an LFM2 config"):
        Lfm2Shape.from_hf({"model_type": "qwen2", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4})


def test_conversion_command(folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mega"
    assert main(["--hf", str(folders["lfm2_moe"]), "--out", str(out), "--check"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["round_trip_equal"] is True and summary["layout"] == "te"
    written = load_file(str(out / "model.safetensors"))
    assert written["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    assert len(written) == summary["tensors"]
    qwen = build_tiny_family(tmp_path / "qwen", "qwen2")  # another family: a one-line error, exit 1
    assert main(["--hf", str(qwen), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not an LFM2 config" in err


# -- layer math against transformers ------------------------------------------------------------
def _hf_model(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_short_conv_matches_transformers_and_respects_packing(folders: dict[str, Path]) -> None:
    hf = _hf_model(folders["lfm2_moe"])
    block = hf.model.layers[0].conv
    x = torch.randn(2, 9, hf.config.hidden_size)
    with torch.no_grad():
        want = block(x)
        got = short_conv(x, block.in_proj.weight, block.conv.weight, block.out_proj.weight)
        assert (got - want).abs().max().item() < 1e-5
        # two sequences packed in one row compute what each does alone
        packed = torch.cat([x[0, :4], x[1, :5]])[None]
        cu = torch.tensor([0, 4, 9])
        alone = torch.cat([block(x[:1, :4])[0], block(x[1:, :5])[0]])
        got = short_conv(packed, block.in_proj.weight, block.conv.weight, block.out_proj.weight,
                         position_in_sequence(9, cu, packed.device))[0]
        assert (got - alone).abs().max().item() < 1e-5
        unmasked = short_conv(packed, block.in_proj.weight, block.conv.weight, block.out_proj.weight)[0]
        assert (unmasked[4:6] - alone[4:6]).abs().max().item() > 1e-3  # the mask matters


def test_short_conv_mixer_is_megatron_shaped(folders: dict[str, Path]) -> None:
    hf = _hf_model(folders["lfm2"])
    block = hf.model.layers[0].conv

    class Config:
        hidden_size = hf.config.hidden_size
        params_dtype = torch.float32

    mixer = ShortConvMixer(Config(), layer_number=1, conv_kernel=hf.config.conv_L_cache)
    assert sorted(n for n, _ in mixer.named_parameters()) == ["conv.weight", "in_proj.weight", "out_proj.weight"]
    assert all(p.tensor_model_parallel is False for p in mixer.parameters())
    mixer.load_state_dict({"in_proj.weight": block.in_proj.weight, "conv.weight": block.conv.weight,
                           "out_proj.weight": block.out_proj.weight})
    x = torch.randn(7, 2, hf.config.hidden_size)  # Megatron's [time, batch, hidden]
    with torch.no_grad():
        out, bias = mixer(x, None)
        assert bias is None
        assert (out.transpose(0, 1) - block(x.transpose(0, 1))).abs().max().item() < 1e-5
        # slime's packed rows: [total, 1, hidden] with the sequences' boundaries in packed_seq_params
        packed = torch.cat([x[:3, :1], x[:4, 1:]])
        params = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32), cu_seqlens_q_padded=None)
        out, _ = mixer(packed, None, packed_seq_params=params)
        alone = torch.cat([block(x[:3, :1].transpose(0, 1))[0], block(x[:4, 1:].transpose(0, 1))[0]])
        assert (out[:, 0] - alone).abs().max().item() < 1e-5


def test_routing_matches_transformers(folders: dict[str, Path]) -> None:
    hf = _hf_model(folders["lfm2_moe"])
    moe = hf.model.layers[2].feed_forward
    assert moe.expert_bias.abs().sum() > 0  # the tiny model's bias moves the selection
    x = torch.randn(256, hf.config.hidden_size)
    with torch.no_grad():
        logits, hf_w, hf_i = moe.gate(x, moe.expert_bias)
        w, i = lfm2_topk(logits, moe.expert_bias, hf.config.num_experts_per_tok,
                         norm_topk_prob=hf.config.norm_topk_prob, scaling=hf.config.routed_scaling_factor)
    assert torch.equal(i, hf_i) and torch.equal(w, hf_w)
    unbiased = lfm2_topk(logits, None, hf.config.num_experts_per_tok)[1]
    assert not torch.equal(unbiased, i)  # the bias changes which experts are chosen
    probs, routing_map = dense_routing(w, i, hf.config.num_experts)
    assert routing_map.sum(-1).eq(hf.config.num_experts_per_tok).all()
    assert torch.equal(probs.gather(1, i), w) and probs[~routing_map].eq(0).all()


def test_publisher_names_lfm2_without_slime(folders: dict[str, Path]) -> None:
    """The publisher's converter (hf_names.family_converter) turns slime's gathered Megatron
    parameters (global names, `module.module.` prefix, padded vocabulary) into the folder's names."""
    from slime_stoa.trainer.slime.hf_names import family_converter, folder_tensor_names

    folder = folders["lfm2_moe"]
    config = transformers.AutoConfig.from_pretrained(folder)  # the object slime's actor holds
    convert = family_converter(config)
    assert convert is not None
    hf = _state(folder)
    mega = hf_to_megatron(hf, Lfm2Shape.from_hf(config), "te")
    emb = mega["embedding.word_embeddings.weight"]
    mega["embedding.word_embeddings.weight"] = torch.cat([emb, torch.zeros(64, emb.shape[1], dtype=emb.dtype)])
    infos = [SimpleNamespace(name="module.module." + n) for n in mega]
    named = dict(convert(list(mega.values()), infos))
    assert frozenset(named) == folder_tensor_names(folder)
    assert named["model.layers.3.feed_forward.expert_bias"].dtype == torch.float32
    assert all(torch.equal(named[k], v) for k, v in hf.items())
    assert family_converter({"model_type": "qwen2"}) is None


def test_slime_flags_follow_the_config(folders: dict[str, Path]) -> None:
    from slime_stoa.trainer.slime.lfm2.flags import dense_ffn_size, slime_model_args

    moe = json.loads((folders["lfm2_moe"] / "config.json").read_text())
    flags = slime_model_args(moe)
    pairs = dict(zip(flags, [*flags[1:], ""], strict=True))
    assert pairs["--num-experts"] == "8" and pairs["--moe-router-topk"] == "2"
    assert pairs["--moe-layer-freq"] == "[0,0,1,1]" and pairs["--rotary-base"] == "1000000"
    assert pairs["--moe-router-bias-update-rate"] == "0" and "--qk-layernorm" in flags
    dense = json.loads((folders["lfm2"] / "config.json").read_text())
    hf = _hf_model(folders["lfm2"])
    assert dense_ffn_size(dense) == hf.model.layers[0].feed_forward.w1.weight.shape[0]  # transformers' width
    assert "--num-experts" not in slime_model_args(dense)


def test_launch_script_dry_run(folders: dict[str, Path], tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "scripts" / "run_lfm2_search.sh"
    env = {**os.environ, "MODEL_DIR": str(folders["lfm2_moe"]), "PYTHON": sys.executable, "SAVE_DIR": str(tmp_path),
           "EP_SIZE": "2"}
    proc = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    submit = proc.stdout.strip().splitlines()[-1]
    for part in ("--custom-model-provider-path slime_stoa.trainer.slime.lfm2.spec.provider", "--num-experts 8",
                 "--tensor-model-parallel-size 1", "--expert-model-parallel-size 2", "--moe-grouped-gemm",
                 f"--ref-load {folders['lfm2_moe']}_torch_dist", "--optimizer-cpu-offload"):
        assert part in submit, part
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
