"""The frames of one patch, handed from the event loop's downloads to the thread decoding them.

The downloads `put` each frame as it arrives (any order); a thread iterates the feed, blocking
until the next frame is in, so it decodes the first frames while later ones are still on their
way. After the last frame the feed ends with a verdict on the whole object (`close`): nothing,
or the error the download met (a failed GET, a body that does not match its signed sha256),
which the iterating thread raises, so a consumer that writes as it goes rolls back and one
that stages writes nothing.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _End:
    error: BaseException | None


class FrameFeed:
    """An iterable of (frame number, bytes) filled by `put` and ended by `close`; iterate it once."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, bytes] | _End] = queue.SimpleQueue()
        self.waited_s = 0.0  # time the iterating thread spent waiting for frames

    def put(self, i: int, data: bytes) -> None:
        self._queue.put((i, data))

    def close(self, error: BaseException | None = None) -> None:
        """End the feed: every frame is in and the object checked (`error` None), or it failed.
        A second close is ignored."""
        self._queue.put(_End(error))

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        while True:
            start = time.perf_counter()
            item = self._queue.get()
            self.waited_s += time.perf_counter() - start
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
