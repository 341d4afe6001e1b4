"""Key order for the folder store's listings, at a cost per page that does not grow with the folder.

A listing walks the store's folders in key order. Sorting a folder's names costs O(folder size),
and a folder can hold millions of keys (junk written into a rollouts prefix included), so
`SortedFolders` keeps the sorted names of the few folders listed last and serves a listing from
them, starting by bisection at `start_after`: a listing of one page from anywhere in the folder
then costs O(log n + page) while the folder does not change.

A folder's cached names are served only while its `stat` is unchanged: inode, mtime, ctime (which
no caller can set: `utime` moves it to now), size and link count. Adding or removing an entry
moves the mtime and ctime to the current time, but timestamps are coarse (a kernel tick; up to
seconds on some file systems), so two changes within one tick can leave the stat unchanged. The
names are therefore cached only when the folder was last changed at least `QUIET_NS` before its
stat was taken: any later change then stamps a later time, and the next listing rescans. A folder
written to continuously is rescanned on every listing, as before.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

QUIET_NS = 2_000_000_000  # longer than any file system's timestamp granularity we run on (FAT: 2 s)
CACHED_FOLDERS = 4  # folders whose names are kept (memory: about 100 bytes per name)
SKIPPED = ".stoa"  # the store's own folders (temp files, locks) are not keys

Signature = tuple[int, int, int, int, int]


def _signature(st: os.stat_result) -> Signature:
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_nlink)


class SortedFolders:
    """The sorted entry names of a store's folders (a subfolder's name ends with "/", so that the
    names sort as the keys below them do), the last `CACHED_FOLDERS` of them kept. Thread-safe:
    listings run in worker threads."""

    def __init__(self, capacity: int = CACHED_FOLDERS) -> None:
        self.capacity = capacity
        self.scans = 0  # folders read from the disk (the rest were served from the cache)
        self._cache: OrderedDict[str, tuple[Signature, tuple[str, ...]]] = OrderedDict()
        self._lock = threading.Lock()

    def names(self, folder: Path) -> tuple[str, ...]:
        """The folder's entry names in key order; () when it is gone or not a folder."""
        now = time.time_ns()
        try:
            st = os.stat(folder)  # before the scan: a change during the scan moves it
        except (FileNotFoundError, NotADirectoryError):
            return ()
        sig = _signature(st)
        path = str(folder)
        with self._lock:
            cached = self._cache.get(path)
            if cached is not None and cached[0] == sig:
                self._cache.move_to_end(path)
                return cached[1]
        names = _scan(folder)
        with self._lock:
            self.scans += 1
            if now - max(st.st_mtime_ns, st.st_ctime_ns) >= QUIET_NS:
                self._cache[path] = (sig, names)
                self._cache.move_to_end(path)
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.pop(path, None)
        return names

    def walk(self, folder: Path, key_prefix: str, prefix: str, start_after: str) -> Iterator[str]:
        """Keys under `folder` (whose keys start with `key_prefix`) that start with `prefix` and
        sort after `start_after`, in lexicographic order, pruning subtrees outside the query."""
        names = self.names(folder)
        # Every entry before `bound` (relative to this folder) is out of the query, except the
        # subfolder that contains `bound`, which sorts right before it.
        bound = max(prefix, start_after)
        at = bisect.bisect_left(names, bound[len(key_prefix) :]) if bound.startswith(key_prefix) else 0
        if at > 0 and names[at - 1].endswith("/") and bound.startswith(key_prefix + names[at - 1]):
            at -= 1
        for i in range(at, len(names)):  # not a slice: that would copy the folder's names
            name = names[i]
            key = key_prefix + name
            if key > prefix and not key.startswith(prefix):
                return  # past every key with the prefix
            if name.endswith("/"):
                # Every key below starts with `key`: skip the subtree when it cannot match.
                if not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if start_after > key and not start_after.startswith(key):
                    continue
                yield from self.walk(folder / name[:-1], key, prefix, start_after)
            elif key.startswith(prefix) and key > start_after:
                yield key


def _scan(folder: Path) -> tuple[str, ...]:
    try:
        with os.scandir(folder) as entries:
            names = [
                entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name
                for entry in entries
                if not entry.name.startswith(SKIPPED)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return ()
    names.sort()
    return tuple(names)
