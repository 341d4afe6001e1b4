"""Small asyncio helpers of the worker: waits that end early, and the generation loop's wake-up."""

from __future__ import annotations

import asyncio
import threading


async def wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleep up to `seconds`, returning early when `stop` is set.

    `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` swallows a cancellation that
    arrives just as the awaited event fires, which once left a heartbeat loop spinning forever."""
    if stop.is_set():
        return
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        pass


async def settle_task(task: asyncio.Task, timeout: float) -> None:
    """Let `task` end by itself for up to `timeout` seconds, then cancel it and wait."""
    await asyncio.wait({task}, timeout=timeout)
    if not task.done():
        task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Wakeup:
    """Interrupts the generation loop: its decode run on the MLX thread at the next step
    (`poke`, checked there) and its idle wait (`idle`)."""

    def __init__(self) -> None:
        self.poke = threading.Event()
        self.idle = asyncio.Event()

    def __call__(self) -> None:
        self.poke.set()
        self.idle.set()

    def clear(self) -> None:
        self.poke.clear()
        self.idle.clear()
