"""A fast BLAS under MLX's CPU device on Linux, loaded into the process before MLX is.

MLX's Linux CPU wheel links the reference (netlib) BLAS it bundles: its float32 matmuls, which
every layer goes through on the CPU device (`macd.cpu_compute`), run at ~6 GFLOP/s there, MKL's
at 40-100 on one core (measured at SmolLM2-135M's shapes, 8 to 320 rows). libmlx calls
`cblas_sgemm` by name, bound when libmlx is loaded, and the dynamic linker looks in the
process's global scope first: a BLAS loaded with RTLD_GLOBAL before `import mlx.core` serves
every MLX matmul, with no LD_PRELOAD and no re-exec (and no library forced into the processes
macd starts). Once MLX is loaded it is too late (Python loads extensions with RTLD_NOW):
`use_fast_blas` then only reports what MLX got. A BLAS already in the global scope (a user's
LD_PRELOAD) is kept.

The library, the first found:

1. ``STOA_BLAS=<a shared library exporting cblas_sgemm>``; ``STOA_BLAS=off`` keeps MLX's own.
2. The `mkl` wheel's libmkl_rt (``pip install mkl``, x86-64 Linux), run sequential.
3. A system OpenBLAS: libopenblas.so.0, or libblas.so.3 where that is OpenBLAS.
4. torch's libtorch_cpu, which links MKL in, when torch is installed (torch is not imported):
   ~90 MB more resident memory than the others (measured), so it comes last.

Threads: `THREADS` (1) BLAS thread per process unless ``STOA_BLAS_THREADS`` says otherwise.
A worker shares its machine with other workers and a learner, and MLX's other CPU ops run on
one thread anyway. Measured (SmolLM2-135M, batch 16, a 2-core machine other processes kept at a
load of 3-4): 2 MKL threads decoded at 57-61 tok/s against 77-98 with one, and prefilled two
prompts in 14-20 s against 2; torch's own threads behave alike (`scripts/bench_worker.py
--vs-transformers`: 12-28 tok/s with 2 threads, 45-85 with one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path

log = logging.getLogger("macd")

ENV = "STOA_BLAS"  # a library path, or "off"
THREADS_ENV = "STOA_BLAS_THREADS"
THREADS = 1
OFF = ("off", "none", "bundled", "0")
MKL_THREADING_INTEL, MKL_THREADING_SEQUENTIAL, MKL_THREADING_GNU = 0, 1, 3  # MKL_Set_Threading_Layer's values


@dataclass(frozen=True)
class Blas:
    """A BLAS library: `kind` ("mkl", "openblas", "torch", "given") and what dlopen takes."""

    kind: str
    path: str


def candidates() -> list[Blas]:
    """The fast BLAS libraries on this machine, in the order of preference (module docstring)."""
    found: list[Blas] = []
    mkl = _mkl_wheel()
    if mkl is not None:
        found.append(Blas("mkl", mkl))
    for name in ("openblas", "blas"):
        lib = ctypes.util.find_library(name)
        if lib is not None and _is_openblas(lib):
            found.append(Blas("openblas", lib))
            break
    torch = _torch_lib()
    if torch is not None:
        found.append(Blas("torch", torch))
    return found


def _mkl_wheel() -> str | None:
    """libmkl_rt of the installed `mkl` distribution (it lands in the environment's lib/)."""
    try:
        files = metadata.distribution("mkl").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libmkl_rt.so"):
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                return str(path)
    return None


def _is_openblas(lib: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(lib), "openblas_set_num_threads")
    except OSError:
        return False


def _torch_lib() -> str | None:
    spec = util.find_spec("torch")  # finds the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "lib" / "libtorch_cpu.so"
        if path.is_file():
            return str(path)
    return None


def sgemm_provider() -> str | None:
    """The file of the sgemm the process's global scope resolves (what a library loaded from now
    on binds to): `cblas_sgemm`, else the Fortran `sgemm_` the bundled CBLAS calls (torch's
    library exports only that one); None when there is neither (MLX uses the BLAS it bundles)."""
    scope = ctypes.CDLL(None)
    for symbol in ("cblas_sgemm", "sgemm_"):
        fn = getattr(scope, symbol, None)
        if fn is not None:
            return _library_of(ctypes.cast(fn, ctypes.c_void_p).value)
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]  # fmt: skip


