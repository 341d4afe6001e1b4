"""Shared pieces of the benchmarks: contenders timed in interleaved rounds, min/median/max, the
load average, and cleanups (servers, temp folders) on SIGTERM/SIGHUP.

Contenders run A, B, A, B, ... (one of each per round), so a load change on a shared machine
touches every contender alike; headline ratios are ratios of medians.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any


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
