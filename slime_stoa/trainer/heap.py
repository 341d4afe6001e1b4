"""Giving freed heap back to the OS after a large host copy is dropped.

glibc raises its mmap threshold to the size of the largest mmapped block freed so far (up to
32 MiB). After the first weight-sized free, every tensor of a model like LFM2.5-8B-A1B is
allocated from the heap, and freeing it keeps the memory resident: dropping a whole host copy of
the state (the baseline the publisher hands to the device path) would leave about one bf16 copy of
the model in the trainer's resident set until later allocations reuse it. `malloc_trim(0)` hands
the free pages back (the heap's top and the whole free pages inside it). Other C libraries
(macOS, musl) have no such call or do not keep memory this way: there it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)


def return_freed_heap() -> bool:
    """Ask glibc to return the heap's free pages to the OS (`malloc_trim(0)`). True when it
    returned some; False when it had none to return, or the process does not run on glibc.
    Never raises: a failure here costs memory, not the run."""
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        return bool(trim(0))
    except Exception as exc:  # a foreign call's failure is only lost memory
        log.debug("stoa: malloc_trim failed (%s: %s)", type(exc).__name__, exc)
        return False


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library is not glibc (looked up once)."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
        trim = ctypes.CDLL(None).malloc_trim
    except Exception:  # no confstr (Windows), no such name or symbol, no libc handle: not glibc here
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim
