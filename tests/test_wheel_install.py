"""The wheel a Mac operator builds (`pip wheel --no-deps .`, README) installs with the `worker`
extra into a fresh virtual environment, and `macd` and `stoa` run from there.

Real pip against the package index (its cache makes repeats fast). Skipped, saying so, only
when the index pip would use does not answer; any other failure fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "slime_stoa", "macd")  # what the build reads
DEFAULT_INDEX = "https://pypi.org/simple"


def index_url() -> str:
    """The index pip installs from here: $PIP_INDEX_URL, else pip's configured index-url, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        done = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                              capture_output=True, text=True, timeout=60)
        url = done.stdout.strip() if done.returncode == 0 else ""
    return (url.split()[0] if url else DEFAULT_INDEX).rstrip("/")


def unreachable(url: str) -> str | None:
    """Why the index at `url` cannot be reached, or None when it answers (any HTTP status)."""
    try:
        with urllib.request.urlopen(f"{url}/pip/", timeout=30) as response:
            response.read(1)
    except urllib.error.HTTPError:
        return None  # it answered
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {getattr(exc, 'reason', exc)}"
    return None


def run(cmd: list[str], *, cwd: Path, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow  # ~45 s (a wheel build and a fresh venv): CI runs it with the other slow tests
def test_the_wheel_installs_with_the_worker_extra_into_a_fresh_venv(tmp_path: Path) -> None:
    why = unreachable(index_url())
    if why is not None:
        pytest.skip(f"the package index is unreachable ({why}): cannot install the worker extra")
    # The checkout's own environment must not leak into the fresh one.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)

    # The README's build command, as the operator runs it.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"), "."],
        cwd=src, timeout=600, env=env)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    wheel = tmp_path / "dist" / f"slime_stoa-{version}-py3-none-any.whl"
    assert [p.name for p in (tmp_path / "dist").iterdir()] == [wheel.name]
    assert wheel.name in (REPO / "README.md").read_text(), "the README's Mac steps name another wheel"

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, timeout=300, env=env)
    bin_dir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    # (--no-compile: byte-compiling transformers' thousands of modules is most of an install's time)
    run([str(bin_dir / "python"), "-m", "pip", "install", "--no-compile", f"{wheel}[worker]"],
        cwd=tmp_path, timeout=1500, env=env)

    # From outside the checkout, so only the installed packages can be imported.
    for tool, expected in (("macd", "usage: macd"), ("stoa", "usage: stoa")):
        done = run([str(bin_dir / tool), "--help"], cwd=tmp_path, timeout=120, env=env)
        assert done.stdout.startswith(expected) and "Traceback" not in done.stdout + done.stderr, done
    probe = (
        "import importlib.util, macd, mlx.core, mlx_lm, slime_stoa\n"
        "print(slime_stoa.__file__, macd.__file__)\n"
        "print('torch' if importlib.util.find_spec('torch') else 'no torch')\n"
    )
    done = run([str(bin_dir / "python"), "-c", probe], cwd=tmp_path, timeout=300, env=env)
    files, torch = done.stdout.splitlines()
    assert all(Path(f).is_relative_to(venv) for f in files.split()), files  # the wheel's, not the checkout's
    assert torch == "no torch"  # a Mac worker never installs torch (README)
