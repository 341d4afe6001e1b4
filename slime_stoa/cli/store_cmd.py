"""`stoa store`: check a bucket end to end, list its objects."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import TextIO

from slime_stoa.protocol.store import (
    NotFound,
    PreconditionFailed,
    StoreError,
    open_store,
)

from .common import add_store_option, require_store


def add_parser(sub: argparse._SubParsersAction) -> None:
    store = sub.add_parser("store", help="check or browse a bucket", description=__doc__)
    cmds = store.add_subparsers(title="store commands", metavar="COMMAND", required=True)

    check = cmds.add_parser(
        "check",
        help="exercise every store operation on a bucket and report latency",
        description=(
            "Writes, reads, conditionally rewrites, lists and deletes a few probe objects under "
            "<prefix>/stoa-check/ to prove the bucket works for stoa (conditional writes included)."
        ),
    )
    check.add_argument(
        "url", nargs="?", default=None,
        help="store URL, e.g. file:///tmp/stoa-bucket or r2://<account>/<bucket>; default --store / $STOA_STORE",
    )  # fmt: skip
    add_store_option(check)
    check.add_argument("--create", action="store_true", help="create a missing local folder")
    check.set_defaults(handler=run_check)

    ls = cmds.add_parser("ls", help="list objects under a prefix")
    ls.add_argument("url", nargs="?", default=None, help="store URL; default --store / $STOA_STORE")
    ls.add_argument("prefix", nargs="?", default="", help="key prefix, e.g. runs/demo/")
    add_store_option(ls)
    ls.set_defaults(handler=run_ls)


class StoreCheckFailed(Exception):
    """The store answered, but not with the semantics stoa relies on."""


def _expect(ok: bool, problem: str) -> None:
    """A check of the remote store's behaviour: an exception, not an `assert` (kept under -O)."""
    if not ok:
        raise StoreCheckFailed(problem)


async def check_store(url: str, *, create: bool = False, out: TextIO | None = None) -> None:
    """Run the probe sequence; raises StoreError (or StoreCheckFailed on broken semantics)."""
    out = out or sys.stdout
    base = f"stoa-check/{uuid.uuid4().hex[:12]}"
    async with open_store(url, create=create) as store:

        async def step(name: str, coro):
            start = time.perf_counter()
            result = await coro
            print(f"  {name:<38} ok  {1000 * (time.perf_counter() - start):7.1f} ms", file=out)
            return result

        async def refused(name: str, coro, problem: str) -> None:
            start = time.perf_counter()
            try:
                await coro
            except PreconditionFailed:
                print(f"  {name:<38} ok  {1000 * (time.perf_counter() - start):7.1f} ms", file=out)
                return
            raise StoreCheckFailed(problem)

        print(f"checking {url}", file=out, flush=True)
        payload = uuid.uuid4().bytes * 64
        etag = await step("put-if-absent", store.put_if_absent(f"{base}/object", payload))
        await refused(
            "put-if-absent again (refused)",
            store.put_if_absent(f"{base}/object", b"x"),
            "the store accepted a second put-if-absent: If-None-Match is not honoured",
        )
        got = await step("get", store.get(f"{base}/object"))
        _expect(got is not None and got.data == payload, "read back different bytes")
        unchanged = await step("conditional get (must be unchanged)", store.get(f"{base}/object", if_none_match=etag))
        _expect(unchanged is None, "conditional get returned data for an unchanged object")
        part = await step("ranged get", store.get(f"{base}/object", offset=16, length=32))
        _expect(part is not None and part.data == payload[16:48], "ranged get returned the wrong bytes")
        pointer = await step("create pointer", store.cas(f"{base}/pointer", b"1", None))
        await step("compare-and-swap pointer", store.cas(f"{base}/pointer", b"2", pointer))
        await refused(
            "stale compare-and-swap (refused)",
            store.cas(f"{base}/pointer", b"3", pointer),
            "a stale compare-and-swap succeeded: If-Match is not honoured",
        )
        keys = await step("list", _keys(store, f"{base}/"))
        _expect(keys == [f"{base}/object", f"{base}/pointer"], f"listing returned {keys}")
        for key in keys:
            await step(f"delete {key.rsplit('/', 1)[1]}", store.delete(key))
        try:
            await store.head(f"{base}/object")
        except NotFound:
            pass
        else:
            raise StoreCheckFailed("a deleted object is still there")
    print("store OK: stoa can use it", file=out)


async def _keys(store, prefix: str) -> list[str]:
    return [info.key async for info in store.list(prefix)]


def _url_and_prefix(args: argparse.Namespace) -> tuple[str, str]:
    """The positional URL, else --store / $STOA_STORE; a lone positional without a scheme is the
    prefix of `stoa store ls` (`STOA_STORE=... stoa store ls runs/demo/`)."""
    url, prefix = args.url, getattr(args, "prefix", "")
    if url is not None and "://" not in url and not prefix and hasattr(args, "prefix"):
        url, prefix = None, url
    if url is not None and args.store and url != args.store and args.store != os.environ.get("STOA_STORE"):
        raise SystemExit(f"error: two buckets given ({url} and --store {args.store}): pass one")
    return url or require_store(args), prefix


def run_check(args: argparse.Namespace) -> int:
    url, _ = _url_and_prefix(args)
    try:
        asyncio.run(check_store(url, create=args.create))
    except (StoreError, ValueError, StoreCheckFailed) as exc:
        sys.stdout.flush()
        print(f"store check FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


async def _ls(url: str, prefix: str) -> None:
    async with open_store(url) as store:
        async for info in store.list(prefix):
            print(f"{info.size:>12}  {info.key}")


def run_ls(args: argparse.Namespace) -> int:
    url, prefix = _url_and_prefix(args)
    try:
        asyncio.run(_ls(url, prefix))
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
