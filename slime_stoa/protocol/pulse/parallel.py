"""How many threads the weight plane's numpy work uses, and an ordered map over a thread pool.

numpy's kernels, zstd and xxh3 release the GIL, so tensors (or segments of one) processed on a
pool run on several cores. Results come back in input order, so no output depends on the
thread count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_DEFAULT_THREADS = 8  # beyond this memory bandwidth, not cores, bounds the work


def thread_count(threads: int | None) -> int:
    """`threads`, or for None one per CPU up to MAX_DEFAULT_THREADS."""
    if threads is None:
        return min(MAX_DEFAULT_THREADS, os.cpu_count() or 1)
    return max(1, threads)


def check_threads(threads: int | None) -> None:
    """ValueError unless `threads` is None or a positive int."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int | None) -> list[R]:
    """`[fn(x) for x in items]`, on `thread_count(threads)` threads (the caller's alone for 1)."""
    work = list(items)
    workers = min(thread_count(threads), len(work))
    if workers <= 1:
        return [fn(x) for x in work]
    with ThreadPoolExecutor(workers, thread_name_prefix="stoa-pulse") as pool:
        return list(pool.map(fn, work))
