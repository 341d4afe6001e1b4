"""One `stoa quickstart` per run folder: `<out>/quickstart.lock`, held with flock for the run's life.

The lock belongs to the open file, not to the file on disk: the kernel lets go of it when the
process ends, however it ends (SIGKILL included), so a lock file left by a dead run is simply
taken over. The file holds the pid of the run that holds it, for the refusal's message. Its
descriptor is not inherited by the `macd run` workers (Python opens files non-inheritable).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .config import QuickstartError

LOCK_FILE = "quickstart.lock"  # in the run folder


def holder_pid(path: Path) -> int | None:
    """The pid written in the lock file (None when it holds none)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def run_lock(out: Path) -> Iterator[Path]:
    """Hold the run folder's lock inside the block; QuickstartError naming the running
    quickstart's pid when another process holds it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder_pid(path)
            who = "another `stoa quickstart`" + ("" if pid is None else f" (pid {pid})")
            stop = "" if pid is None else f" (Ctrl-C in its terminal, or kill -INT {pid})"
            raise QuickstartError(
                f"{who} is running on --out {out}: wait for it to end or stop it{stop}, then rerun "
                f"to resume; or pass another --out for a separate run"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the pid is no one's once the lock is let go
    finally:
        os.close(fd)
