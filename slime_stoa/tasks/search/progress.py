"""Progress of the index build on a terminal: a rich line with the passages read and the rate.

Quiet when stderr is not a terminal (a pipe, a log file, a test): `passage_meter` then yields a
callback that does nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def passage_meter(what: str = "indexing passages", total: int | None = None) -> Iterator[Callable[[int], None]]:
    """A callback `advance(count)` that moves the bar by `count` passages while the block runs."""
    if not sys.stderr.isatty():
        yield lambda count: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    columns = [TextColumn("[bold cyan]stoa[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TaskProgressColumn(show_speed=True), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda count: bar.advance(task, count)