def _library_of(address: int | None) -> str | None:
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if address is None or not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _threads() -> int:
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return THREADS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{THREADS_ENV}={text!r}: expected a number of threads >= 1")
    return int(text)


def load(blas: Blas, threads: int) -> int:
    """Load `blas` into the global scope with `threads` threads; the threads it got. OSError if
    it cannot be loaded or has no sgemm."""
    if blas.kind in ("torch", "given"):  # threads only by the variables they read at start-up
        for var in ("MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(var, str(threads))
    lib = ctypes.CDLL(blas.path, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(lib, "cblas_sgemm") and not hasattr(lib, "sgemm_"):
        raise OSError(f"{blas.path}: no cblas_sgemm")
    if hasattr(lib, "MKL_Set_Threading_Layer"):  # libmkl_rt: before any other MKL call
        if "MKL_THREADING_LAYER" not in os.environ:
            layer = _openmp_layer() if threads > 1 else None
            threads = threads if layer is not None else 1
            lib.MKL_Set_Threading_Layer(MKL_THREADING_SEQUENTIAL if layer is None else layer)
        lib.MKL_Set_Num_Threads(ctypes.c_int(threads))  # the C entry (lowercase is Fortran's, by pointer)
    elif hasattr(lib, "openblas_set_num_threads"):
        lib.openblas_set_num_threads(ctypes.c_int(threads))
    return threads


def _openmp_layer() -> int | None:
    """An OpenMP runtime for MKL's threads, loaded into the global scope, as MKL's threading layer
    number (Intel's libiomp5, else GNU's libgomp); None without one (MKL then runs sequential:
    its threaded layers would die at their first call, not fail to load)."""
    for name, layer in (("iomp5", MKL_THREADING_INTEL), ("gomp", MKL_THREADING_GNU)):
        lib = ctypes.util.find_library(name)
        if lib is None:
            continue
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return layer
    return None


def use_fast_blas() -> str:
    """On Linux, before MLX is imported: load the first fast BLAS found (module docstring) so
    MLX's CPU matmuls use it, and log one line saying which BLAS MLX uses; that line. Elsewhere
    (macOS: Accelerate and Metal) it does nothing. Never raises for a missing or broken library:
    MLX keeps its own BLAS and the line says so."""
    if not sys.platform.startswith("linux"):
        return ""
    line = _choose()
    log.info("%s", line)
    return line


def _choose() -> str:
    choice = os.environ.get(ENV, "").strip()
    present = sgemm_provider()
    if present is not None:
        return f"BLAS for MLX's CPU matmuls: {present} (already loaded)"
    if "mlx.core" in sys.modules:
        return "BLAS for MLX's CPU matmuls: MLX's bundled reference BLAS (MLX was loaded before a faster one could be)"
    if choice.lower() in OFF:
        return f"BLAS for MLX's CPU matmuls: MLX's bundled reference BLAS ({ENV}={choice})"
    try:
        threads = _threads()
    except ValueError as exc:
        return f"BLAS for MLX's CPU matmuls: MLX's bundled reference BLAS ({exc})"
    options = [Blas("given", choice)] if choice else candidates()
    for blas in options:
        try:
            got = load(blas, threads)
        except OSError as exc:
            log.warning("BLAS %s not usable: %s", blas.path, exc)
            continue
        where = sgemm_provider() or blas.path
        return f"BLAS for MLX's CPU matmuls: {blas.kind} ({where}), {got} thread{'s' * (got > 1)}"
    hint = "" if choice else f" (slow float32 matmuls: `pip install mkl`, or {ENV}=<a BLAS library>)"
    return f"BLAS for MLX's CPU matmuls: MLX's bundled reference BLAS{hint}"
