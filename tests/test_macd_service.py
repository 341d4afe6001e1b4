"""macd's config, `macd join`, the launchd agent (plist, launchctl commands, CLI) and the fleet
provisioning script (dry runs only: nothing here needs macOS, SSH or a network)."""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import stat
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest

from macd import config as cfg
from macd import service
from macd.cli import main as macd
from slime_stoa.cli import main as stoa
from slime_stoa.protocol.layout import check_worker_id

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "provision_fleet.sh"
SECRET = "s3cr3t-VALUE-never-shown"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME and config/data folders; no credentials from the real environment."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / ".local" / "share"))
    for name in ("MACD_CONFIG", "STOA_ENV_FILE", "STOA_ACCESS_KEY_ID", "STOA_SECRET_ACCESS_KEY",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture
def bucket(tmp_path: Path, home: Path) -> str:
    """A file:// bucket holding run `demo`."""
    root = tmp_path / "bucket"
    root.mkdir()
    url = f"file://{root}"
    assert stoa(["run", "create", "--store", url, "--run", "demo", "--model", "Qwen/Qwen2.5-0.5B-Instruct",
                 "--task", "gsm8k", "--group-size", "6"]) == 0
    return url


def make_config(**changes) -> cfg.DaemonConfig:
    values = dict(store="file:///tmp/b", run="demo", name="Mac mini", worker_id="mac-mini-a1b2c3",
                  data_dir=Path("/tmp/stoa-data"), batch=8)
    return cfg.DaemonConfig(**{**values, **changes})


def join(url: str, config: Path, *extra: str) -> int:
    return macd(["join", url, "--run", "demo", "--config", str(config), *extra])


# -- config -------------------------------------------------------------------------------------


def test_config_toml_round_trip(tmp_path: Path) -> None:
    config = make_config(credentials_file=tmp_path / "creds.env", max_decode=32, log_level="DEBUG")
    path = cfg.save_config(config, tmp_path / "conf" / "macd.toml")
    assert cfg.load_config(path) == config
    text = path.read_text()
    assert "# Stable id in the bucket's keys" in text and 'worker_id = "mac-mini-a1b2c3"' in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["macd.toml"]  # no temp files left
    assert "credentials_file" not in make_config().to_toml()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"batch": 0}, "batch"),
        ({"worker_id": "Mac_1"}, "invalid worker id"),
        ({"run": "bad run"}, "invalid run name"),
        ({"data_dir": Path("relative")}, "absolute"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"store": "ftp://x"}, "unsupported store URL"),
        ({"name": ""}, "worker name"),
    ],
)
def test_config_rejects_bad_values(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_config(**changes)


def test_config_file_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="macd join"):
        cfg.load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text(make_config().to_toml() + 'colour = "blue"\n')
    with pytest.raises(cfg.ConfigError, match=r"unknown key\(s\) \['colour'\]"):
        cfg.load_config(bad)
    bad.write_text("store = ")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.load_config(bad)


def test_default_paths() -> None:
    assert cfg.default_config_path({"MACD_CONFIG": "/etc/m.toml"}) == Path("/etc/m.toml")
    assert cfg.default_config_path({}, "darwin") == Path.home() / "Library/Application Support/stoa/macd.toml"
    assert cfg.default_config_path({"XDG_CONFIG_HOME": "/x"}, "linux") == Path("/x/stoa/macd.toml")
    assert cfg.credentials_path_for(Path("/c/macd.toml")) == Path("/c/macd.credentials.env")


def test_worker_ids() -> None:
    wid = cfg.new_worker_id("Mac mini (3)")
    assert re.fullmatch(r"mac-mini-3-[0-9a-f]{6}", wid)
    assert cfg.new_worker_id("Mac mini (3)") != wid
    assert check_worker_id(cfg.new_worker_id("x" * 100)) and len(cfg.new_worker_id("x" * 100)) == 48
    assert cfg.new_worker_id("!!!").startswith("mac-")


def test_credentials_file_is_private(tmp_path: Path) -> None:
    creds = cfg.credentials_from_env({"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": SECRET}, "test")
    path = cfg.write_credentials(tmp_path / "c.env", creds)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = make_config(credentials_file=path).read_credentials()
    assert (back.access_key_id, back.secret_access_key, back.source) == ("AKIA1", SECRET, str(path))
    with pytest.raises(ValueError, match="half of the key pair"):
        cfg.credentials_from_env({"AWS_ACCESS_KEY_ID": "AKIA1"}, "test")


