"""Progress of a long phase counted in units (warm start steps, eval prompts or tokens, task
files): a rich bar with rate and ETA on a terminal; elsewhere (a pipe, a log file) a plain line at
every tenth of the phase, or after `every_s` seconds without one. The one progress display of
stoa's commands (`StepMeter`; `SamplingMeter` over an eval's sampling; `cli_console` is a
command's console for it)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

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


def eta_text(seconds: float | None, bound: bool = False) -> str:
    """A remaining time as "ETA 42s", "ETA 7m", "ETA 1.5h" ("ETA ?" when unknown); as "ETA <= 7m"
    when it is an upper `bound`."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "ETA ?"
    at_most = "<= " if bound else ""
    if seconds < 90:
        return f"ETA {at_most}{seconds:.0f}s"
    if seconds < 5400:
        return f"ETA {at_most}{seconds / 60:.0f}m"
    return f"ETA {at_most}{seconds / 3600:.1f}h"


def rate_text(rate: float | None, unit: str) -> str:
    """A rate as "2.5 steps/s" ("? steps/s" when unknown)."""
    return f"? {unit}s/s" if rate is None else f"{rate:.1f} {unit}s/s"


class _Rate(ProgressColumn):
    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Any) -> Text:
        return Text(rate_text(task.finished_speed or task.speed, self.unit))


class _Eta(ProgressColumn):
    """The time left as `eta_text` writes it (an upper bound: "ETA <= 7m")."""

    def render(self, task: Any) -> Text:
        return Text(eta_text(task.time_remaining, bound=True))


class StepMeter:
    """Shows `done` of `total` units (`unit`, singular: "step", "prompt", "file") as they go;
    `console` None shows nothing. Use as a context manager; `update(done, loss=...)` after each
    unit, or `advance()`. With `bound`, the units left are an upper bound of the work left (an
    eval's budget tokens: a sample may stop before its budget), so is the ETA: "ETA <= 7m". The
    rate counts from the last update with nothing done yet (a phase may first load something)."""

    def __init__(
        self, console: Console | None, what: str, total: int, done: int = 0, *, unit: str = "step",
        every_s: float = 30.0, clock: Callable[[], float] = time.monotonic, bound: bool = False,
    ) -> None:
        self.console, self.what, self.total, self.clock, self.every_s = console, what, max(total, 1), clock, every_s
        self.unit, self.done, self.bound = unit, done, bound
        self.note = ""  # text shown after the counts (at the next update)
        self.start_done = self.last_done = done
        self.started = self.last_line = clock()
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> StepMeter:
        if self.console is not None and self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold cyan]stoa[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                _Rate(self.unit), _Eta() if self.bound else TimeRemainingColumn(), TextColumn("{task.fields[extra]}"),
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
        """`done` units so far; `fields` (numbers), then `note` (text), shown after them."""
        self.done = done
        extra = " ".join([*(f"{k} {v:.3f}" for k, v in fields.items()), *([self.note] if self.note else [])])
        if done <= self.start_done:
            self.started = self.clock()
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
        eta = eta_text(None if not rate else (self.total - done) / rate, self.bound)
        line = f"{self.what}: {self.unit} {done}/{self.total} ({done / self.total:.0%}), {rate_text(rate, self.unit)}, {eta}"
        self.console.print(f"[bold cyan]stoa[/] {line}" + (f", {extra}" if extra else ""), soft_wrap=True, highlight=False)


class SamplingProgress(Protocol):
    """How far an eval's sampling is (`slime_stoa.evaluation.local.EvalProgress`)."""

    @property
    def prompts_done(self) -> int: ...

    @property
    def prompts(self) -> int: ...

    @property
    def tokens_done(self) -> int | None: ...  # of the token budget; None where not counted

    @property
    def tokens(self) -> int | None: ...


class SamplingMeter(contextlib.AbstractContextManager["SamplingMeter"]):
    """A `StepMeter` over an eval's sampling, shown once its size is known: in tokens of the budget
    (prompts x k x max tokens; a finished sample's unused budget counts as done, so the bar moves
    with every decode step and its ETA is an upper bound) when the sampler counts them, the
    prompts done beside; else in prompts. `show(progress)` as the sampler tells it (the first
    one, with nothing done, sizes the meter); `start(prompts)` and `update(done)` for a count of
    prompts alone (the fleet's answers)."""

    def __init__(
        self, console: Console | None, what: str, *, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console, self.what, self.every_s, self.clock = console, what, every_s, clock
        self.meter: StepMeter | None = None

    def start(self, prompts: int, tokens: int | None = None) -> None:
        """A new meter over `prompts` prompts, or over `tokens` budget tokens when given."""
        self.close()
        unit, total = ("prompt", prompts) if tokens is None else ("token", tokens)
        self.meter = StepMeter(self.console, self.what, total, unit=unit, every_s=self.every_s, clock=self.clock,
                               bound=tokens is not None).__enter__()

    def update(self, done: int) -> None:
        """`done` prompts finished (a meter in prompts)."""
        if self.meter is not None and self.meter.unit == "prompt":
            self.meter.update(done)

    def show(self, progress: SamplingProgress) -> None:
        """Where the sampling is (a new meter if its unit or size changed)."""
        tokens = progress.tokens if progress.tokens_done is not None else None
        unit, total = ("prompt", progress.prompts) if tokens is None else ("token", tokens)
        if self.meter is None or self.meter.unit != unit or self.meter.total != max(total, 1):
            self.start(progress.prompts, tokens)
        assert self.meter is not None
        if progress.tokens_done is None:
            self.meter.update(progress.prompts_done)
        else:
            self.meter.note = f"prompts {progress.prompts_done}/{progress.prompts}"
            self.meter.update(progress.tokens_done)

    def close(self) -> None:
        if self.meter is not None:
            self.meter.__exit__()
            self.meter = None

    def __exit__(self, *exc: object) -> None:
        self.close()


def cli_console(quiet: bool = False) -> Console | None:
    """The console of a command's progress: stderr (stdout keeps the command's results), None
    (nothing shown) when `quiet`."""
    return None if quiet else Console(stderr=True)


def report_console(report: Any) -> Console | None:
    """The rich console of a report (`ConsoleReport`), None for any other report."""
    console = getattr(report, "console", None)
    return console if isinstance(console, Console) else None
