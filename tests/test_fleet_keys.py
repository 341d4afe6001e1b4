"""Worker keys on the way to a fleet: `macd join` on a signed run without a worker key warns that
its records will be refused, and `scripts/provision_fleet.sh` issues one worker key per host and
pins the run key (dry runs only: nothing here needs SSH)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from macd import config as cfg
from macd.cli import main as macd
from slime_stoa.cli import main as stoa
from slime_stoa.protocol.signing import read_key_file

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "provision_fleet.sh"
STOA = Path(sys.executable).with_name("stoa")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("MACD_CONFIG", "STOA_ENV_FILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return home


def make_run(tmp_path: Path, *, signed: bool) -> tuple[str, Path | None]:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    key = None
    args = ["run", "create", "--store", url, "--run", "demo", "--model", "m", "--task", "synthetic"]
    if signed:
        key = tmp_path / "keys" / "run.key"
        assert stoa(["keys", "create", str(key)]) == 0
        args += ["--key", str(key)]
    assert stoa(args) == 0
    return url, key


def join(url: str, conf: Path, *extra: str) -> int:
    return macd(["join", url, "--run", "demo", "--config", str(conf), "--data-dir", str(conf.parent / "data"), *extra])


def test_join_of_a_signed_run_without_a_worker_key_warns_in_one_line(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, key = make_run(tmp_path, signed=True)
    assert key is not None
    capsys.readouterr()
    conf = tmp_path / "conf" / "macd.toml"
    assert join(url, conf) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "refuse its records" in err[0], err
    assert "stoa worker add" in err[0] and "--worker-key" in err[0]
    assert cfg.load_config(conf).run_key == read_key_file(key).public.to_text()  # joined all the same
    issued = tmp_path / "mac.worker-key"
    assert stoa(["worker", "add", "mac", "--store", url, "--run", "demo", "--key", str(key), "--out", str(issued)]) == 0
    capsys.readouterr()
    assert join(url, conf, "--worker-key", str(issued)) == 0
    assert capsys.readouterr().err == ""


def test_join_of_an_unsigned_run_does_not_warn(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = make_run(tmp_path, signed=False)
    capsys.readouterr()
    assert join(url, tmp_path / "conf" / "macd.toml") == 0
    assert capsys.readouterr().err == ""


# -- scripts/provision_fleet.sh --------------------------------------------------------------------


def run_script(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, cwd=cwd)


def blocks(out: str) -> list[list[str]]:
    return [b.splitlines() for b in out.split("\n\n") if b.strip() and not b.startswith("# dry run")]


def test_script_issues_a_worker_key_per_host_and_pins_the_run_key(tmp_path: Path) -> None:
    key = tmp_path / "run.key"
    assert stoa(["keys", "create", str(key)]) == 0
    public = read_key_file(key).public.to_text()
    hosts, creds = tmp_path / "hosts", tmp_path / "creds.env"
    hosts.write_text("admin@10.0.0.5 mac-a\nadmin@mac-b.local\n")
    creds.write_text("AWS_ACCESS_KEY_ID=AKIA\nAWS_SECRET_ACCESS_KEY=secret\n")
    done = run_script("--bucket", "s3://b/p", "--run", "demo", "--package", "slime-stoa[worker]", "--key", str(key),
                      "--stoa", str(STOA), "--credentials-file", str(creds), "--dry-run", str(hosts), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "worker-keys-demo").exists()  # a dry run writes nothing
    for block, target, name in zip(blocks(done.stdout), ("admin@10.0.0.5", "admin@mac-b.local"), ("mac-a", "mac-b.local"),
                                   strict=True):
        local = f"worker-keys-demo/{target.replace('@', '_')}.worker-key"
        issue = shlex.split(block[1])
        assert issue[:4] == ["test", "-e", local, "||"] and issue[4] == f"STOA_ENV_FILE={creds}"
        assert issue[5:] == [str(STOA), "worker", "add", name, "--store", "s3://b/p", "--run", "demo", "--key", str(key),
                             "--out", local]
        copy = shlex.split(block[3])
        assert copy[0] == "scp" and copy[-4:] == [local, f"{target}:.stoa/worker-key.json", "<", "/dev/null"]
        joined = next(shlex.split(shlex.split(line)[6]) for line in block if " join " in line)
        assert joined[joined.index("--run-key") + 1] == public  # the key's public half, pinned
        assert joined[joined.index("--worker-key") + 1] == ".stoa/worker-key.json"
        assert joined[-4:] == ["&&", "rm", "-f", ".stoa/worker-key.json"]


def test_script_pins_a_given_run_key_without_issuing_keys(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("me@m1\n")
    text = "ed25519:" + "A" * 43
    done = run_script("--bucket", "s3://b/p", "--run", "demo", "--package", "x", "--run-key", text, "--dry-run", str(hosts))
    assert done.returncode == 0, done.stderr
    [block] = blocks(done.stdout)
    assert "worker add" not in done.stdout and "scp" not in done.stdout
    joined = shlex.split(shlex.split(block[3])[6])
    assert joined[-2:] == ["--run-key", text]


def test_script_key_option_errors(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("me@m1\n")
    base = ("--bucket", "s3://b/p", "--run", "demo", "--package", "x", "--dry-run")
    done = run_script(*base, "--run-key", "nope", str(hosts))
    assert done.returncode == 2 and "--run-key expects a public key" in done.stderr
    done = run_script(*base, "--worker-keys", "k", str(hosts))
    assert done.returncode == 2 and "--worker-keys needs --key" in done.stderr
    done = run_script(*base, "--key", str(tmp_path / "missing.key"), str(hosts))
    assert done.returncode == 1 and "run key file" in done.stderr and "does not exist" in done.stderr
    key = tmp_path / "run.key"
    assert stoa(["keys", "create", str(key)]) == 0
    done = run_script(*base, "--key", str(key), "--stoa", str(tmp_path / "no-stoa"), str(hosts))
    assert done.returncode == 1 and "--run-key TEXT" in done.stderr, done.stderr