def test_memory_estimate() -> None:
    est = cfg.estimate_memory(elements=1_000_000_000, plane="bf16", sequences=10, tokens_per_sequence=100,
                              kv_bytes_per_token=1000)
    assert (est.weights, est.kv_cache, est.kv_guessed) == (2_000_000_000, 1_000_000, False)
    # int8 keeps the bf16 master (2 B) beside the served int8 copy (1.0625 B)
    assert cfg.estimate_memory(elements=1000, plane="int8", sequences=1, tokens_per_sequence=1).weights == 3063
    assert est.verdict(64 * 2**30) == "fits" and est.verdict(2 * 2**30) == "too big"
    qwen_7b = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584}
    assert cfg.kv_bytes_per_token(qwen_7b) == 2 * 28 * 4 * 128 * 2
    assert cfg.elements_from_model_name("Qwen/Qwen2.5-1.5B-Instruct") == 1_500_000_000


# -- macd join ----------------------------------------------------------------------------------


def test_join_writes_config_and_describes_the_work(bucket: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "conf" / "macd.toml"
    assert join(bucket, path, "--name", "Mac A", "--data-dir", str(tmp_path / "data")) == 0
    out = capsys.readouterr().out
    for text in ("Qwen/Qwen2.5-0.5B-Instruct (bf16 plane)", "gsm8k", "group size   6 samples per prompt",
                 "none published yet", "memory", f"next: macd install --config {path} && macd start",
                 f"macd run --config {path}"):
        assert text in out
    config = cfg.load_config(path)
    assert (config.store, config.run, config.name, config.credentials_file) == (bucket, "demo", "Mac A", None)
    assert config.worker_id.startswith("mac-a-") and config.data_dir == tmp_path / "data"


def test_rejoin_keeps_the_worker_id(bucket: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "macd.toml"
    assert join(bucket, path, "--name", "first") == 0
    first = cfg.load_config(path)
    assert join(bucket, path, "--batch", "3") == 0  # same run: same id, name kept, batch changed
    again = cfg.load_config(path)
    assert (again.worker_id, again.name, again.batch) == (first.worker_id, "first", 3)
    assert "same id as before" in capsys.readouterr().out
    assert stoa(["run", "create", "--store", bucket, "--run", "other", "--model", "m", "--task", "synthetic"]) == 0
    assert macd(["join", bucket, "--run", "other", "--config", str(path)]) == 0
    assert cfg.load_config(path).worker_id != first.worker_id


def test_join_with_a_fixed_worker_id(bucket: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "macd.toml"
    assert join(bucket, path, "--worker-id", "slot-7", "--name", "Slot 7") == 0
    assert "worker slot-7 (new id)" in capsys.readouterr().out
    assert cfg.load_config(path).worker_id == "slot-7"
    assert join(bucket, path, "--worker-id", "slot-7", "--no-check") == 0
    assert "worker slot-7 (same id as before)" in capsys.readouterr().out
    assert join(bucket, path) == 0  # without the flag a re-join keeps it too
    assert cfg.load_config(path).worker_id == "slot-7"


def test_join_rejects_a_bad_worker_id_in_one_line(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "macd.toml"
    done = subprocess.run(
        [sys.executable, "-m", "macd", "join", f"file://{tmp_path}", "--run", "demo", "--config", str(path),
         "--worker-id", "Not_An_Id", "--no-check"],
        capture_output=True, text=True, env=os.environ, cwd=REPO, timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: invalid worker id 'Not_An_Id'") and done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr and not path.exists()


def test_join_stores_a_relative_folder_url_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`macd join file://bucket` in one folder; the daemon and `macd doctor` run from others."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bucket").mkdir()
    path = tmp_path / "macd.toml"
    assert macd(["join", "file://bucket", "--run", "demo", "--config", str(path), "--no-check"]) == 0
    assert cfg.load_config(path).store == f"file://{tmp_path / 'bucket'}"


def test_join_piped_into_head_is_not_a_traceback(bucket: str, tmp_path: Path) -> None:
    """`macd join ... | head`: the reader is gone before macd writes (a pipe whose read end is
    closed: every write fails with EPIPE); macd ends quietly, without a traceback."""
    cmd = [sys.executable, "-m", "macd", "join", bucket, "--run", "demo", "--config", str(tmp_path / "m.toml")]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(cmd, stdout=write_end, stderr=subprocess.PIPE, text=True, env=os.environ, cwd=REPO,
                              timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_join_missing_run(bucket: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "macd.toml"
    assert macd(["join", bucket, "--run", "nope", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "run 'nope' does not exist" in err and "stoa run create" in err
    assert not path.exists()


def test_join_refuses_a_run_of_an_unknown_task(bucket: str, tmp_path: Path, capsys) -> None:
    import json

    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.tasks import TASKS

    manifest = Path(bucket.removeprefix("file://")) / RunLayout("demo").run_manifest
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "task": "gsm9k"}))
    path = tmp_path / "macd.toml"
    assert join(bucket, path) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    assert "'gsm9k'" in lines[0] and all(name in lines[0] for name in TASKS), lines[0]
    assert not path.exists()
    assert join(bucket, path, "--no-check") == 0  # not contacting the bucket: nothing to check


def test_join_missing_bucket(home: Path, tmp_path: Path, capsys) -> None:
    assert join(f"file://{tmp_path}/no-such-bucket", tmp_path / "macd.toml") == 1
    assert "does not exist" in capsys.readouterr().err
    assert join("ftp://nowhere", tmp_path / "macd.toml") == 1
    assert "unsupported store URL" in capsys.readouterr().err


def test_join_with_published_weights(bucket: str, tmp_path: Path, monkeypatch, capsys) -> None:
    from slime_stoa.quickstart.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    monkeypatch.setenv("STOA_STORE", bucket)
    monkeypatch.setenv("STOA_RUN", "demo")
    assert stoa(["weights", "publish-anchor", str(model)]) == 0
    capsys.readouterr()
    assert join(bucket, tmp_path / "macd.toml") == 0
    out = capsys.readouterr().out
    assert re.search(r"weights +v0 \([\d,]+ weights\)", out)
    assert "KV 0 KiB/token (attention layers)" in out and "(guess" not in out  # from the anchor's config.json
    assert "memory plan  device: " in out and "model: 0.00B parameters" in out  # the plan, for this device ...
    assert "\n  memory       " not in out  # ... alone


def test_join_credentials_go_to_a_private_file(home: Path, tmp_path: Path, capsys) -> None:
    url = "s3://stoa-bucket/runs?endpoint=http://127.0.0.1:9"
    path = tmp_path / "macd.toml"
    assert join(url, path, "--access-key-id", "AKIATEST", "--secret-access-key", SECRET, "--no-check") == 0
    out = capsys.readouterr()
    creds_file = cfg.credentials_path_for(path)
    assert stat.S_IMODE(creds_file.stat().st_mode) == 0o600
    assert f"AWS_SECRET_ACCESS_KEY={SECRET}" in creds_file.read_text()
    assert SECRET not in path.read_text() and "AKIATEST" not in path.read_text()
    assert SECRET not in out.out + out.err
    assert cfg.load_config(path).credentials_file == creds_file
    # Re-joining without credentials keeps the file; the worker id stays.
    wid = cfg.load_config(path).worker_id
    assert join(url, path, "--no-check") == 0
    assert cfg.load_config(path).credentials_file == creds_file and cfg.load_config(path).worker_id == wid


def test_join_reads_credentials_from_stdin(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "macd.toml"
    done = subprocess.run(
        [sys.executable, "-m", "macd.cli", "join", "s3://stoa-bucket?endpoint=http://127.0.0.1:9",
         "--run", "demo", "--config", str(path), "--credentials-stdin", "--no-check"],
        input=f"AWS_ACCESS_KEY_ID=AKIASTDIN\nAWS_SECRET_ACCESS_KEY={SECRET}\n",
        capture_output=True, text=True, env=os.environ, cwd=REPO, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr and SECRET not in path.read_text()
    assert cfg.load_config(path).read_credentials().access_key_id == "AKIASTDIN"


def test_join_s3_checks(home: Path, tmp_path: Path, s3_server, s3_bucket: str, monkeypatch, capsys) -> None:
    """Against a real S3 server: bad credentials and a missing bucket are named, secrets never shown."""
    url = f"s3://{s3_bucket}/t-join?endpoint={s3_server.endpoint_url}"
    path = tmp_path / "macd.toml"
    assert join(url, path, "--access-key-id", "AKIAWRONG", "--secret-access-key", SECRET) == 1
    err = capsys.readouterr().err
    assert "check the credentials" in err and SECRET not in err and not path.exists()

    good = s3_server.credentials()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", good.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", good.secret_access_key)
    missing = f"s3://no-such-bucket-{os.getpid()}/x?endpoint={s3_server.endpoint_url}"
    assert macd(["join", missing, "--run", "demo", "--config", str(path)]) == 1
    assert "does not exist" in capsys.readouterr().err

    assert stoa(["run", "create", "--store", url, "--run", "demo", "--model", "m", "--task", "synthetic"]) == 0
    assert join(url, path) == 0  # credentials from the environment, saved for the agent
    out = capsys.readouterr().out
    assert "group size" in out and good.secret_access_key not in out
    assert cfg.load_config(path).read_credentials().access_key_id == good.access_key_id


# -- the plist and launchctl ----------------------------------------------------------------------


def test_plist_round_trip() -> None:
    plist = service.build_plist(
        label="dev.stoa.macd",
        config_path=Path("/Users/u/cfg/macd.toml"),
        python=sys.executable,
        working_dir=Path("/Users/u/data"),
        log_file=Path("/Users/u/Library/Logs/stoa/macd.log"),
    )
    assert plistlib.loads(service.plist_bytes(plist)) == {
        "Label": "dev.stoa.macd",
        "ProgramArguments": [sys.executable, "-m", "macd", "run", "--config", "/Users/u/cfg/macd.toml"],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart after a crash, not after a clean stop
        "ThrottleInterval": 30,
        "ExitTimeOut": 60,
        "ProcessType": "Standard",
        "LimitLoadToSessionType": ["Aqua", "Background"],
        "WorkingDirectory": "/Users/u/data",
        "StandardOutPath": "/Users/u/Library/Logs/stoa/macd.log",
        "StandardErrorPath": "/Users/u/Library/Logs/stoa/macd.log",
        "EnvironmentVariables": {"PATH": f"{Path(sys.executable).parent}:{service.SYSTEM_PATH}",
                                 "PYTHONUNBUFFERED": "1"},
        "Umask": 0o077,
    }


def test_plist_rejects_bad_input() -> None:
    args = dict(label="l", config_path=Path("/c"), python="/p", working_dir=Path("/w"), log_file=Path("/l"))
    with pytest.raises(ValueError, match="python must be an absolute path"):
        service.build_plist(**{**args, "python": "python3"})
    with pytest.raises(ValueError, match="process_type"):
        service.build_plist(**args, process_type="Turbo")


def test_agent_names_and_launchctl_commands() -> None:
    agent = service.agent_for(domain_kind="gui", uid=501, home=Path("/Users/u"))
    plist = "/Users/u/Library/LaunchAgents/dev.stoa.macd.plist"
    assert (agent.label, str(agent.plist), str(agent.log)) == (
        "dev.stoa.macd", plist, "/Users/u/Library/Logs/stoa/macd.log")
    assert service.bootstrap_cmd(agent) == ["launchctl", "bootstrap", "gui/501", plist]
    assert service.bootout_cmd(agent) == ["launchctl", "bootout", "gui/501/dev.stoa.macd"]
    assert service.kickstart_cmd(agent) == ["launchctl", "kickstart", "-k", "gui/501/dev.stoa.macd"]
    assert service.kickstart_cmd(agent, kill=False) == ["launchctl", "kickstart", "gui/501/dev.stoa.macd"]
    assert service.print_cmd(agent) == ["launchctl", "print", "gui/501/dev.stoa.macd"]
    assert service.enable_cmd(agent) == ["launchctl", "enable", "gui/501/dev.stoa.macd"]
    assert service.disable_cmd(agent) == ["launchctl", "disable", "gui/501/dev.stoa.macd"]
    second = service.agent_for("b2", domain_kind="user", uid=501, home=Path("/Users/u"))
    assert (second.service, second.log.name) == ("user/501/dev.stoa.macd.b2", "macd.b2.log")
    assert service.auto_domain_kind(501, 501) == "gui" and service.auto_domain_kind(501, 0) == "user"
    with pytest.raises(ValueError, match="instance"):
        service.label_for("Bad Name")


def test_parse_launchctl_print() -> None:
    text = (
        "gui/501/dev.stoa.macd = {\n\tactive count = 1\n\tpath = /Users/u/Library/LaunchAgents/dev.stoa.macd.plist\n"
        "\ttype = LaunchAgent\n\tstate = running\n\n\tprogram = /usr/bin/python3\n\targuments = {\n"
        "\t\t/usr/bin/python3\n\t}\n\tenvironment = {\n\t\tstate = nested-ignored\n\t}\n\truns = 3\n"
        "\tpid = 4242\n\tlast exit code = 1\n\tlast terminating signal = Terminated: 15\n}\n"
    )
    got = service.parse_print(text)
    assert (got.state, got.pid, got.runs, got.last_exit, got.last_signal) == (
        "running", 4242, 3, "1", "Terminated: 15")
    assert got.running
    assert service.parse_print("x = {\n\tstate = not running\n\tlast exit code = (never exited)\n}").pid is None


def test_cli_dry_runs_print_the_commands(bucket: str, home: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "macd.toml"
    assert join(bucket, path) == 0
    capsys.readouterr()
    uid, plist = os.getuid(), home / "Library" / "LaunchAgents" / "dev.stoa.macd.plist"
    assert macd(["install", "--dry-run", "--domain", "gui", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    xml = out[out.index("<?xml"): out.index("</plist>") + len("</plist>")]
    assert plistlib.loads(xml.encode())["ProgramArguments"] == [sys.executable, "-m", "macd", "run", "--config", str(path)]
    assert f"launchctl bootstrap gui/{uid} {plist}\n" in out
    assert not plist.exists()  # a dry run writes nothing

    assert macd(["start", "--dry-run", "--domain", "gui"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"launchctl enable gui/{uid}/dev.stoa.macd",
        f"launchctl bootstrap gui/{uid} {plist}",
        "# when it is already loaded, instead of bootstrap (a restart):",
        f"launchctl kickstart -k gui/{uid}/dev.stoa.macd",
    ]
    assert macd(["stop", "--dry-run", "--domain", "user"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"launchctl bootout user/{uid}/dev.stoa.macd", f"launchctl disable user/{uid}/dev.stoa.macd"]
    assert macd(["status", "--dry-run", "--domain", "gui", "--instance", "two"]) == 0
    assert capsys.readouterr().out == f"launchctl print gui/{uid}/dev.stoa.macd.two\n"


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS has launchctl")
def test_without_launchctl_the_error_says_what_to_do(bucket: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "macd.toml"
    assert join(bucket, path) == 0
    capsys.readouterr()
    for command in (["start"], ["stop"], ["install", "--config", str(path)], ["uninstall"]):
        assert macd(command) == 1
        assert service.LAUNCHCTL_MISSING in capsys.readouterr().err
    assert macd(["status", "--config", str(path)]) == 3  # no launchd: the heartbeat decides, and there is none
    out = capsys.readouterr().out
    assert "launchd agents are macOS-only" in out and "heartbeat  none yet in the bucket" in out
    assert "Library" not in out and "journalctl --user" in out  # no macOS log path on this system


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS has launchctl")
@pytest.mark.parametrize("beat, rc", [
    (dict(status="generating", age=2, tokens_per_s=106.0), 0),
    (dict(status="stopped", age=60), 3),
    (dict(status="generating", age=600, tokens_per_s=106.0), 3),  # silent
])
def test_status_without_launchd_is_the_heartbeats(
    bucket: str, tmp_path: Path, capsys, beat: dict, rc: int
) -> None:
    import time

    path = tmp_path / "worker" / "macd.toml"
    path.parent.mkdir()
    assert join(bucket, path) == 0
    (path.parent / "macd.log").write_text("cohort 1: v0, 4 groups\ncohort 2: v0, 4 groups\n")
    config = cfg.load_config(path)
    age = beat.pop("age")
    _write_heartbeat(bucket, config, version=0, updated_at=time.time() - age, **beat)
    capsys.readouterr()
    assert macd(["status", "--config", str(path)]) == rc
    out = capsys.readouterr().out
    assert f"log        {path.parent / 'macd.log'}, last lines:" in out and "  cohort 2: v0, 4 groups" in out
    assert "Library" not in out


def test_status_before_the_first_cohort_does_not_say_0_tok_s() -> None:
    import time

    from macd.service_cmd import heartbeat_line
    from slime_stoa.protocol.heartbeat import Heartbeat

    now = time.time()
    beat = Heartbeat(worker_id="w", name="w", status="generating", version=1, updated_at=now)
    line = heartbeat_line(beat, now, 1)
    assert "0 tok/s" not in line and "tok/s not measured yet" in line
    assert "106 tok/s" in heartbeat_line(Heartbeat(**{**beat.__dict__, "tokens_per_s": 106.0}), now, 1)


def _publish_versions(url: str, run: str, count: int) -> None:
    import asyncio

    import numpy as np

    from slime_stoa.protocol.pulse.publisher import Publisher
    from slime_stoa.protocol.store import open_store

    async def publish() -> None:
        state = {"w": np.arange(64, dtype=np.uint16)}
        async with open_store(url) as store:
            pub = Publisher(store, run)
            for _ in range(count):
                await pub.publish(dict(state))
                state["w"] = state["w"] ^ np.uint16(1)

    asyncio.run(publish())


def _write_heartbeat(url: str, config: cfg.DaemonConfig, **fields) -> None:
    import asyncio

    from slime_stoa.protocol.heartbeat import Heartbeat
    from slime_stoa.protocol.layout import RunLayout
    from slime_stoa.protocol.store import open_store

    async def put() -> None:
        beat = Heartbeat(worker_id=config.worker_id, name=config.name, **fields)
        async with open_store(url) as store:
            await store.put(RunLayout(config.run).heartbeat(config.worker_id), beat.to_bytes())

    asyncio.run(put())


@pytest.mark.parametrize(
    "beat, expected, not_expected",
    [
        # Stopped two hours ago at v1 (and it had seen v1: "lag 0" by its own account): stopped.
        (dict(status="stopped", version=1, pointer_version=1, age=7200, groups_uploaded=9),
         "2.0h ago: stopped, held v1; the run is at v3, 9 groups uploaded", "lag"),
        # Said "generating", then nothing for 5 minutes (killed): silent, not running.
        (dict(status="generating", version=2, pointer_version=2, age=300, tokens_per_s=800.0),
         "5m ago: silent (no heartbeat since; it said 'generating'), held v2; the run is at v3", "lag"),
        # Running: lag against the run's current version, not the pointer it last saw.
        (dict(status="generating", version=2, pointer_version=2, age=2, tokens_per_s=812.0),
         "2s ago: generating, v2, lag 1; the run is at v3, 812 tok/s", "silent"),
    ],
)
def test_status_shows_the_worker_as_fleet_does(
    bucket: str, tmp_path: Path, capsys, beat: dict, expected: str, not_expected: str
) -> None:
    import time

    path = tmp_path / "macd.toml"
    assert join(bucket, path) == 0
    config = cfg.load_config(path)
    _publish_versions(bucket, "demo", 4)  # v0..v3
    age = beat.pop("age")
    _write_heartbeat(bucket, config, updated_at=time.time() - age, **beat)
    capsys.readouterr()
    rc = macd(["status", "--config", str(path)])
    assert rc in (0, 3)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    line = next(x for x in captured.out.splitlines() if x.startswith("heartbeat  "))
    assert expected in line and not_expected not in line, line


def test_logs(home: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert macd(["logs"]) == 1
    err = capsys.readouterr().err
    assert "no log at" in err and "`macd start`" in err
    monkeypatch.setattr(sys, "platform", "linux")
    assert macd(["logs"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no log at"), err
    assert "macOS-only" in err and "`macd run` in the foreground" in err and "systemd" in err
    log = service.log_path(service.BASE_LABEL)
    log.parent.mkdir(parents=True)
    log.write_text("one\ntwo\nthree\n")
    assert macd(["logs", "-n", "2"]) == 0
    assert capsys.readouterr().out == "two\nthree\n"

    calls, out = [], StringIO()

    def stop() -> bool:  # append once, then let follow read it, then stop
        calls.append(1)
        if len(calls) == 1:
            with open(log, "a") as f:
                f.write("four\n")
        return len(calls) > 2

    service.follow(log, out, poll_s=0.01, stop=stop)
    assert out.getvalue() == "four\n"


# -- scripts/provision_fleet.sh -------------------------------------------------------------------


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STOA_"))}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=30)


def test_script_syntax() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_script_dry_run(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("# the fleet\nadmin@10.0.0.5 mac-a\n\n  admin@mac-b.local   # no name\n")
    url = "r2://0123456789abcdef0123456789abcdef/stoa-runs"
    done = run_script("--bucket", url, "--run", "demo", "--package", "slime-stoa[worker]", "--dry-run", str(hosts),
                      env={"AWS_ACCESS_KEY_ID": "AKIAFLEET", "AWS_SECRET_ACCESS_KEY": SECRET})
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr and "AKIAFLEET" not in done.stdout
    blocks = [b for b in done.stdout.split("\n\n") if b.strip()]
    assert blocks[0].startswith("# admin@10.0.0.5 (mac-a)") and blocks[1].startswith("# admin@mac-b.local")
    assert "nothing was contacted" in blocks[2]
    for block, target, name in ((blocks[0], "admin@10.0.0.5", ["--name", "mac-a"]), (blocks[1], "admin@mac-b.local", [])):
        remote = []
        for line in block.splitlines()[1:]:
            words = shlex.split(line)
            ssh = words.index("ssh")
            assert words[ssh + 1: ssh + 6] == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=20", target]
            remote.append(shlex.split(words[ssh + 6]))
        assert len(remote) == 5
        assert remote[0][-4:] == ["python3", "-m", "venv", ".stoa/venv"]
        assert remote[1][-1] == "slime-stoa[worker]"
        assert remote[2] == [".stoa/venv/bin/macd", "join", url, "--run", "demo", *name, "--credentials-stdin"]
        assert remote[3:] == [[".stoa/venv/bin/macd", "install"], [".stoa/venv/bin/macd", "start"]]
        join_line = block.splitlines()[3]
        assert join_line.startswith("printf ") and '"$AWS_SECRET_ACCESS_KEY" | ssh' in join_line


def test_script_needs_a_wheel_or_a_package(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("me@m1\n")
    done = run_script("--bucket", "s3://b/p", "--run", "demo", "--dry-run", str(hosts))
    assert done.returncode == 2 and "pip wheel --no-deps -w dist ." in done.stderr, done.stderr


def test_script_dry_run_with_wheel_and_credentials_file(tmp_path: Path) -> None:
    hosts, wheel, creds = tmp_path / "hosts", tmp_path / "stoa-0.1.0-py3-none-any.whl", tmp_path / "creds.env"
    hosts.write_text("me@m1\n")
    wheel.write_bytes(b"")
    creds.write_text(f"AWS_ACCESS_KEY_ID=AKIA\nAWS_SECRET_ACCESS_KEY={SECRET}\n")
    done = run_script("--bucket", "s3://b/p", "--run", "demo", "--wheel", str(wheel), "--credentials-file",
                      str(creds), "--python", "/opt/homebrew/bin/python3.12", "--dry-run", str(hosts))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert SECRET not in done.stdout
    assert shlex.split(lines[2]) == ["scp", "-q", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", str(wheel),
                                     "me@m1:.stoa/", "<", "/dev/null"]
    assert ".stoa/stoa-0.1.0-py3-none-any.whl[worker]" in lines[3] and "/opt/homebrew/bin/python3.12" in lines[1]
    assert lines[4].endswith(f"--credentials-stdin' < {creds}")


def test_script_usage_errors(tmp_path: Path) -> None:
    done = run_script()
    assert done.returncode == 2 and "usage: provision_fleet.sh --bucket URL --run RUN" in done.stderr
    done = run_script("--bucket", "s3://b", str(tmp_path / "hosts"))
    assert done.returncode == 2 and "--run RUN is required" in done.stderr
    done = run_script("--bucket", "s3://b", "--run", "r", "--bogus", "x")
    assert done.returncode == 2 and "unknown option --bogus" in done.stderr
    pkg = ("--package", "slime-stoa[worker]")
    done = run_script("--bucket", "s3://b", "--run", "r", *pkg, "--dry-run", str(tmp_path / "missing"))
    assert done.returncode == 1 and "hosts file" in done.stderr and "does not exist" in done.stderr
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n")
    done = run_script("--bucket", "s3://b", "--run", "r", *pkg, "--dry-run", str(empty))
    assert done.returncode == 1 and "no hosts in" in done.stderr
    bad = tmp_path / "bad"
    bad.write_text("a@b name extra\n")
    done = run_script("--bucket", "s3://b", "--run", "r", *pkg, "--dry-run", str(bad))
    assert done.returncode == 1 and "line 1" in done.stderr
