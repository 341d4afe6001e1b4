"""`stoa fleet --run-key`: a run re-created with another key cannot vouch for its own heartbeats."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from slime_stoa.cli import main
from slime_stoa.cli.fleet_cmd import read_trusted_registry
from slime_stoa.cli.run_key_pin import parse_run_key
from slime_stoa.protocol.heartbeat import Heartbeat, read_fleet
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import Registry, add_worker, registry_bytes
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signing import SigningKey, write_key_file
from slime_stoa.protocol.store import Store, open_store

RUN = "pinned-run"


async def put_run(store: Store, run_key: SigningKey, worker_key: SigningKey) -> None:
    """A signed run whose registry, signed by `run_key`, registers mac-a with `worker_key`, and
    mac-a's heartbeat signed by it."""
    layout = RunLayout(RUN)
    manifest = RunManifest(run=RUN, model="tiny", task="synthetic", run_key=run_key.public.to_text())
    await store.put(layout.run_manifest, manifest.to_bytes(run_key))
    reg = add_worker(Registry(run=RUN), worker="mac-a", name="mac-a", key=worker_key.public, now=1.0)
    await store.put(layout.registry, registry_bytes(reg, run_key))
    beat = Heartbeat(worker_id="mac-a", name="mac-a", status="generating", tokens_per_s=1e9, version=1,
                     pointer_version=1, updated_at=time.time())  # fmt: skip
    await store.put(layout.heartbeat("mac-a"), beat.to_bytes(worker_key, run=RUN))


def test_a_run_key_is_pinned_by_its_text_fingerprint_key_id_or_a_file(tmp_path: Path) -> None:
    key = SigningKey.generate().public
    pem = write_key_file(tmp_path / "run.key", (private := SigningKey.generate()))
    pub = tmp_path / "run.pub"
    pub.write_text(key.to_text() + "\n")
    assert parse_run_key(key.to_text()).key == key
    assert parse_run_key(str(pub)).key == key
    assert parse_run_key(str(pem)).key == private.public
    for named in (key.fingerprint, key.key_id):
        pin = parse_run_key(named)
        assert pin.key is None and pin.matches(key) and not pin.matches(private.public)
    for bad in ("ed25519:short", str(tmp_path / "missing.key"), "SHA256:x"):
        with pytest.raises(ValueError, match=r"--run-key|public key"):
            parse_run_key(bad)
    os.chmod(pem, 0o644)
    with pytest.raises(ValueError, match=r"run\.key"):
        parse_run_key(str(pem))  # a private key readable by others is refused, as everywhere


async def test_a_re_keyed_runs_own_registry_cannot_vouch_for_its_heartbeats(tmp_path: Path) -> None:
    genuine, attacker, worker = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    async with open_store(f"file://{tmp_path}") as store:
        await put_run(store, attacker, worker)  # the whole run rewritten under the attacker's key
        manifest = RunManifest(run=RUN, model="tiny", task="synthetic", run_key=attacker.public.to_text())
        unpinned, problem = await read_trusted_registry(store, manifest)
        assert problem is None and unpinned is not None
        assert [t for _, t in (await read_fleet(store, RUN, unpinned))[0]] == ["signed"]  # what a pin prevents
        for pin in (genuine.public.to_text(), genuine.public.fingerprint):
            reg, problem = await read_trusted_registry(store, manifest, parse_run_key(pin))
            assert reg is not None and not reg.workers, pin
            assert problem is not None and "re-keyed" in problem and attacker.public.key_id in problem
            assert [t for _, t in (await read_fleet(store, RUN, reg))[0]] == ["unknown"]
        same, problem = await read_trusted_registry(store, manifest, parse_run_key(attacker.public.fingerprint))
        assert problem is None and same is not None and "mac-a" in same.workers  # the pinned key: as without


def test_stoa_fleet_run_key_shows_a_re_keyed_run_untrusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    genuine, attacker, worker = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()

    async def seed() -> None:
        async with open_store(f"file://{tmp_path}") as store:
            await put_run(store, attacker, worker)

    asyncio.run(seed())
    args = ["fleet", "--store", f"file://{tmp_path}", "--run", RUN]
    assert main(args) == 0
    assert "1 running" in capsys.readouterr().out
    assert main([*args, "--run-key", genuine.public.fingerprint]) == 0
    out = capsys.readouterr().out
    assert "0 running" in out and "re-keyed" in out and "1 untrusted" in out
    assert main([*args, "--run-key", "not-a-key"]) == 1
    assert "--run-key 'not-a-key'" in capsys.readouterr().err
