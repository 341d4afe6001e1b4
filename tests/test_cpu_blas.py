"""macd.cpu_blas: a fast BLAS loaded under MLX before MLX is, or MLX's own kept and said so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from macd import cpu_blas

ROOT = Path(__file__).resolve().parents[1]
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux CPU wheel's BLAS")

# A fresh process: choose a BLAS, then import MLX and multiply in float32.
PROBE = """
import json, sys
from macd import cpu_blas
line = cpu_blas.use_fast_blas()
import mlx.core as mx
import numpy as np
a, b = np.random.default_rng(0).standard_normal((2, 64, 96), dtype=np.float32)
got = np.array(mx.array(a) @ mx.array(b).T)
print(json.dumps({"line": line, "provider": cpu_blas.sgemm_provider(),
                  "close": bool(np.allclose(got, a @ b.T, rtol=1e-4, atol=1e-4))}))
"""


def probe(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu_blas.ENV, cpu_blas.THREADS_ENV)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@linux
def test_off_keeps_mlx_own_blas_and_says_so() -> None:
    got = probe(**{cpu_blas.ENV: "off"})
    assert got["provider"] is None and got["close"]
    assert "bundled reference BLAS" in str(got["line"]) and "STOA_BLAS=off" in str(got["line"])


@linux
@pytest.mark.skipif(not cpu_blas.candidates(), reason="no fast BLAS on this machine (pip install mkl)")
def test_the_first_candidate_serves_mlx_matmuls() -> None:
    first = cpu_blas.candidates()[0]
    got = probe()
    assert got["close"] and got["provider"] is not None
    assert f"BLAS for MLX's CPU matmuls: {first.kind} (" in str(got["line"]) and "1 thread" in str(got["line"])


@linux
def test_a_given_library_that_cannot_load_falls_back_to_mlx_own() -> None:
    got = probe(**{cpu_blas.ENV: "/nonexistent/libblas.so"})
    assert got["provider"] is None and got["close"] and "bundled reference BLAS" in str(got["line"])


@linux
def test_too_late_once_mlx_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core  # noqa: F401  # this process has MLX loaded

    monkeypatch.setattr(cpu_blas, "sgemm_provider", lambda: None)
    assert "MLX was loaded before" in cpu_blas.use_fast_blas()


def test_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_blas.THREADS_ENV, raising=False)
    assert cpu_blas._threads() == cpu_blas.THREADS == 1
    monkeypatch.setenv(cpu_blas.THREADS_ENV, "2")
    assert cpu_blas._threads() == 2
    monkeypatch.setenv(cpu_blas.THREADS_ENV, "0")
    with pytest.raises(ValueError, match=cpu_blas.THREADS_ENV):
        cpu_blas._threads()


def test_nothing_to_do_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_blas.sys, "platform", "darwin")
    assert cpu_blas.use_fast_blas() == ""
