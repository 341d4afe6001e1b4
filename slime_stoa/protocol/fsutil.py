"""Atomic, durable writes of local files: the one implementation every stoa writer uses.

A file is written to a temp file in the same folder, flushed to stable storage (`fsync_file`),
renamed over the target in one step, and then the folder itself is flushed so that the rename
survives a crash too (`fsync_dir`). A reader sees the old file or the complete new one, never
a part of it, and a crash leaves at most a temp file behind (named `<prefix><random>.tmp`, so
the owner of the folder can recognise and remove it).

`fsync_file` uses `F_FULLFSYNC` where the platform has it: on macOS a plain `fsync` only
reaches the drive's cache, not the disk.

A write that runs out of room (ENOSPC, or EDQUOT: the user's quota) raises `DiskFull`, an OSError
of that errno whose text names the size and the path ("no space left on device writing 12.3 MB
to /path"): `[Errno 28] No space left on device` alone does not say which file or how much room
it wanted. The temp file is removed, so a full disk leaves no partial file behind either.

`new_file` is the first half alone (the temp file written, flushed and closed, `DiskFull` naming
the file it is for), for a writer that makes it visible by a step of its own: the `file://`
bucket links or renames it into place under a lock of its own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

__all__ = ["DiskFull", "atomic_file", "atomic_write", "fsync_dir", "fsync_file", "new_file"]

#: Errors of fsync on a folder that mean "this file system cannot do that", not "it failed".
_CANNOT_SYNC_DIR = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})
#: Errors of a write that mean the file system (or the user's quota on it) has no room left.
_OUT_OF_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFull(OSError):
    """A write ran out of room; `errno` is ENOSPC or EDQUOT and the text (also `str()`) is one line
    naming the size and the path."""

    def __str__(self) -> str:
        return str(self.strerror)


def size_text(n: int) -> str:
    """`119 bytes`, `12.3 MB` (decimal units, as `ls -lh --si` and Finder count)."""
    if n < 1000:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


class _TempFile(io.FileIO):
    """The unbuffered layer of the temp file `atomic_file` yields: every write an `os.write` loop,
    counting bytes so that running out of room is reported with the size the file was to have."""

    def __init__(self, fd: int, target: Path) -> None:
        super().__init__(fd, "wb")
        self.target = target
        self.written = 0  # bytes in the file
        self.pending = 0  # bytes of the write under way not in it yet

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        done = 0
        with self.out_of_room_named():
            while done < len(view):  # os.write may take a part (a full disk's last room, 2 GiB at most)
                self.pending = len(view) - done
                n = os.write(self.fileno(), view[done:])
                done += n
                self.written += n
            self.pending = 0
        return done

    @contextlib.contextmanager
    def out_of_room_named(self) -> Iterator[None]:
        """Turn running out of room inside the block into a `DiskFull` naming size and target."""
        try:
            yield
        except DiskFull:
            raise
        except OSError as exc:
            if exc.errno not in _OUT_OF_ROOM:
                raise
            what = os.strerror(exc.errno)
            raise DiskFull(
                exc.errno, f"{what[:1].lower()}{what[1:]} writing {size_text(self.written + self.pending)} to {self.target}"
            ) from exc


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

    If the block raises, the temp file is removed and `path` is left as it was; running out of
    room raises `DiskFull`.
    """
    path = Path(path)
    if parents_mode is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=parents_mode)
    prefix = f".{path.name}." if tmp_prefix is None else tmp_prefix
    tmp = path.with_name(f"{prefix}{secrets.token_hex(8)}.tmp")
    with _written(tmp, path, mode=mode, durable=durable, finish=lambda: os.replace(tmp, path)) as f:
        yield f
    if durable:
        fsync_dir(path.parent)


def new_file(
    path: str | os.PathLike[str],
    *,
    target: str | os.PathLike[str] | None = None,
    mode: int | None = None,
    durable: bool = True,
) -> contextlib.AbstractContextManager[BinaryIO]:
    """Create the file `path` (it must not exist) and write it through the binary file this yields;
    when the block ends it is flushed (to stable storage with `durable`, `fsync_file`) and closed.
    Making it visible is the caller's step (a rename, a link); the folder is not flushed.

    - `target`: the file this one is to become, named by `DiskFull` (default: `path`).
    - `mode`: the file's permission bits, set before its first byte (the umask does not apply);
      None: 0o644 less the umask, as `open` creates a file.

    If the block raises, `path` is removed; running out of room raises `DiskFull`.
    """
    path = Path(path)
    return _written(path, Path(target) if target is not None else path, mode=mode, durable=durable)


@contextlib.contextmanager
def _written(
    tmp: Path, target: Path, *, mode: int | None, durable: bool, finish: Callable[[], object] | None = None
) -> Iterator[BinaryIO]:
    """`tmp` created and written through the yielded file, then flushed, closed and `finish`ed (all
    with running out of room named after `target`); removed if anything fails."""
    raw = _TempFile(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644 if mode is None else mode), target)
    try:
        with io.BufferedWriter(raw) as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)  # the umask may have taken bits away
            yield f
            # A file system may report the lack of room only now (delayed allocation, NFS).
            with raw.out_of_room_named():
                f.flush()
                if durable:
                    fsync_file(f.fileno())
                f.close()
                if finish is not None:
                    finish()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
