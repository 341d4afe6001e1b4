"""`stoa worker add|revoke|release|list` against a signed run, on both store backends."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.cli.worker_cmd import new_worker_id
from slime_stoa.protocol.layout import RunLayout, check_worker_id
from slime_stoa.protocol.registry import read_registry
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey, write_key_file
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.worker_keys import read_worker_key_file
from slime_stoa.trainer.consumer.persistence import write_state
from slime_stoa.trainer.consumer.quarantine import WorkerRecord
from slime_stoa.trainer.consumer.state import ConsumerState

RUN = "fleet-run"


@pytest.fixture
def env(store_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, store_url: str) -> None:
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("STOA_STORE", store_url)
    monkeypatch.setenv("STOA_RUN", RUN)


async def signed_run(store: Store, folder: Path) -> tuple[SigningKey, Path]:
    key = SigningKey.generate()
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", run_key=key.public.to_text())
    await store.put_if_absent(RunLayout(RUN).run_manifest, manifest.to_bytes(key))
    return key, write_key_file(folder / "run.key", key)


def test_new_worker_ids() -> None:
    ids = {new_worker_id("Alice's MacBook Pro") for _ in range(20)}
    assert len(ids) > 1 and all(i.startswith("alice-s-macbook-pro-") and check_worker_id(i) for i in ids)
    assert new_worker_id("!!!").startswith("mac-") and len(new_worker_id("x" * 100)) <= 48


async def test_add_revoke_release_list(
    store: Store, env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_key, key_file = await signed_run(store, tmp_path)
    monkeypatch.chdir(tmp_path)

    def stoa(*argv: str) -> int:
        return main(list(argv))

    assert await asyncio.to_thread(stoa, "worker", "add", "studio", "--key", str(key_file)) == 0
    out = capsys.readouterr().out
    issued = sorted(tmp_path.glob("*.worker-key"))
    assert len(issued) == 1 and issued[0].name in out and "macd join" in out
    assert stat.S_IMODE(issued[0].stat().st_mode) == 0o600
    studio = read_worker_key_file(issued[0])
    assert studio.run == RUN and studio.worker.startswith("studio-")
    out_file = tmp_path / "keys" / "mini.key"
    assert await asyncio.to_thread(stoa, "worker", "add", "mini", "--key", str(key_file), "--out", str(out_file),
                                   "--worker-id", "mini-000001") == 0
    mini = read_worker_key_file(out_file)
    assert mini.worker == "mini-000001"

    read = await read_registry(store, RUN, run_key.public)
    assert read is not None
    reg = read.registry
    assert reg.serial == 2 and set(reg.workers) == {studio.worker, "mini-000001"}
    assert reg.workers[studio.worker].key == studio.key.public and reg.workers["mini-000001"].key == mini.key.public

    assert await asyncio.to_thread(stoa, "worker", "revoke", "mini-000001", "--key", str(key_file)) == 0
    capsys.readouterr()
    # Not quarantined (the trainer has saved no state yet): said so, nothing counted.
    assert await asyncio.to_thread(stoa, "worker", "release", "studio", "--key", str(key_file)) == 0
    said = capsys.readouterr().out
    assert f"worker {studio.worker} is not quarantined" in said and "no release counted" in said, said
    read = await read_registry(store, RUN, run_key.public)
    assert read is not None and read.registry.serial == 3 and read.registry.workers[studio.worker].releases == 0
    # Quarantined by the trainer: the release is counted, once; a second one waits for the trainer.
    quarantined = ConsumerState(run=RUN, quarantine={studio.worker: WorkerRecord(reason="logprob gap", since_ms=1)})
    await write_state(store, quarantined, None, key=run_key)
    assert await asyncio.to_thread(stoa, "worker", "release", "studio", "--key", str(key_file)) == 0
    assert f"released worker {studio.worker} (release 1)" in capsys.readouterr().out
    assert await asyncio.to_thread(stoa, "worker", "release", "studio", "--key", str(key_file)) == 0
    assert "not applied yet" in capsys.readouterr().out
    read = await read_registry(store, RUN, run_key.public)
    assert read is not None
    assert read.registry.workers["mini-000001"].revoked and read.registry.workers[studio.worker].releases == 1
    capsys.readouterr()
    assert await asyncio.to_thread(stoa, "worker", "list") == 0  # verified with the manifest's run key
    listing = capsys.readouterr().out
    assert "serial 4, 2 worker(s)" in listing and studio.worker in listing and "mini-000001" in listing

    # Refusals: revoking twice, an unknown worker, a key that is not the run's, an existing key file.
    assert await asyncio.to_thread(stoa, "worker", "revoke", "mini", "--key", str(key_file)) == 1
    assert "already revoked" in capsys.readouterr().err
    assert await asyncio.to_thread(stoa, "worker", "release", "nobody", "--key", str(key_file)) == 1
    assert "no worker" in capsys.readouterr().err
    other = write_key_file(tmp_path / "other.key", SigningKey.generate())
    assert await asyncio.to_thread(stoa, "worker", "add", "x", "--key", str(other)) == 1
    assert "not the current run key" in capsys.readouterr().err
    assert await asyncio.to_thread(stoa, "worker", "add", "y", "--key", str(key_file), "--out", str(out_file)) == 1
    assert "already exists" in capsys.readouterr().err
    read = await read_registry(store, RUN, run_key.public)
    assert read is not None and read.registry.serial == 4  # no refused edit was written
    assert sorted(tmp_path.glob("*.worker-key")) == issued


async def test_a_readable_run_key_file_is_refused(store: Store, env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, key_file = await signed_run(store, tmp_path)
    key_file.chmod(0o644)
    assert await asyncio.to_thread(main, ["worker", "add", "a", "--key", str(key_file), "--out", str(tmp_path / "a.key")]) == 1
    assert "chmod 600" in capsys.readouterr().err and not (tmp_path / "a.key").exists()


async def test_list_of_an_unsigned_run(store: Store, env: None, capsys: pytest.CaptureFixture[str]) -> None:
    await store.put_if_absent(RunLayout(RUN).run_manifest, RunManifest(run=RUN, model="m", task="synthetic").to_bytes())
    assert await asyncio.to_thread(main, ["worker", "list"]) == 1
    assert "not signed" in capsys.readouterr().err


async def test_after_a_rotation_the_new_key_edits_the_registry_and_the_old_one_is_refused(
    store: Store, env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, old_file = await signed_run(store, tmp_path)
    monkeypatch.chdir(tmp_path)

    def stoa(*argv: str) -> int:
        return main(list(argv))

    assert await asyncio.to_thread(stoa, "worker", "add", "studio", "--key", str(old_file)) == 0
    new_file = write_key_file(tmp_path / "new.key", SigningKey.generate())
    assert await asyncio.to_thread(stoa, "keys", "rotate", "--old", str(old_file), "--new", str(new_file)) == 0
    capsys.readouterr()
    assert await asyncio.to_thread(stoa, "worker", "add", "mini", "--key", str(old_file)) == 1
    assert "not the current run key" in capsys.readouterr().err
    assert await asyncio.to_thread(stoa, "worker", "add", "mini", "--key", str(new_file)) == 0  # takes over the old registry
    assert await asyncio.to_thread(stoa, "worker", "list") == 0
    listed = capsys.readouterr().out
    assert "studio" in listed and "mini" in listed
