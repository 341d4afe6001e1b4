"""The local-folder backend (`file://`): the same guarantees as S3 with conditional writes.

- Every write goes to a temp file under `<root>/.stoa-tmp/` and becomes visible in one atomic step
  (`link` for put-if-absent, which fails if the key exists; `rename` otherwise), so a reader never
  sees a partial object.
- Writes to an existing key (plain put and compare-and-swap) hold an exclusive `flock` per key, so
  across threads and processes exactly one CAS wins.
- The ETag is an xxh3-128 of the content, kept in an extended attribute of the file when the file
  system supports it (recomputed from the content otherwise).
- A listing starts at `start_after` by bisection in the folder's sorted names, kept while the
  folder is unchanged (`local_listing.py`), and stats a page of keys per thread hop: a page costs
  the same in a folder of millions of keys (junk in a rollouts prefix) as in a small one.

Limitation: a key cannot also be the folder of other keys (`a` and `a/b`), unlike in S3.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import fcntl
import os
import stat
import uuid
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path

import xxhash

from slime_stoa.protocol.fsutil import new_file

from .base import (
    GetResult,
    NotFound,
    ObjectInfo,
    Payload,
    PreconditionFailed,
    Store,
    StoreConfigError,
    StoreError,
    check_key,
    check_prefix,
    check_range,
)
from .local_listing import SortedFolders

_TMP = ".stoa-tmp"
_LOCKS = ".stoa-locks"
_XATTR = "user.stoa.etag"
_HAS_XATTR = hasattr(os, "setxattr")
_LIST_PAGE = 1000


def _save_etag(path: Path, etag: str) -> None:
    if _HAS_XATTR:
        with contextlib.suppress(OSError):
            os.setxattr(path, _XATTR, etag.encode())


def _file_etag(path: Path) -> str:
    if _HAS_XATTR:
        with contextlib.suppress(OSError):
            return os.getxattr(path, _XATTR).decode()
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class LocalStore(Store):
    def __init__(self, root: Path, *, url: str | None = None, durable: bool = True):
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.durable = durable  # fsync files before they become visible
        self._folders = SortedFolders()  # listings start in a big folder at O(log n)

    # -- paths -------------------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _check_root(self) -> None:
        if self.root.is_dir():
            return
        relative = self.url.startswith("file://") and not self.url.startswith("file:///")
        absolute = Path("/") / self.url.removeprefix("file://")
        if relative and not self.root.is_absolute() and absolute.parent.is_dir():
            raise StoreConfigError(
                f"store folder {self.root} does not exist: {self.url} (two slashes) is the folder "
                f"{self.root} relative to here; for {absolute} write file://{absolute}"
            )
        raise StoreConfigError(
            f"store folder {self.root} does not exist: create it (mkdir -p {self.root}) "
            f"or fix the file:// URL"
        )

    def _lock_path(self, key: str) -> Path:
        return self.root / _LOCKS / f"{xxhash.xxh3_64_hexdigest(key.encode())}.lock"

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock = self._lock_path(key)
        lock.parent.mkdir(exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- writing -----------------------------------------------------------------------------
    async def _write_temp(self, data: Payload, path: Path) -> tuple[Path, str]:
        """Write the payload to a fresh temp file that is to become `path`; returns its path and
        ETag. A full disk is `DiskFull` naming `path` and the size."""
        self._check_root()
        tmp_dir = self.root / _TMP
        tmp_dir.mkdir(exist_ok=True)
        tmp = tmp_dir / uuid.uuid4().hex
        digest = xxhash.xxh3_128()
        try:
            with contextlib.ExitStack() as writing:
                f = writing.enter_context(new_file(tmp, target=path, durable=self.durable))
                if isinstance(data, (bytes, bytearray, memoryview)):
                    digest.update(data)
                    await asyncio.to_thread(f.write, data)
                else:
                    async for chunk in data:
                        digest.update(chunk)
                        f.write(chunk)
                # flushed, fsynced when durable, and closed off the event loop (removed if that fails)
                await asyncio.to_thread(writing.pop_all().close)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        etag = digest.hexdigest()
        _save_etag(tmp, etag)
        return tmp, etag

    def _prepare_parent(self, path: Path, key: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(f"cannot write {key!r}: a parent of it is an object in {self.url}") from None
        if path.is_dir():
            raise StoreError(f"cannot write {key!r}: it is a folder of other objects in {self.url}")

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        path = self._path(key)
        tmp, etag = await self._write_temp(data, path)
        try:
            await asyncio.to_thread(self._replace, tmp, path, key, if_match)
        finally:
            tmp.unlink(missing_ok=True)
        return etag

    def _replace(self, tmp: Path, path: Path, key: str, if_match: str | None) -> None:
        self._prepare_parent(path, key)
        with self._locked(key):
            if if_match is not None:
                try:
                    current = _file_etag(path)
                except FileNotFoundError:
                    raise PreconditionFailed(f"{key!r} does not exist; cannot replace it by ETag") from None
                if current != if_match:
                    raise PreconditionFailed(f"{key!r} changed (ETag {current} != {if_match})")
            os.replace(tmp, path)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        path = self._path(key)
        tmp, etag = await self._write_temp(data, path)
        try:
            await asyncio.to_thread(self._link, tmp, path, key)
        finally:
            tmp.unlink(missing_ok=True)
        return etag

    def _link(self, tmp: Path, path: Path, key: str) -> None:
        self._prepare_parent(path, key)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise PreconditionFailed(f"{key!r} already exists") from None

    # -- reading -----------------------------------------------------------------------------
    async def get(
        self,
        key: str,
        *,
        offset: int = 0,
        length: int | None = None,
        if_none_match: str | None = None,
    ) -> GetResult | None:
        check_range(offset, length)
        path = self._path(key)
        return await asyncio.to_thread(self._read, path, key, offset, length, if_none_match)

    def _read(
        self, path: Path, key: str, offset: int, length: int | None, if_none_match: str | None
    ) -> GetResult | None:
        self._check_root()
        fd, st = self._open_object(path, key)
        with os.fdopen(fd, "rb") as f:
            # The open file keeps this version alive even if it is replaced meanwhile.
            etag = _etag_of_fd(fd)
            if if_none_match is not None and if_none_match == etag:
                return None
            f.seek(offset)
            data = f.read() if length is None else f.read(length)
        return GetResult(data=data, etag=etag, size=st.st_size)

    def _open_object(self, path: Path, key: str) -> tuple[int, os.stat_result]:
        """An open descriptor of the object at `path` and its stat; `NotFound` unless it is a
        regular file. O_NONBLOCK: a FIFO planted at a key must not block its reader (a regular
        file's reads ignore the flag)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{key!r} not found in {self.url}") from None
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):  # a folder of other keys, or no object at all
            os.close(fd)
            raise NotFound(f"{key!r} not found in {self.url}")
        return fd, st

    async def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        return await asyncio.to_thread(self._stat, path, key)

    def _stat(self, path: Path, key: str) -> ObjectInfo:
        self._check_root()
        return self._info(path, key)

    def _info(self, path: Path, key: str) -> ObjectInfo:
        fd, st = self._open_object(path, key)
        try:
            # The open file keeps this version alive: its size and ETag belong together.
            return ObjectInfo(key=key, size=st.st_size, etag=_etag_of_fd(fd), last_modified=st.st_mtime)
        finally:
            os.close(fd)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        check_prefix(prefix)
        await asyncio.to_thread(self._check_root)
        keys = self._folders.walk(self.root, "", prefix, start_after or "")
        while True:
            # One thread hop per page, not per key: a page of junk costs its stats, no more.
            page, ended = await asyncio.to_thread(self._stat_page, keys, _LIST_PAGE)
            for info in page:
                yield info
            if ended:
                return

    def _stat_page(self, keys: Iterator[str], n: int) -> tuple[Sequence[ObjectInfo], bool]:
        """The next `n` keys' infos (keys deleted meanwhile skipped) and whether `keys` ran out."""
        page: builtins.list[ObjectInfo] = []  # `list` here is the method
        for taken, key in enumerate(keys, 1):
            with contextlib.suppress(NotFound):  # deleted while listing
                page.append(self._info(self._path(key), key))
            if taken == n:
                return page, False
        return page, True

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await asyncio.to_thread(self._unlink, path)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError):
            return
        except IsADirectoryError:
            raise StoreError(f"{path} is a folder of other objects, not an object") from None
        # Drop folders left empty, so listings stay fast.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    break
                raise
            parent = parent.parent


def _etag_of_fd(fd: int) -> str:
    if _HAS_XATTR:
        with contextlib.suppress(OSError):
            return os.getxattr(fd, _XATTR).decode()
    digest = xxhash.xxh3_128()
    at = 0
    while chunk := os.pread(fd, 8 << 20, at):  # pread: the caller's file position stays where it is
        digest.update(chunk)
        at += len(chunk)
    return digest.hexdigest()
