"""Time-bounded symbolic equivalence of two MATH answers, safe to call from any thread.

math-verify's own timeout uses SIGALRM, which works only in a process's main thread, and some
sympy work (a long integer power) cannot be interrupted by a signal at all. So the comparison runs
in child processes (`math_verify_process`): a caller writes one question to an idle child and waits
for its answer at most `timeout_s`; a child that misses the deadline is killed (the answer grades
0) and a fresh one starts on the next question. A child that cannot start (math-verify missing)
also grades 0; `MathTask` checks the library is installed when it is built.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0  # per comparison; a normal MATH answer takes milliseconds
DEFAULT_START_TIMEOUT_S = 60.0  # a child's imports (sympy, math-verify) on a loaded machine
DEFAULT_PROCESSES = 2
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def child_command(timeout_s: float) -> list[str]:
    """The command line of a grading child for `timeout_s` seconds per step."""
    return [sys.executable, "-m", "slime_stoa.tasks.math_verify_process", str(max(1, int(timeout_s)))]


class GraderProcess:
    """One child answering ``[gold, pred]`` lines with ``1``/``0``; not thread-safe (the pool
    hands it to one caller at a time)."""

    def __init__(self, command: Sequence[str], *, start_timeout_s: float) -> None:
        self.command = list(command)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self.starts = 0  # how many children were started (a test observes restarts)

    def ask(self, gold: str, pred: str, timeout_s: float) -> bool | None:
        """The child's answer, or None when it gave none within `timeout_s` (it is then killed)."""
        if self.proc is None and not self._start():
            return None
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps([gold, pred]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            self.kill()
            return None
        line = self._read_line(timeout_s)
        if line is None:
            self.kill()
            return None
        return line == b"1"

    def _start(self) -> bool:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=env, close_fds=True,
            )
        except OSError as exc:
            log.warning("MATH grader: cannot start %s: %s", self.command[0], exc)
            return False
        self.starts += 1
        self._buffer = b""
        if self._read_line(self.start_timeout_s) != b"ready":
            log.warning("MATH grader: the grading process did not start (is math-verify installed?)")
            self.kill()
            return False
        return True

    def _read_line(self, timeout_s: float) -> bytes | None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:  # the child exited
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.strip()

    def kill(self) -> None:
        """End the child (if any) and forget it; the next question starts a new one."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class MathGrader:
    """Up to `processes` grading children shared by every thread; each question gets one idle child
    for at most `timeout_s` (plus a child's start-up, bounded by `start_timeout_s`)."""

    def __init__(
        self, *, timeout_s: float = DEFAULT_TIMEOUT_S, processes: int = DEFAULT_PROCESSES,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S, command: Sequence[str] | None = None,
    ) -> None:
        if not timeout_s > 0 or processes < 1:
            raise ValueError("timeout_s must be > 0 and processes >= 1")
        self.timeout_s = timeout_s
        self.children = [
            GraderProcess(command or child_command(timeout_s), start_timeout_s=start_timeout_s)
            for _ in range(processes)
        ]
        self._idle: queue.Queue[GraderProcess] = queue.Queue()
        for child in self.children:
            self._idle.put(child)

    def equivalent(self, gold: str, pred: str) -> bool:
        """Whether math-verify finds `pred` equivalent to `gold` in time; False otherwise."""
        child = self._idle.get()
        try:
            answer = child.ask(gold, pred, self.timeout_s)
        finally:
            self._idle.put(child)
        if answer is None:
            log.warning("MATH grader: no answer within %g s for a %d-character answer; graded 0", self.timeout_s, len(pred))
        return bool(answer)

    def close(self) -> None:
        for child in self.children:
            child.kill()


_default: MathGrader | None = None
_default_lock = threading.Lock()


def default_grader() -> MathGrader:
    """The process-wide grader (started on first use, its children ended at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathGrader()
            atexit.register(_default.close)
        return _default


__all__ = ["DEFAULT_TIMEOUT_S", "GraderProcess", "MathGrader", "child_command", "default_grader"]
