"""The folder store's listings of big folders: pages in key order from anywhere in the folder, served
from the cached sorted names while the folder is unchanged, and never from stale names (a change
is seen by the next listing, even one made within the same timestamp tick); a FIFO planted at a
key neither blocks a listing nor a read."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from slime_stoa.protocol.store import NotFound, local_listing
from slime_stoa.protocol.store.local import _LIST_PAGE, LocalStore
from slime_stoa.protocol.store.local_listing import SortedFolders

N = 2 * _LIST_PAGE + 345  # three pages


def key(i: int) -> str:
    return f"p/{i:06d}.rec"


def lay_files(root: Path, names: list[str]) -> None:
    """Files written directly (as a writer of the folder can), faster than puts."""
    for name in names:
        path = root.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())


def age_folder(folder: Path, seconds: float = 10.0) -> None:
    """Pretend the folder's last change was `seconds` ago (its mtime; its ctime moves to now,
    which `quiet_clock` then puts in the past too)."""
    t = time.time_ns() - int(seconds * 1e9)
    os.utime(folder, ns=(t, t))


@pytest.fixture
def quiet_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing's clock runs 10 s ahead, so folders changed before a listing count as quiet
    (cacheable) without the test sleeping for `QUIET_NS`."""
    real = time.time_ns
    monkeypatch.setattr(local_listing.time, "time_ns", lambda: real() + 10_000_000_000)


async def keys_of(store: LocalStore, prefix: str = "", start_after: str | None = None) -> list[str]:
    return [info.key async for info in store.list(prefix, start_after=start_after)]


async def test_a_big_folder_lists_in_key_order_in_pages_from_anywhere(tmp_path: Path) -> None:
    names = [key(i) for i in range(N)]
    lay_files(tmp_path, names[::-1])
    lay_files(tmp_path, ["o/x", "p/sub/a", "p0", "q/1"])  # around and inside the folder
    store = LocalStore(tmp_path)
    inside = sorted([*names, "p/sub/a"])
    assert await keys_of(store, "p/") == inside
    assert await keys_of(store) == ["o/x", *inside, "p0", "q/1"]
    for at in (0, 999, 1000, 1001, N - 1):
        assert await keys_of(store, "p/", start_after=key(at)) == [k for k in inside if k > key(at)]
    assert await keys_of(store, "p/", start_after="p/sub/") == ["p/sub/a"]
    assert await keys_of(store, "p/", start_after="p/sub/a") == []
    assert await keys_of(store, "p/0012") == [key(i) for i in range(1200, 1300)]
    assert await keys_of(store, "", start_after="p/0") == [*inside, "p0", "q/1"]
    assert await keys_of(store, "p", start_after="p/zz") == ["p0"]
    infos = [info async for info in store.list("p/", start_after=key(N - 2))]
    assert [(i.key, i.size) for i in infos] == [(key(N - 1), len(key(N - 1))), ("p/sub/a", 7)]


async def test_an_unchanged_folder_is_read_once_and_served_by_bisection(tmp_path: Path, quiet_clock: None) -> None:
    lay_files(tmp_path, [key(i) for i in range(N)])
    store = LocalStore(tmp_path)
    folders = store._folders
    assert await keys_of(store, "p/", start_after=key(N - 3)) == [key(N - 2), key(N - 1)]
    scans = folders.scans
    for at in range(0, N - 1, 500):
        listing = store.list("p/", start_after=key(at))
        assert (await anext(listing)).key == key(at + 1)
        await listing.aclose()
    assert folders.scans == scans  # the root and p/ were served from the cache


async def test_changes_between_listings_are_seen_in_a_cached_folder(tmp_path: Path, quiet_clock: None) -> None:
    lay_files(tmp_path, [key(i) for i in range(0, N, 2)])
    store = LocalStore(tmp_path)
    await store.put("q/first", b"")  # the store's own folders now exist: later puts change only p/
    assert len(await keys_of(store, "p/")) == len(range(0, N, 2))
    scans = store._folders.scans
    await store.put_if_absent(key(1), b"new")  # in the first page
    await store.put_if_absent(key(N), b"new")  # after the end
    await store.delete(key(2))
    assert await keys_of(store, "p/", start_after=key(0)) == [key(1), *(key(i) for i in range(4, N, 2)), key(N)]
    assert store._folders.scans == scans + 1  # p/ read again, the root (unchanged) not


