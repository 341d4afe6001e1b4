"""Atomic, durable writes of local files: the one implementation every stoa writer uses.

A file is written to a temp file in the same folder, flushed to stable storage (`fsync_file`),
renamed over the target in one step, and then the folder itself is flushed so that the rename
survives a crash too (`fsync_dir`). A reader sees the old file or the complete new one, never
a part of it, and a crash leaves at most a temp file behind (named `<prefix><random>.tmp`, so
the owner of the folder can recognise and remove it).

`fsync_file` uses `F_FULLFSYNC` where the platform has it: on macOS a plain `fsync` only
reaches the drive's cache, not the disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_file", "atomic_write", "fsync_dir", "fsync_file"]

#: Errors of fsync on a folder that mean "this file system cannot do that", not "it failed".
_CANNOT_SYNC_DIR = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})


def fsync_file(fd: int) -> None:
    """Flush the open file `fd` to stable storage (F_FULLFSYNC where available, else fsync)."""
    full = getattr(fcntl, "F_FULLFSYNC", None)
    if full is not None:
        try:
            fcntl.fcntl(fd, full)
            return
        except OSError:
            pass  # not supported by this file system: fall back
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make creations, renames and removals inside the folder `path` durable.

    A file system that cannot flush a folder at all is accepted silently; other errors raise.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_file(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT_SYNC_DIR:
            raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str],
    *,
    mode: int = 0o644,
    durable: bool = True,
    parents_mode: int | None = None,
    tmp_prefix: str | None = None,
) -> Iterator[BinaryIO]:
    """Write `path` through the binary file this yields; it replaces `path` when the block ends.

    - `mode`: the file's permission bits, set on the temp file before its first byte (the umask
      does not apply), so a secret is never readable by others, not even briefly.
    - `durable`: flush the file before the rename and the folder after it (`fsync_file`,
      `fsync_dir`); without it the write is atomic but a crash may lose it.
    - `parents_mode`: create missing parent folders with this mode (default: they must exist).
    - `tmp_prefix`: how the temp file's name starts (default `.<name>.`).

    If the block raises, the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    if parents_mode is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=parents_mode)
    prefix = f".{path.name}." if tmp_prefix is None else tmp_prefix
    tmp = path.with_name(f"{prefix}{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have taken bits away
            yield f
            f.flush()
            if durable:
                fsync_file(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | bytearray | memoryview,
    *,
    mode: int = 0o644,
    durable: bool = True,
    parents_mode: int | None = None,
    tmp_prefix: str | None = None,
) -> Path:
    """Replace `path` with `data` in one step (see `atomic_file` for the options); returns it."""
    with atomic_file(path, mode=mode, durable=durable, parents_mode=parents_mode, tmp_prefix=tmp_prefix) as f:
        f.write(data)
    return Path(path)
