"""`stoa keys create|show|rotate`, `stoa run create --key`, and `macd join` pinning the run key and
installing a worker key; DaemonConfig's run_key / worker_key."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from macd import config as cfg
from macd.cli import main as macd
from slime_stoa.cli import main as stoa
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_pointer
from slime_stoa.protocol.pulse.publisher import Publisher, UntrustedState
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, load_rotations
from slime_stoa.protocol.signing import read_key_file
from slime_stoa.protocol.store import open_store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, read_worker_key_file, write_worker_key_file

from .forged_weights import random_state, step_state

RUN = "keyed"


@pytest.fixture
def env(store_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    return store_env


def _create_key(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str]:
    path = tmp_path / "keys" / name
    assert stoa(["keys", "create", str(path)]) == 0
    out = capsys.readouterr().out
    text = next(line.split()[-1] for line in out.splitlines() if line.startswith("public key"))
    return path, text


def _create_run(store_url: str, key_path: Path) -> int:
    """`stoa run create` of a synthetic-task run signed with the key at `key_path`."""
    return stoa(["run", "create", "--store", store_url, "--run", RUN, "--model", "m", "--task", "synthetic",
                 "--key", str(key_path)])


def test_keys_create_and_show_never_print_the_private_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, text = _create_key(tmp_path, "run.key", capsys)
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = read_key_file(path)
    assert text == key.public.to_text()
    assert stoa(["keys", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert key.key_id in out and key.public.fingerprint in out and "PRIVATE" not in out
    assert stoa(["keys", "create", str(path)]) == 1  # never overwrites a key
    assert "refusing to overwrite" in capsys.readouterr().err
    path.chmod(0o644)
    assert stoa(["keys", "show", str(path)]) == 1
    assert "chmod 600" in capsys.readouterr().err


def test_run_create_with_a_key_signs_the_manifest(
    store_url: str, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, text = _create_key(tmp_path, "run.key", capsys)
    assert _create_run(store_url, path) == 0
    assert "signed with run key" in capsys.readouterr().out

    async def check() -> None:
        async with open_store(store_url) as store:
            manifest = await read_run_manifest(store, RUN, pinned=text)
            assert manifest.run_key == text
            assert "signature" in json.loads(await store.get_bytes(RunLayout(RUN).run_manifest))

    asyncio.run(check())


def test_keys_rotate_announces_the_new_key_and_re_signs_the_pointer(
    store_url: str, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old_path, old_text = _create_key(tmp_path, "old.key", capsys)
    new_path, _ = _create_key(tmp_path, "new.key", capsys)
    assert _create_run(store_url, old_path) == 0
    old, new = read_key_file(old_path), read_key_file(new_path)
    rng = np.random.default_rng(0)
    state = random_state(rng)

    async def publish_two() -> None:
        async with open_store(store_url) as store:
            pub = Publisher(store, RUN, key=old)
            await pub.publish(state)
            await pub.publish(step_state(state, rng))

    asyncio.run(publish_two())
    rotate = ["keys", "rotate", "--store", store_url, "--run", RUN]
    assert stoa([*rotate, "--old", str(new_path), "--new", str(old_path)]) == 1  # not the current key
    assert "not run" in capsys.readouterr().err
    assert stoa([*rotate, "--old", str(old_path), "--new", str(new_path)]) == 0
    assert "every version after v1" in capsys.readouterr().out

    async def after() -> None:
        async with open_store(store_url) as store:
            trust = RunTrust.from_text(RUN, old_text)
            assert await load_rotations(store, trust) == 1 and trust.newest == new.public
            assert (await read_pointer(store, RUN, trust=trust)).version == 1
            with pytest.raises(UntrustedState):
                await Publisher(store, RUN, key=old).open()
            pub = Publisher(store, RUN, key=new)
            assert await pub.open() == 1
            await pub.publish(step_state(state, rng, density=0.1))
            follower = Subscriber(store, RUN, trust=RunTrust.from_text(RUN, old_text))
            assert (await follower.sync()) is not None and follower.version == 2

    asyncio.run(after())


def _join(url: str, config: Path, *extra: str) -> int:
    return macd(["join", url, "--run", RUN, "--config", str(config), "--data-dir", str(config.parent / "data"), *extra])


def test_macd_join_pins_the_run_key_and_installs_a_worker_key(
    store_url: str, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, text = _create_key(tmp_path, "run.key", capsys)
    _, other_text = _create_key(tmp_path, "other.key", capsys)
    assert _create_run(store_url, key_path) == 0
    capsys.readouterr()
    conf = tmp_path / "conf" / "macd.toml"
    # Trust on first use, with the fingerprint printed.
    assert _join(store_url, conf) == 0
    out = capsys.readouterr().out
    key = read_key_file(key_path)
    assert "trusted on first use" in out and key.public.fingerprint in out
    assert cfg.load_config(conf).run_key == text
    # An explicit key that differs from the manifest's: refused, config unchanged.
    assert _join(store_url, conf, "--run-key", other_text) == 1
    assert "pinned key" in capsys.readouterr().err and cfg.load_config(conf).run_key == text
    # A worker key: installed 0600 beside the config; sets the worker id.
    issued = write_worker_key_file(tmp_path / "issued.json", WorkerKeyFile(run=RUN, worker="mac-one-abc123", key=key))
    assert _join(store_url, conf, "--worker-key", str(issued)) == 0
    capsys.readouterr()
    config = cfg.load_config(conf)
    assert config.worker_id == "mac-one-abc123" and config.run_key == text
    installed = Path(config.worker_key)
    assert installed.parent == conf.parent and os.stat(installed).st_mode & 0o777 == 0o600
    assert read_worker_key_file(installed).worker == "mac-one-abc123"
    # A worker key for another run is refused.
    wrong = write_worker_key_file(tmp_path / "wrong.json", WorkerKeyFile(run="other-run", worker="mac-two-abc123", key=key))
    assert _join(store_url, conf, "--worker-key", str(wrong)) == 1
    assert "is for run 'other-run'" in capsys.readouterr().err


def test_daemon_config_keys_round_trip_through_toml(tmp_path: Path) -> None:
    from slime_stoa.protocol.signing import SigningKey

    text = SigningKey.generate().public.to_text()
    config = cfg.DaemonConfig(store="file:///tmp/b", run=RUN, name="mac", worker_id="mac-a1b2c3",
                              data_dir=Path("/tmp/data"), batch=2, run_key=text, worker_key="/tmp/k.json")
    path = cfg.save_config(config, tmp_path / "macd.toml")
    assert cfg.load_config(path) == config and "run_key" in path.read_text()
    bare = cfg.DaemonConfig(store="file:///tmp/b", run=RUN, name="mac", worker_id="mac-a1b2c3",
                            data_dir=Path("/tmp/data"), batch=2)
    assert "run_key" not in cfg.save_config(bare, tmp_path / "bare.toml").read_text()
    bads: list[dict[str, Any]] = [{"run_key": "rsa:abc"}, {"worker_key": "relative/k.json"}]
    for bad in bads:
        with pytest.raises(ValueError):
            cfg.DaemonConfig(store="file:///tmp/b", run=RUN, name="mac", worker_id="mac-a1b2c3",
                             data_dir=Path("/tmp/data"), batch=2, **bad)


def test_preflight_checks_the_trainers_run_key(tmp_path: Path) -> None:
    import argparse

    from slime_stoa.protocol.run_manifest import RunManifest
    from slime_stoa.protocol.signing import SigningKey, write_key_file
    from slime_stoa.trainer.slime.preflight import check_run_key

    key, other = SigningKey.generate(), SigningKey.generate()
    path, wrong = write_key_file(tmp_path / "run.key", key), write_key_file(tmp_path / "other.key", other)
    signed = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    unsigned = RunManifest(run=RUN, model="m", task="synthetic")

    def status(manifest: RunManifest, value: object) -> tuple[str, str]:
        finding = check_run_key(argparse.Namespace(stoa_publish=True, stoa_run_key=value), manifest)
        return finding.status, finding.message

    assert status(signed, str(path))[0] == "ok"
    assert status(unsigned, None)[0] == "ok"
    assert status(signed, None)[0] == "fix" and "set stoa_run_key" in status(signed, None)[1]
    assert status(signed, str(wrong))[0] == "fix" and "use the run's key file" in status(signed, str(wrong))[1]
    assert status(unsigned, str(path))[0] == "fix"
    assert "no such key file" in status(signed, str(tmp_path / "missing.key"))[1]
    path.chmod(0o640)
    assert "chmod 600" in status(signed, str(path))[1]


def test_weights_verify_checks_a_signed_run_and_refuses_a_forgery(
    store_url: str, env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, text = _create_key(tmp_path, "run.key", capsys)
    assert _create_run(store_url, path) == 0
    key = read_key_file(path)
    rng = np.random.default_rng(1)
    state = random_state(rng)

    async def publish(signer) -> None:
        async with open_store(store_url) as store:
            pub = Publisher(store, RUN, key=signer)
            await pub.open()
            await pub.publish(state if pub.version is None else step_state(state, rng))

    asyncio.run(publish(key))
    capsys.readouterr()
    assert stoa(["weights", "verify", "--store", store_url, "--run", RUN, "--run-key", text]) == 0
    assert "weights OK" in capsys.readouterr().out
    asyncio.run(publish(None))  # an unsigned v1 (anyone with a token), pointer moved
    assert stoa(["weights", "verify", "--store", store_url, "--run", RUN]) == 1
    assert "not signed" in capsys.readouterr().err
