"""published_bits: a real signed run published by delta to a folder store, rebuilt by a fresh
Subscriber, against HF folders of the trainer's weights (the version's own, an older one, one bit
off, an fp32 copy, a tied head)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.hf.folders import bf16_bits_to_f32
from slime_stoa.protocol.hf.safetensors_io import write_safetensors
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import open_store
from slime_stoa.trainer.slime.published_bits import align_head, compare, main

RUN = "bits"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {EMBED: (32, 8), "model.layers.0.mlp.weight": (8, 16), "model.layers.0.feed_forward.expert_bias": (4,),
              "model.norm.weight": (8,)}
    return {n: rng.integers(0x3C00, 0x4000, s, dtype=np.uint16) for n, s in shapes.items()}  # bf16 in [2^-7, 2)


def _step(state: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A sparse step: a few elements of each tensor move by one ulp."""
    out = {}
    for name, bits in state.items():
        new = bits.copy().reshape(-1)
        new[rng.choice(new.size, max(1, new.size // 8), replace=False)] += 1
        out[name] = new.reshape(bits.shape)
    return out


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, list[dict[str, np.ndarray]]]:
    """A signed run with v0 (anchor), v1 and v2 (deltas): its URL and the three states."""
    rng = np.random.default_rng(3)
    states = [_state(rng)]
    states += [_step(states[0], rng)]
    states += [_step(states[1], rng)]
    url = f"file://{tmp_path / 'bucket'}"

    async def publish() -> None:
        key = SigningKey.generate()
        async with open_store(url) as store:
            manifest = RunManifest(run=RUN, model="tiny", task="synthetic", run_key=key.public.to_text())
            await store.put_if_absent(RunLayout(RUN).run_manifest, manifest.to_bytes(key))
            publisher = Publisher(store, RUN, PublisherConfig(anchor_every=50, planes=()), key=key)
            for state in states:
                await publisher.publish(state)

    (tmp_path / "bucket").mkdir()
    asyncio.run(publish())
    return url, states


def _trainer_folder(path: Path, state: dict[str, np.ndarray], *, f32: tuple[str, ...] = ()) -> Path:
    """An HF folder of `state`; the tensors in `f32` written as float32 values that round to their
    bits (low mantissa bits set below the rounding half, as an fp32 buffer of the trainer holds)."""
    path.mkdir(parents=True)
    tensors: dict[str, np.ndarray] = {}
    for name, bits in state.items():
        if name in f32:
            wide = bf16_bits_to_f32(bits).view(np.uint32) | np.uint32(0x1234)
            tensors[name] = wide.view(np.float32)
        else:
            tensors[name] = bits
    write_safetensors(path / "model.safetensors", tensors,
                      dtypes={n: "BF16" for n in state if n not in f32})
    return path


def _run(url: str, folder: Path, *extra: str) -> int:
    return main(["--store", url, "--run", RUN, "--trainer-hf", str(folder), *extra])


def test_the_published_version_equals_the_trainers_weights(published, tmp_path: Path, capsys) -> None:
    url, states = published
    folder = _trainer_folder(tmp_path / "trainer", states[2], f32=("model.layers.0.feed_forward.expert_bias",))
    report = tmp_path / "bits.json"
    assert _run(url, folder, "--json", str(report)) == 0
    out = capsys.readouterr().out
    assert "checking signatures against run key" in out  # the signed run's key, from its manifest
    assert "v2: the published state equals the trainer's weights bit for bit (4 tensors" in out
    doc = json.loads(report.read_text())
    assert doc["equal"] and doc["version"] == 2 and doc["trainer_digest"] == doc["manifest_digest"]


def test_an_older_step_or_one_bit_off_is_a_difference(published, tmp_path: Path, capsys) -> None:
    url, states = published
    assert _run(url, _trainer_folder(tmp_path / "older", states[1])) == 1
    out = capsys.readouterr().out
    assert "v2: the published state differs from the trainer's weights; bits or shape differ: 4 (" in out
    assert "digest of the trainer's" in out

    off = {n: b.copy() for n, b in states[2].items()}
    off["model.norm.weight"][3] ^= 1
    assert _run(url, _trainer_folder(tmp_path / "off", off)) == 1
    assert "bits or shape differ: 1 (model.norm.weight)" in capsys.readouterr().out

    # the version asked for, not the current one: v1 equals the older step
    assert _run(url, tmp_path / "older", "--version", "1") == 0
    assert "v1: the published state equals" in capsys.readouterr().out


def test_a_missing_or_extra_tensor_is_a_difference(published, tmp_path: Path, capsys) -> None:
    url, states = published
    fewer = {n: b for n, b in states[2].items() if n != "model.norm.weight"}
    assert _run(url, _trainer_folder(tmp_path / "fewer", fewer)) == 1
    assert "only published: 1 (model.norm.weight)" in capsys.readouterr().out
    more = {**states[2], "model.extra.weight": np.zeros(4, np.uint16)}
    assert _run(url, _trainer_folder(tmp_path / "more", more)) == 1
    assert "only in the trainer's: 1 (model.extra.weight)" in capsys.readouterr().out


def test_bad_input_is_one_line(published, tmp_path: Path, capsys) -> None:
    url, _ = published
    assert _run(url, tmp_path / "nothing-here") == 2
    err = capsys.readouterr().err
    assert err.startswith("published_bits: error: ") and err.count("\n") == 1
    assert main(["--store", f"file://{tmp_path / 'empty'}", "--run", RUN, "--trainer-hf", str(tmp_path)]) == 2


def test_a_tied_head_is_compared_as_the_publisher_plans_it() -> None:
    embed = np.arange(12, dtype=np.uint16).reshape(3, 4)
    published = {EMBED: embed}
    # Megatron's checkpoint converted with a head equal to the embedding: the publisher dropped it
    assert align_head(published, {EMBED: embed, HEAD: embed.copy()}) == {EMBED: embed}
    # a head that is not the embedding's bits stays, and is a difference
    other = embed + 1
    assert compare(0, published, "d", {EMBED: embed, HEAD: other}).only_trainer == [HEAD]
    # the publisher copied the head; the checkpoint holds none (Megatron ties it): the embedding's bits
    aligned = align_head({EMBED: embed, HEAD: embed}, {EMBED: embed})
    assert set(aligned) == {EMBED, HEAD} and aligned[HEAD] is embed
    report = compare(0, {EMBED: embed, HEAD: other}, "d", {EMBED: embed})
    assert report.differing == [HEAD] and not report.equal
