"""Progress of a long phase of steps (the warm start): a rich bar with rate and ETA on a
terminal; elsewhere (a pipe, a log file) a plain line at every tenth of the phase, or after
`every_s` seconds without one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text


def eta_text(seconds: float | None) -> str:
    """A remaining time as "ETA 42s", "ETA 7m", "ETA 1.5h" ("ETA ?" when unknown)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "ETA ?"
    if seconds < 90:
        return f"ETA {seconds:.0f}s"
    if seconds < 5400:
        return f"ETA {seconds / 60:.0f}m"
    return f"ETA {seconds / 3600:.1f}h"


class _Rate(ProgressColumn):
    def render(self, task: Any) -> Text:
        speed = task.finished_speed or task.speed
        return Text("? steps/s" if speed is None else f"{speed:.1f} steps/s")


class StepMeter:
    """Shows `done` of `total` steps as they go; `console` None shows nothing. Use as a context
    manager; `update(done, loss=...)` after each step."""

    def __init__(
        self, console: Console | None, what: str, total: int, done: int = 0, *, every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console, self.what, self.total, self.clock, self.every_s = console, what, max(total, 1), clock, every_s
        self.start_done = self.last_done = done
        self.started = self.last_line = clock()
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> StepMeter:
        if self.console is not None and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold cyan]stoa[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                _Rate(), TimeRemainingColumn(), TextColumn("{task.fields[extra]}"),
                console=self.console, transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=self.total, completed=self.start_done, extra="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def rate(self, done: int, now: float) -> float | None:
        """Steps per second of this session (None before any)."""
        took = now - self.started
        return (done - self.start_done) / took if done > self.start_done and took > 0 else None

    def update(self, done: int, **fields: float) -> None:
        extra = " ".join(f"{k} {v:.3f}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=done, extra=extra)
            return
        if self.console is None:
            return
        now = self.clock()
        if done - self.last_done < self.total / 10 and now - self.last_line < self.every_s and done < self.total:
            return
        self.last_done, self.last_line = done, now
        rate = self.rate(done, now)
        eta = eta_text(None if not rate else (self.total - done) / rate)
        shown = "? steps/s" if rate is None else f"{rate:.1f} steps/s"
        line = f"{self.what}: step {done}/{self.total} ({done / self.total:.0%}), {shown}, {eta}"
        self.console.print(f"[bold cyan]stoa[/] {line}" + (f", {extra}" if extra else ""), soft_wrap=True, highlight=False)


def report_console(report: Any) -> Console | None:
    """The rich console of a report (`ConsoleReport`), None for any other report."""
    console = getattr(report, "console", None)
    return console if isinstance(console, Console) else None
