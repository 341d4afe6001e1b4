"""An asyncio event loop on its own daemon thread, for synchronous callers (slime's hooks).

slime calls stoa from synchronous code, while the store and the consumer are async and keep
connections bound to one loop. A `LoopThread` runs one loop for the whole process lifetime of
its owner: `call(coro)` runs a coroutine there and waits for its result. `close()` (also run at
interpreter exit, if the owner did not) first awaits the owner's `on_close` on the loop (closing
store connections), then stops the loop and joins the thread. It is idempotent.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on a daemon thread named `name`."""

    def __init__(self, name: str, *, on_close: Callable[[], Awaitable[object]] | None = None) -> None:
        self.name = name
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = False
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        """Await `on_close` on the loop (errors are logged, never raised), then stop the loop,
        join the thread and close the loop. Later calls do nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        try:
            if self._on_close is not None:
                self.call(_awaited(self._on_close))
        except Exception as exc:  # closing: report, never raise
            log.warning("stoa: closing %s: %s", self.name, exc)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


async def _awaited(fn: Callable[[], Awaitable[object]]) -> None:
    await fn()
