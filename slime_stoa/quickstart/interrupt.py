"""Ctrl-C and SIGTERM for `stoa quickstart`: honoured within a few seconds in every phase.

A signal only sets a flag (and an asyncio event, to cut a long wait short); the run checks it
between steps — every warm-start step, every learner step, each worker start — and raises
`Interrupted`, so cleanup (stopping the workers, saving the consumer's state) always runs from a
known point, never from the middle of a write. A second signal gives up on that and raises
`KeyboardInterrupt` at once. Whenever a signal arrived before the run's normal end, the command
exits 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


RERUN = "rerun the same command to resume"


class Interrupted(Exception):
    """A stop signal arrived: the run stops at this safe point. `next_step`: what the person who
    stopped it does next (the command prints it)."""

    def __init__(self, message: str, *, next_step: str = RERUN) -> None:
        super().__init__(message)
        self.next_step = next_step


class Interrupt:
    """The stop flag of one run. `installed()` routes SIGINT and SIGTERM to it (main thread)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def request(self, signum: int = signal.SIGINT) -> None:
        """What a signal does (also callable directly)."""
        if self.signum is None:
            self.signum = signum
        loop, event = self._loop, self._event
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt  # a second signal: stop now
        self.request(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupt]:
        """Handle SIGINT and SIGTERM with this flag inside the block; the old handlers after."""
        previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def check(self) -> None:
        """Raise `Interrupted` if a stop signal arrived."""
        if self.signum is not None:
            raise Interrupted(f"{signal.Signals(self.signum).name} received")

    async def race(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, unless a stop signal comes first: then cancel it and raise `Interrupted`."""
        loop = asyncio.get_running_loop()
        if self._event is None or self._loop is not loop:
            self._loop, self._event = loop, asyncio.Event()
        self.check()  # after binding the event: a signal from here on sets it
        work: asyncio.Future[Any] = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(self._event.wait())
        try:
            await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            self.check()
        return work.result()
