"""A command reached without the extra it needs (a base `pip install` of stoa: no torch, no MLX)
says in one line which package is missing and prints the command that adds its extra, which names
stoa's own distribution, never "stoa" (another project on the package index)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from slime_stoa.cli import main as stoa_main
from slime_stoa.protocol.extras import OPTIONAL, missing_line
from slime_stoa.protocol.shell import extra_install_command
from tests.hidden_modules import run_hiding


def run_without(hidden: str, program: str, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """`stoa` or `macd` with the modules named in `hidden` (comma-separated) not installed."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    entry = "slime_stoa.cli:main" if program == "stoa" else "macd.cli:main"
    return run_hiding(entry, args, hidden=hidden.split(","), env=env, timeout=300)


def test_the_line_names_the_package_and_the_extra() -> None:
    line = missing_line(ModuleNotFoundError("No module named 'mlx.core'", name="mlx.core"))
    assert line == f"mlx is not installed; it comes with stoa's [worker] extra: {extra_install_command('worker')}"
    line = missing_line(ModuleNotFoundError("No module named 'Stemmer'", name="Stemmer"))
    assert line is not None and line.startswith("PyStemmer is not installed; it comes with stoa's [worker] extra (or [trainer]): ")
    assert missing_line(ModuleNotFoundError("No module named 'slime_stoa.nope'", name="slime_stoa.nope")) is None
    assert missing_line(ModuleNotFoundError("no name")) is None
    assert extra_install_command("trainer") == f"{sys.executable} -m pip install 'slime-stoa[trainer]'"


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower().replace("_", "-")


def _requires(name: str) -> list[str]:
    """The requirements of distribution `name` as installed here (none when it is not)."""
    try:
        return importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return []


def test_every_optional_module_is_in_the_extras_it_names() -> None:
    """The table follows pyproject.toml: each package is no base dependency, and a requirement of
    each extra it names (or of one of its requirements: mlx comes with mlx-lm)."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    for module, found in OPTIONAL.items():
        assert found.package.lower() not in base, module
        for extra in found.extras:
            names = {_name(r) for r in project["optional-dependencies"][extra]}
            brought = {_name(r) for n in names for r in _requires(n)}
            assert found.package.lower() in names | brought, (module, extra)


def test_stoa_quickstart_without_torch_is_one_line(tmp_path: Path) -> None:
    done = run_without("torch", "stoa", "quickstart", "--out", str(tmp_path / "qs"), "--minutes", "1", home=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == f"error: {missing_line(ModuleNotFoundError(name='torch'))}"
    assert done.stdout == ""


def test_macd_join_without_the_worker_extra_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bucket").mkdir()
    store = f"file://{tmp_path / 'bucket'}"
    assert stoa_main(["run", "create", "--store", store, "--run", "r", "--model", "m", "--task", "synthetic"]) == 0
    capsys.readouterr()
    done = run_without("tomli_w", "macd", "join", store, "--run", "r", home=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: {missing_line(ModuleNotFoundError(name='tomli_w'))}"
    assert "Traceback" not in done.stderr
