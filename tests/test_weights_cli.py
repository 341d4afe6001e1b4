"""`stoa weights`: seed a run from an HF folder, then status, verify, inspect and export."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import MalformedPointer, find_manifest, read_pointer
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import read_key_file
from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart.tiny_model import build_tiny_model


def nudge(state: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    new = {k: v.copy() for k, v in state.items()}
    for bits in new.values():
        flat = bits.reshape(-1)
        where = rng.random(flat.size) < 0.01
        flat[where] ^= 1  # a last-mantissa-bit change, like a tiny optimizer step
    return new


@pytest.fixture
def seeded_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[dict[str, np.ndarray]]]:
    model = build_tiny_model(tmp_path / "model")
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    monkeypatch.setenv("STOA_STORE", f"file://{bucket}")
    monkeypatch.setenv("STOA_RUN", "demo")
    assert main(["run", "create", "--model", "tiny", "--task", "synthetic"]) == 0
    assert main(["weights", "publish-anchor", str(model)]) == 0
    states = [load_hf_state(model)]

    async def more() -> None:
        async with open_store(f"file://{bucket}") as store:
            catchups = PublisherConfig(catchup_budget=math.inf)
            pub = Publisher(store, "demo", catchups)  # a catch-up at v2 (two past the anchor) for inspect to show
            for seed in range(3):
                states.append(nudge(states[-1], seed))
                await pub.publish(states[-1])

    asyncio.run(more())
    return bucket, states


def test_seed_refuses_an_existing_run(seeded_run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["weights", "publish-anchor", str(tmp_path / "model")]) == 1
    assert "already has weights (v3)" in capsys.readouterr().err


def test_seed_refuses_a_run_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    model = build_tiny_model(tmp_path / "model")
    assert main(["weights", "publish-anchor", str(model), "--store", f"file://{bucket}", "--run", "nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "stoa run create" in err[0], err
    assert not any(bucket.rglob("*.json"))


@pytest.fixture
def signed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[str, Path, Path]:
    """(store URL, run key file, tiny model folder) of a created signed run `demo` with no weights."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    monkeypatch.setenv("STOA_STORE", url)
    monkeypatch.setenv("STOA_RUN", "demo")
    key = tmp_path / "keys" / "run.key"
    assert main(["keys", "create", str(key)]) == 0
    assert main(["run", "create", "--model", "tiny", "--task", "synthetic", "--key", str(key)]) == 0
    capsys.readouterr()
    return url, key, build_tiny_model(tmp_path / "model")


def signed_pointer(url: str, key: Path) -> bool:
    async def read() -> bool:
        async with open_store(url) as store:
            trust = RunTrust("demo", read_key_file(key).public)
            try:
                await read_pointer(store, "demo", trust=trust)
            except MalformedPointer:
                return False
            return True

    return asyncio.run(read())


def test_seed_of_a_signed_run_needs_its_key(signed_run, capsys: pytest.CaptureFixture) -> None:
    url, key, model = signed_run
    assert main(["weights", "publish-anchor", str(model)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is signed" in err[0] and "--key" in err[0], err

    async def published() -> bool:
        async with open_store(url) as store:
            return await store.exists(RunLayout("demo").pointer)

    assert not asyncio.run(published())
    assert main(["weights", "publish-anchor", str(model), "--key", str(key)]) == 0
    assert signed_pointer(url, key)
    assert main(["weights", "publish-anchor", str(model), "--key", str(key)]) == 1  # a signed v0 stays
    assert "already has weights (v0)" in capsys.readouterr().err


def test_the_key_holder_repairs_an_unsigned_v0_of_a_signed_run(signed_run, capsys: pytest.CaptureFixture) -> None:
    url, key, model = signed_run

    async def unsigned_v0() -> None:  # what publish-anchor without --key used to write
        async with open_store(url) as store:
            await Publisher(store, "demo").publish(load_hf_state(model))

    asyncio.run(unsigned_v0())
    assert not signed_pointer(url, key)
    assert main(["weights", "publish-anchor", str(model)]) == 1  # still not without the key
    other = key.with_name("other.key")
    assert main(["keys", "create", str(other)]) == 0
    capsys.readouterr()
    assert main(["weights", "publish-anchor", str(model), "--key", str(other)]) == 1  # nor with another key
    assert "not the current key" in capsys.readouterr().err
    assert not signed_pointer(url, key)
    assert main(["weights", "publish-anchor", str(model), "--key", str(key)]) == 0
    assert "replacing the unsigned v0" in capsys.readouterr().out
    assert signed_pointer(url, key)
    assert main(["weights", "verify"]) == 0  # the run manifest's key checks the repaired v0
    assert "weights OK" in capsys.readouterr().out


def test_status_verify_inspect(seeded_run, capsys: pytest.CaptureFixture) -> None:
    assert main(["weights", "status"]) == 0
    out = capsys.readouterr().out
    assert "run demo: v3" in out and "v0 (" in out
    assert main(["weights", "verify"]) == 0
    assert "weights OK" in capsys.readouterr().out
    assert main(["weights", "inspect", "--version", "2"]) == 0
    out = capsys.readouterr().out
    assert "v2 (attempt" in out and "step patch from v1..v1" in out and "catchup patch from v0..v1" in out


def test_verify_reports_a_missing_patch(seeded_run, capsys: pytest.CaptureFixture) -> None:
    bucket, _ = seeded_run

    async def drop() -> None:
        async with open_store(f"file://{bucket}") as store:
            manifest = await find_manifest(store, "demo", 2)
            await store.delete(manifest.patch("step").key)

    asyncio.run(drop())
    assert main(["weights", "verify"]) == 1
    assert "v2 step patch" in capsys.readouterr().out


def test_export_any_version_as_a_loadable_hf_folder(seeded_run, tmp_path: Path) -> None:
    _, states = seeded_run
    out = tmp_path / "export-v2"
    assert main(["weights", "export", "--version", "2", str(out)]) == 0
    exported = load_hf_state(out)
    assert exported.keys() == states[2].keys()
    assert all(np.array_equal(exported[k], states[2][k]) for k in exported)
    assert not all(np.array_equal(exported[k], states[3][k]) for k in exported)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    name = "model.embed_tokens.weight"
    bits = model.state_dict()[name].view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bits, states[2][name])


def test_missing_options_say_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOA_STORE", raising=False)
    with pytest.raises(SystemExit, match="--store"):
        main(["weights", "status", "--run", "x"])
