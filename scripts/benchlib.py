"""Shared pieces of the benchmarks: contenders timed in interleaved rounds, min/median/max, the
load average, and cleanups (servers, temp folders) on SIGTERM/SIGHUP.

Contenders run A, B, A, B, ... (one of each per round), so a load change on a shared machine
touches every contender alike; headline ratios are ratios of medians.

A benchmark is bounded by its work (versions, groups, rounds), never by a wall-clock deadline:
when the work cannot finish (a child died, a contender made no progress for `STALL_S`, a result
failed its check) it raises `Incomplete` naming what did not finish, `exit_code` turns that into
one line and exit status 1, and `write_json` refuses a document holding a figure that is not a
number, so a cut run never leaves NaN figures behind as if they were results.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

STALL_S = 900.0  # default stall limit: no sign of progress for this long means the work cannot finish


def load_average() -> float:
    """The 1-minute load average (NaN where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def spread(values: Sequence[float]) -> dict[str, float]:
    """min / median / max (and the count) of repeated measurements."""
    if not values:
        return {"min": math.nan, "median": math.nan, "max": math.nan, "n": 0}
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is 0 or not finite."""
    if not denominator or not math.isfinite(denominator):
        return math.nan
    return numerator / denominator


def rounds(contenders: Mapping[str, Callable[[], float | None]], count: int) -> dict[str, list[float]]:
    """Run each contender once per round, in order, `count` rounds; each call returns its own
    measurement (None: the wall time of the call). Returns the measurements per contender."""
    out: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(count):
        for name, fn in contenders.items():
            start = time.perf_counter()
            got = fn()
            out[name].append(time.perf_counter() - start if got is None else float(got))
    return out


async def async_rounds(
    contenders: Mapping[str, Callable[[], Awaitable[float | None]]], count: int
) -> dict[str, list[float]]:
    """`rounds` for coroutine functions."""
    out: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(count):
        for name, fn in contenders.items():
            start = time.perf_counter()
            got = await fn()
            out[name].append(time.perf_counter() - start if got is None else float(got))
    return out


def format_spread(s: Mapping[str, float], unit: str = "s", digits: int = 4) -> str:
    """`median (min-max, n)` of a `spread`."""
    return f"{s['median']:.{digits}f} {unit} (min {s['min']:.{digits}f}, max {s['max']:.{digits}f}, n={s['n']})"


def print_spreads(title: str, spreads: Mapping[str, Mapping[str, float]], unit: str = "s", digits: int = 4) -> None:
    """One line per contender: median, min, max, count."""
    print(title)
    width = max((len(name) for name in spreads), default=0)
    print(f"  {'':{width}}  {'median':>10}  {'min':>10}  {'max':>10}  {'n':>3}  ({unit})")
    for name, s in spreads.items():
        print(f"  {name:{width}}  {s['median']:>10.{digits}f}  {s['min']:>10.{digits}f}  {s['max']:>10.{digits}f}  "
              f"{s['n']:>3}")


class Session:
    """The load average at the start and the end of a run, for its JSON."""

    def __init__(self) -> None:
        self.load_start = load_average()
        self.started = time.perf_counter()

    def meta(self) -> dict[str, Any]:
        return {"load_average_start": self.load_start, "load_average_end": load_average(),
                "cpus": os.cpu_count(), "wall_s": time.perf_counter() - self.started}

    def print_load(self) -> None:
        meta = self.meta()
        print(f"load average: {meta['load_average_start']:.2f} at the start, {meta['load_average_end']:.2f} at the "
              f"end ({meta['cpus']} CPUs); headline ratios are ratios of medians")


_cleanups: list[Callable[[], Any]] = []


def on_signal_exit(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Register `fn` (a server's stop, a temp folder's removal) to run if SIGTERM or SIGHUP ends
    the run inside `exit_on_signals`; returns `fn`. Normal exits run their own `finally`."""
    _cleanups.append(fn)
    return fn


@contextmanager
def exit_on_signals() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP run the registered cleanups (last first) and end the process
    with status 128 + the signal number. The cleanups run from the handler itself: under
    `asyncio.run` a cancellation can be absorbed by the code it interrupts, an exit can not."""

    def handler(signum: int, _frame: Any) -> None:
        for fn in reversed(_cleanups):
            try:
                fn()
            except Exception as exc:  # the others must still run
                print(f"cleanup {fn!r} failed: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)):
        with suppress(ValueError, OSError):  # not the main thread
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _cleanups.clear()


class Incomplete(Exception):
    """The benchmark's work did not finish; the message names what (and how far it got)."""


def require(ok: bool, what: str) -> None:
    """Raise `Incomplete(what)` unless `ok`: the check of a result the figures depend on (an
    `assert` would vanish under `python -O` and end the run with a traceback)."""
    if not ok:
        raise Incomplete(what)


class StallWatch:
    """One piece of work against a stall limit: call `progressed()` at every sign of progress;
    `check()` raises `Incomplete` once none came for `limit_s` seconds. The work itself stays
    bounded by its size; the limit only tells a stuck run from a slow one."""

    def __init__(self, what: str, limit_s: float = STALL_S) -> None:
        if not limit_s > 0:
            raise ValueError(f"a stall limit must be > 0 seconds, got {limit_s!r}")
        self.what, self.limit_s = what, limit_s
        self.last = time.monotonic()

    def progressed(self) -> None:
        self.last = time.monotonic()

    def left_s(self) -> float:
        """Seconds until the limit (0 once past it)."""
        return max(0.0, self.last + self.limit_s - time.monotonic())

    def check(self, done: str = "") -> None:
        """Raise `Incomplete` if no progress came for the limit; `done` says how far it got."""
        if self.left_s() <= 0:
            raise Incomplete(f"{self.what} made no progress for {self.limit_s:g} s" + (f" ({done})" if done else ""))


def not_numbers(doc: Any, at: str = "") -> list[str]:
    """The paths (`a.b[2]`) of the floats in `doc` that are NaN or infinite."""
    if isinstance(doc, float):
        return [] if math.isfinite(doc) else [at or "(the document)"]
    if isinstance(doc, Mapping):
        return [p for k, v in doc.items() for p in not_numbers(v, f"{at}.{k}" if at else str(k))]
    if isinstance(doc, list | tuple):
        return [p for i, v in enumerate(doc) for p in not_numbers(v, f"{at}[{i}]")]
    return []


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    """Write a run's results atomically, refusing (`Incomplete`) any figure that is not a number:
    a NaN in a results file is a run that did not measure it."""
    bad = not_numbers(doc)
    if bad:
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise Incomplete(f"not written to {path}: no figure for {', '.join(bad[:8])}{more}")
    from slime_stoa.protocol.fsutil import atomic_write

    atomic_write(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode(), durable=False)


def exit_code(main: Callable[[], int], name: str) -> int:
    """`main()`'s status, or 1 with one line on stderr when its work did not finish."""
    try:
        return main()
    except Incomplete as exc:
        print(f"error: {name} did not finish: {exc}", file=sys.stderr)
        return 1
