"""safetensors I/O, bf16 conversion, HF folders and the tiny test model.

The protocol tests need only numpy; interop and model-loading tests skip where the `safetensors`
package, torch, transformers or mlx-lm are missing.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")  # before any mlx import: no g++ kernel builds

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.hf.folders import (
    INDEX_NAME,
    bf16_bits_to_f32,
    f32_to_bf16_bits,
    hf_config_files,
    load_hf_state,
    save_hf_folder,
)
from slime_stoa.protocol.hf.safetensors_io import (
    MAX_HEADER_BYTES,
    read_header,
    read_safetensors,
    safetensors_bytes,
    write_safetensors,
)
from slime_stoa.quickstart.tiny_model import CHAT_TEMPLATE, build_tiny_model

# bf16 bit patterns that a float round trip could mangle: ±0, ±inf, quiet/signalling NaNs with
# payloads, subnormals, the extremes of the normal range.
BF16_EDGE_BITS = np.array(
    [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FA5, 0x0001, 0x807F,
     0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80],
    dtype=np.uint16,
)


def _bits(arr: np.ndarray) -> np.ndarray:
    """Raw bytes of an array as unsigned ints of its width (NaN-safe equality)."""
    return arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.kind == "f" else arr


def _sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    f32 = rng.normal(size=(4, 3)).astype(np.float32)
    # a NaN with a payload, -inf, the smallest subnormal
    f32.view(np.uint32)[0, :3] = [0x7FC00001, 0xFF800000, 0x00000001]
    return {
        "edge": BF16_EDGE_BITS.reshape(4, 4),
        "random": rng.integers(0, 1 << 16, size=(3, 5, 7), dtype=np.uint16),
        "empty": np.zeros((0, 4), np.uint16),
        "scalar": np.array(0x7F81, np.uint16),
        "f32": f32,
        "f16": np.array([0.5, -0.0, np.inf, 65504.0], np.float16),
        "i64": np.array([[-(1 << 62), 7]], np.int64),
        "i8": np.arange(-3, 3, dtype=np.int8),
        "u16": np.array([1, 65535], np.uint16),
        "mask": np.array([True, False, True]),
    }


def _assert_same(got: dict[str, tuple[str, np.ndarray]], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for name, arr in want.items():
        _, out = got[name]
        assert out.shape == arr.shape, name
        assert out.dtype == arr.dtype, name
        np.testing.assert_array_equal(_bits(out), _bits(arr), err_msg=name)


# ------------------------------------------------------------------------ safetensors format


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    tensors = _sample_tensors()
    meta = {"format": "pt", "note": "ünïcode"}
    path = write_safetensors(
        tmp_path / "a.safetensors", tensors, dtypes={"u16": "U16"}, metadata=meta
    )
    got = read_safetensors(path)
    _assert_same(got, tensors)
    assert got["edge"][0] == "BF16" and got["u16"][0] == "U16" and got["f32"][0] == "F32"
    assert got["random"][1].flags.writeable
    blob = safetensors_bytes(tensors, dtypes={"u16": "U16"}, metadata=meta)
    assert blob == path.read_bytes()
    _assert_same(read_safetensors(blob), tensors)
    header = read_header(path)
    assert header.metadata == meta
    assert header.data_start % 8 == 0
    assert all(t.begin % tensors[t.name].dtype.itemsize == 0 for t in header.tensors)
    assert not list(tmp_path.glob(".*.tmp"))  # the temp file was renamed away


def test_writer_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be written as BF16"):
        safetensors_bytes({"w": np.zeros(3, np.float32)}, dtypes={"w": "BF16"})
    with pytest.raises(ValueError, match="unsupported safetensors dtype"):
        safetensors_bytes({"w": np.zeros(3, np.float32)}, dtypes={"w": "F12"})
    with pytest.raises(ValueError, match="not given"):
        safetensors_bytes({"w": np.zeros(3, np.float32)}, dtypes={"v": "F32"})
    with pytest.raises(ValueError, match="no safetensors equivalent"):
        safetensors_bytes({"w": np.zeros(3, np.complex64)})
    with pytest.raises(ValueError, match="str to str"):
        safetensors_bytes({"w": np.zeros(3)}, metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="invalid tensor name"):
        safetensors_bytes({"__metadata__": np.zeros(3, np.float32)})
    # A failed write leaves neither the target nor a temp file behind.
    with pytest.raises(ValueError):
        write_safetensors(tmp_path / "x.safetensors", {"w": np.zeros(1, np.complex64)})
    assert list(tmp_path.iterdir()) == []


def test_writer_accepts_int16_bits_and_big_endian() -> None:
    bits = BF16_EDGE_BITS.view(np.int16)
    got = read_safetensors(safetensors_bytes({"w": bits}, dtypes={"w": "BF16"}))
    np.testing.assert_array_equal(got["w"][1], BF16_EDGE_BITS)
    be = np.arange(5, dtype=">f4")
    np.testing.assert_array_equal(read_safetensors(safetensors_bytes({"x": be}))["x"][1], be)


def test_interop_with_safetensors_package(tmp_path: Path) -> None:
    st_np = pytest.importorskip("safetensors.numpy")
    safetensors = pytest.importorskip("safetensors")
    bf16 = ("edge", "random", "scalar", "empty")
    tensors = {k: v for k, v in _sample_tensors().items() if k not in bf16}
    # ours -> package (numpy has no bf16, so BF16 is checked through torch below)
    path = write_safetensors(
        tmp_path / "ours.safetensors", tensors, dtypes={"u16": "U16"}, metadata={"format": "np"}
    )
    loaded = st_np.load_file(path)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(_bits(loaded[name]), _bits(arr), err_msg=name)
    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata() == {"format": "np"}
    # package -> ours
    blob = st_np.save(tensors, metadata={"k": "v"})
    _assert_same(read_safetensors(blob), tensors)
    assert read_header(blob).metadata == {"k": "v"}


def test_bf16_interop_with_torch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    st_torch = pytest.importorskip("safetensors.torch")
    tensors = {k: v for k, v in _sample_tensors().items() if v.dtype == np.uint16 and k != "u16"}
    path = write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    loaded = st_torch.load_file(path)
    for name, arr in tensors.items():
        t = loaded[name]
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == arr.shape, name
        np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16), arr)
    theirs = {
        n: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16) for n, a in tensors.items()
    }
    st_torch.save_file(theirs, tmp_path / "theirs.safetensors", metadata={"format": "pt"})
    got = read_safetensors(tmp_path / "theirs.safetensors")
    _assert_same(got, tensors)
    assert {d for d, _ in got.values()} == {"BF16"}


def _blob(header: dict, data: bytes, *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


_GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}}


_DUP = (json.dumps(_GOOD)[:-1] + "," + json.dumps(_GOOD)[1:]).encode()  # every key twice


def _with(name: str, **changes: object) -> dict:
    header = json.loads(json.dumps(_GOOD))
    header[name].update(changes)
    return header


CORRUPT = {
    "empty input": b"",
    "short length field": b"\x05\x00\x00",
    "truncated header": _blob(_GOOD, bytes(12))[:20],
    "truncated data": _blob(_GOOD, bytes(11)),
    "trailing bytes": _blob(_GOOD, bytes(13)),
    "huge header length": _blob(_GOOD, bytes(12), length=MAX_HEADER_BYTES + 1),
    "header length past end": _blob(_GOOD, bytes(12), length=1 << 40),
    "offset out of range": _blob(_with("b", data_offsets=[8, 400], shape=[196]), bytes(12)),
    "overlapping": _blob(_with("b", data_offsets=[4, 8]), bytes(8)),
    "gap": _blob(_with("b", data_offsets=[10, 14]), bytes(14)),
    "size mismatch": _blob(_with("b", shape=[3]), bytes(12)),
    "reversed offsets": _blob(_with("b", data_offsets=[12, 8]), bytes(12)),
    "negative dim": _blob(_with("a", shape=[-2]), bytes(12)),
    "unknown dtype": _blob(_with("a", dtype="F128"), bytes(12)),
    "missing key": _blob({"a": {"dtype": "F32", "shape": [2]}}, bytes(8)),
    "not json": struct.pack("<Q", 4) + b"{{{{",
    "not utf-8": struct.pack("<Q", 4) + b"\xff\xfe{}",
    "not an object": _blob([1, 2], b""),  # type: ignore[arg-type]
    "bad metadata": _blob({"__metadata__": {"k": 1}}, b""),
    "duplicate key": struct.pack("<Q", len(_DUP)) + _DUP + bytes(12),
}


def test_valid_reference_blob_parses() -> None:
    got = read_safetensors(_blob(_GOOD, bytes(12)))
    assert got["a"][1].shape == (2,) and got["b"][0] == "BF16"
    # Unknown fields in an entry are ignored, as the reference implementation does.
    assert read_safetensors(_blob(_with("a", extra=1), bytes(12)))["a"][1].shape == (2,)


def test_reference_implementation_also_rejects_corrupt_cases() -> None:
    safetensors = pytest.importorskip("safetensors")
    safetensors.deserialize(_blob(_GOOD, bytes(12)))
    for case, blob in CORRUPT.items():
        if case == "duplicate key":  # the reference keeps the last one; stoa is stricter
            continue
        with pytest.raises(safetensors.SafetensorError):
            safetensors.deserialize(blob)


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_input_raises_value_error(case: str, tmp_path: Path) -> None:
    blob = CORRUPT[case]
    with pytest.raises(ValueError, match="corrupt safetensors"):
        read_safetensors(blob)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ValueError, match="corrupt safetensors"):
        read_safetensors(path)


# ------------------------------------------------------------------------ bf16 conversion


def test_f32_to_bf16_known_values() -> None:
    u = np.array(
        [0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7FFFFF, 0xFF7FFFFF,
         0x7F7F7FFF, 0x00000001, 0x00008000, 0x00018000, 0x80000000, 0x7F800000, 0xFF800000],
        dtype=np.uint32,
    )
    want = [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F80, 0x7F80, 0xFF80,
            0x7F7F, 0x0000, 0x0000, 0x0002, 0x8000, 0x7F80, 0xFF80]
    np.testing.assert_array_equal(f32_to_bf16_bits(u.view(np.float32)), np.array(want, np.uint16))
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    np.testing.assert_array_equal(f32_to_bf16_bits(nans), np.full(4, 0x7FC0, np.uint16))
    assert f32_to_bf16_bits(np.float32(1.5) * np.ones((), np.float32)).shape == ()
    with pytest.raises(ValueError, match="float32"):
        f32_to_bf16_bits(np.ones(2, np.float64))


def test_bf16_widening_is_exact() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    f = bf16_bits_to_f32(bits)
    nan = np.isnan(f)
    assert nan.sum() == 2 * 127  # 0x7F81..0x7FFF and its negative twin
    np.testing.assert_array_equal(f32_to_bf16_bits(f)[~nan], bits[~nan])


def test_f32_to_bf16_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    parts = [
        rng.normal(scale=s, size=20_000).astype(np.float32) for s in (1e-38, 1e-30, 1e-3, 1.0, 1e30)
    ]
    any_bits = rng.integers(0, 1 << 32, size=50_000, dtype=np.uint32)
    parts.append(any_bits.view(np.float32))
    # exact ties, values next to ties, subnormals, overflow boundary, zeros, infinities
    hi = rng.integers(0, 1 << 16, size=5_000, dtype=np.uint32) << 16
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi | 0x0001])
    edge = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x00000001,
                     0x807FFFFF, 0x007F8000], np.uint32)
    parts += [ties.view(np.float32), edge.view(np.float32)]
    x = np.concatenate(parts)
    x = x[~np.isnan(x)]
    ours = f32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    mismatch = np.flatnonzero(ours != theirs)
    assert mismatch.size == 0, [hex(v) for v in x[mismatch[:5]].view(np.uint32)]
    # NaN stays NaN (torch's own NaN bits depend on its code path, so only NaN-ness is compared)
    nan_bits = f32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32))
    assert torch.from_numpy(nan_bits.view(np.int16)).view(torch.bfloat16).isnan().all()


# ------------------------------------------------------------------------ HF folders


def _random_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (64, 16), "model.layers.0.mlp.up_proj.weight": (32, 16),
              "model.layers.0.input_layernorm.weight": (16,), "model.norm.weight": (16,),
              "lm_head.weight": (64, 16)}
    return {n: rng.integers(0, 1 << 16, size=s, dtype=np.uint16) for n, s in shapes.items()}


def test_sharded_save_load_round_trip(tmp_path: Path) -> None:
    state = _random_state()
    out = save_hf_folder(state, tmp_path / "m", shard_bytes=2500)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in state.values())
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == set(shards)
    assert read_header(out / shards[0]).metadata == {"format": "pt"}
    loaded = load_hf_state(out)
    assert set(loaded) == set(state)
    for name, arr in state.items():
        assert loaded[name].dtype == np.uint16
        np.testing.assert_array_equal(loaded[name], arr, err_msg=name)
    # Re-saving unsharded removes the stale shards and index: mlx-lm loads every
    # model*.safetensors it finds.
    save_hf_folder(state, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert all(np.array_equal(load_hf_state(out)[n], a) for n, a in state.items())


def test_load_rejects_inconsistent_folders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither"):
        load_hf_state(tmp_path)
    out = save_hf_folder(_random_state(), tmp_path / "m", shard_bytes=2500)
    index = json.loads((out / INDEX_NAME).read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (out / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="disagrees"):
        load_hf_state(out)
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="missing"):
        load_hf_state(out)
    with pytest.raises(ValueError, match="uint16"):
        save_hf_folder({"w": np.zeros(2, np.float32)}, tmp_path / "n")


def test_load_converts_f32_and_f16_and_rejects_others(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    f32 = rng.normal(size=(8, 8)).astype(np.float32)
    f16 = rng.normal(size=(5,)).astype(np.float16)
    bits = rng.integers(0, 1 << 16, size=(3,), dtype=np.uint16)
    write_safetensors(tmp_path / "model.safetensors", {"a": f32, "b": f16, "c": bits})
    state = load_hf_state(tmp_path)
    np.testing.assert_array_equal(state["a"], f32_to_bf16_bits(f32))
    np.testing.assert_array_equal(state["b"], f32_to_bf16_bits(f16.astype(np.float32)))
    np.testing.assert_array_equal(state["c"], bits)
    write_safetensors(tmp_path / "model.safetensors", {"a": f32, "steps": np.arange(3)})
    with pytest.raises(ValueError, match="'steps' has dtype I64"):
        load_hf_state(tmp_path)


def test_save_copies_config_and_tokenizer_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shipped = ["config.json", "tokenizer.json", "tokenizer_config.json", "merges.txt"]
    for name in [*shipped, "notes.md"]:
        (src / name).write_text(name)
    with pytest.raises(ValueError, match=r"config\.json"):
        save_hf_folder(_random_state(), tmp_path / "o", source_dir=tmp_path)
    out = save_hf_folder(_random_state(), tmp_path / "out", source_dir=src)
    assert [p.name for p in hf_config_files(out)] == shipped
    assert (out / "merges.txt").read_text() == "merges.txt" and not (out / "notes.md").exists()
    save_hf_folder(_random_state(1), out, source_dir=out)  # copying onto itself is a no-op
    assert (out / "config.json").read_text() == "config.json"


# ------------------------------------------------------------------------ tiny model


def test_tiny_model_is_deterministic_and_complete(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config = json.loads((a / "config.json").read_text())
    state = load_hf_state(a)
    assert "lm_head.weight" not in state and config["tie_word_embeddings"] is True
    assert state["model.embed_tokens.weight"].shape == (config["vocab_size"], 64)
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    norm = bf16_bits_to_f32(state["model.norm.weight"])
    assert (norm == 1.0).all()
    emb = bf16_bits_to_f32(state["model.embed_tokens.weight"])
    assert 0.015 < emb.std() < 0.025
    tokenizer = json.loads((a / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) <= config["vocab_size"]
    c = build_tiny_model(tmp_path / "c", seed=1, tie_word_embeddings=False)
    assert "lm_head.weight" in load_hf_state(c)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tie_word_embeddings=request.param)


MESSAGES = [{"role": "user", "content": "What is 12 + 30? Think step by step."}]
EXPECTED_PROMPT = (
    "<|im_start|>user\nWhat is 12 + 30? Think step by step.<|im_end|>\n<|im_start|>assistant\n"
)


def _prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenizer_chat_template(tiny_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == EXPECTED_PROMPT
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = _prompt_ids(tok)
    # Special tokens are single ids, and the raw tokenizers pipeline agrees with transformers.
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2
    assert Tokenizer.from_file(str(tiny_model / "tokenizer.json")).encode(text).ids == ids
    assert tok.decode(ids) == text


def test_transformers_and_mlx_agree(tiny_model: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx
    from mlx.utils import tree_flatten

    state = load_hf_state(tiny_model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    model, mlx_tok = mlx_lm.load(str(tiny_model))
    ids = _prompt_ids(hf_tok)
    assert _prompt_ids(mlx_tok) == ids

    # Both frameworks hold exactly the weights on disk.
    hf_params = dict(hf.named_parameters())
    mlx_params = dict(tree_flatten(model.parameters()))
    assert set(mlx_params) == set(state)
    for name, bits in state.items():
        assert mlx_params[name].dtype == mx.bfloat16, name
        mlx_bits = np.array(mlx_params[name].view(mx.uint16))
        np.testing.assert_array_equal(mlx_bits, bits, err_msg=name)
        hf_values = hf_params[name].detach().numpy()
        np.testing.assert_array_equal(hf_values, bf16_bits_to_f32(bits), err_msg=name)

    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0].numpy()
    model.set_dtype(mx.float32)
    mlx_logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    assert hf_logits.shape == mlx_logits.shape == (len(ids), hf.config.vocab_size)
    assert np.abs(hf_logits).max() > 0.1  # not degenerate
    # float32 on both sides: measured gap ~2e-7; bf16 compute would be ~5e-3.
    np.testing.assert_allclose(mlx_logits, hf_logits, rtol=0, atol=1e-5)


def test_sharded_copy_loads_in_both_frameworks(tiny_model: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    mlx_lm = pytest.importorskip("mlx_lm")
    import mlx.core as mx

    state = load_hf_state(tiny_model)
    out = save_hf_folder(state, tmp_path / "sharded", source_dir=tiny_model, shard_bytes=40_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    ids = [[1, 57, 456, 268, 223, 20, 304]]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(hf(torch.tensor(ids)).logits, ref(torch.tensor(ids)).logits)
    model, _ = mlx_lm.load(str(out))
    ref_model, _ = mlx_lm.load(str(tiny_model))
    np.testing.assert_array_equal(
        np.array(model(mx.array(ids)).astype(mx.float32)),
        np.array(ref_model(mx.array(ids)).astype(mx.float32)),
    )