async def test_a_change_that_leaves_the_mtime_as_it_was_is_seen(tmp_path: Path, quiet_clock: None) -> None:
    lay_files(tmp_path, [key(i) for i in range(10)])
    folder = tmp_path / "p"
    age_folder(folder)
    store = LocalStore(tmp_path)
    assert len(await keys_of(store, "p/")) == 10
    before = os.stat(folder)
    (folder / "000010.rec").write_bytes(b"late")  # a writer restores the mtime after adding a file
    os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(folder).st_mtime_ns == before.st_mtime_ns
    assert (await keys_of(store, "p/"))[-1] == key(10)  # the ctime moved: read again


async def test_a_folder_changed_just_now_is_read_again_on_every_listing(tmp_path: Path) -> None:
    """Timestamps are coarse: two changes in one tick leave the same stat, so a folder changed
    within `QUIET_NS` of the listing is never cached."""
    lay_files(tmp_path, [key(i) for i in range(10)])
    store = LocalStore(tmp_path)
    for i in range(10, 13):
        assert (await keys_of(store, "p/"))[-1] == key(i - 1)
        (tmp_path / "p" / f"{i:06d}.rec").write_bytes(b"x")
    assert (await keys_of(store, "p/"))[-1] == key(12)
    assert str(tmp_path / "p") not in store._folders._cache


def test_the_cache_holds_a_bounded_number_of_folders(tmp_path: Path, quiet_clock: None) -> None:
    folders = SortedFolders(capacity=2)
    for name in "abc":
        (tmp_path / name).mkdir()
        (tmp_path / name / "k").write_bytes(b"")
        assert folders.names(tmp_path / name) == ("k",)
    assert list(folders._cache) == [str(tmp_path / "b"), str(tmp_path / "c")]
    assert folders.names(tmp_path / "gone") == ()


async def test_keys_deleted_during_a_listing_are_skipped(tmp_path: Path) -> None:
    lay_files(tmp_path, [key(i) for i in range(N)])
    store = LocalStore(tmp_path)
    listing = store.list("p/")
    first = [(await anext(listing)).key for _ in range(_LIST_PAGE)]
    await store.delete(key(N - 1))  # in a page not read yet
    rest = [info.key async for info in listing]
    assert first + rest == [key(i) for i in range(N - 1)]


async def test_a_fifo_among_the_keys_is_skipped_without_blocking(tmp_path: Path) -> None:
    lay_files(tmp_path, [key(0), key(2)])
    os.mkfifo(tmp_path / "p" / "000001.rec")
    store = LocalStore(tmp_path)
    assert await asyncio.wait_for(keys_of(store, "p/"), timeout=60) == [key(0), key(2)]


def test_every_prefix_and_start_after_lists_what_a_sorted_filter_gives(tmp_path: Path, quiet_clock: None) -> None:
    """The bisection against the plain definition (keys with the prefix after start_after, in
    order), over nested folders whose names sort around "/" ("a-", "a.", "a0" sort beside "a/")."""
    keys = ["a", "a-", "a.b", "a0", "b/a", "b/a-/x", "b/a/x", "b/a/y/z", "b/a0", "b/b", "c-/d", "c/d", "c0"]
    keys = [k for k in keys if not any(other.startswith(k + "/") for other in keys)]  # a key is not also a folder
    lay_files(tmp_path, keys)
    folders = SortedFolders()
    probes = sorted({"", *(k[:i] for k in keys for i in range(len(k) + 1)), "b/a/", "b/a/y/", "zz", "b/zz"})
    for prefix in probes:
        for start_after in probes:
            want = [k for k in sorted(keys) if k.startswith(prefix) and k > start_after]
            assert list(folders.walk(tmp_path, "", prefix, start_after)) == want, (prefix, start_after)


async def test_a_fifo_at_a_key_is_not_found_without_blocking_its_reader(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    os.mkfifo(tmp_path / "p" / "current.json")
    store = LocalStore(tmp_path)
    for read in (store.get("p/current.json"), store.head("p/current.json")):
        with pytest.raises(NotFound):
            await asyncio.wait_for(read, timeout=60)
