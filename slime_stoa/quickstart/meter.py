"""Progress of a long phase counted in units (warm start steps, eval prompts, task files): a
rich bar with rate and ETA on a terminal; elsewhere (a pipe, a log file) a plain line at every
tenth of the phase, or after `every_s` seconds without one. The one progress display of stoa's
commands (`StepMeter`; `cli_console` is a command's console for it)."""

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


def rate_text(rate: float | None, unit: str) -> str:
    """A rate as "2.5 steps/s" ("? steps/s" when unknown)."""
    return f"? {unit}s/s" if rate is None else f"{rate:.1f} {unit}s/s"


class _Rate(ProgressColumn):
    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Any) -> Text:
        return Text(rate_text(task.finished_speed or task.speed, self.unit))


class StepMeter:
    """Shows `done` of `total` units (`unit`, singular: "step", "prompt", "file") as they go;
    `console` None shows nothing. Use as a context manager; `update(done, loss=...)` after each
    unit, or `advance()`."""

    def __init__(
        self, console: Console | None, what: str, total: int, done: int = 0, *, unit: str = "step",
        every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console, self.what, self.total, self.clock, self.every_s = console, what, max(total, 1), clock, every_s
        self.unit, self.done = unit, done
        self.start_done = self.last_done = done
        self.started = self.last_line = clock()
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> StepMeter:
        if self.console is not None and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold cyan]stoa[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                _Rate(self.unit), TimeRemainingColumn(), TextColumn("{task.fields[extra]}"),
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
        """Units per second of this session (None before any)."""
        took = now - self.started
        return (done - self.start_done) / took if done > self.start_done and took > 0 else None

    def advance(self, by: int = 1, **fields: float) -> None:
        """`by` more units done."""
        self.update(self.done + by, **fields)

    def update(self, done: int, **fields: float) -> None:
        self.done = done
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
        line = f"{self.what}: {self.unit} {done}/{self.total} ({done / self.total:.0%}), {rate_text(rate, self.unit)}, {eta}"
        self.console.print(f"[bold cyan]stoa[/] {line}" + (f", {extra}" if extra else ""), soft_wrap=True, highlight=False)


def cli_console(quiet: bool = False) -> Console | None:
    """The console of a command's progress: stderr (stdout keeps the command's results), None
    (nothing shown) when `quiet`."""
    return None if quiet else Console(stderr=True)


def report_console(report: Any) -> Console | None:
    """The rich console of a report (`ConsoleReport`), None for any other report."""
    console = getattr(report, "console", None)
    return console if isinstance(console, Console) else None
