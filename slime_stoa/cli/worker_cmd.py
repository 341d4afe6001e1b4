"""`stoa worker`: issue, revoke and list the worker keys of a signed run (its registry).

    stoa worker add NAME --key RUN_KEY_FILE [--out FILE]   a new worker id and key (0600 file)
    stoa worker revoke WORKER --key RUN_KEY_FILE           refuse everything its key signs, from now on
    stoa worker release WORKER --key RUN_KEY_FILE          lift a quarantine (counts a release; none
                                                           for a worker that is not quarantined)
    stoa worker list [--key RUN_KEY_FILE]                  the registry

Every edit rewrites `runs/<run>/registry.json` signed by the run key, by a conditional put. The
worker key file goes to the Mac (`macd join --worker-key FILE`); it never enters the bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from slime_stoa.protocol.layout import check_worker_id
from slime_stoa.protocol.registry import (
    Registry,
    WorkerEntry,
    add_worker,
    check_display_name,
    find_worker,
    read_registry,
    release_worker,
    revoke_worker,
    update_registry,
)
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, load_rotations
from slime_stoa.protocol.signing import PublicKey, SigningKey, read_key_file
from slime_stoa.protocol.store import StoreError, open_store
from slime_stoa.protocol.worker_keys import WorkerKeyFile, write_worker_key_file
from slime_stoa.trainer.consumer.persistence import read_state

from .common import add_run_options, require_run_options, shell_command

_PREFIX_MAX = 41  # leaves room for "-" and 6 hex digits in a 48-character worker id


def new_worker_id(name: str) -> str:
    """`<name squeezed into [a-z0-9-]>-<6 random hex digits>` (the form `macd join` gives ids)."""
    prefix = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:_PREFIX_MAX].rstrip("-") or "mac"
    return check_worker_id(f"{prefix}-{secrets.token_hex(3)}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    worker = sub.add_parser("worker", help="issue, revoke and list the worker keys of a signed run", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = worker.add_subparsers(title="worker commands", metavar="COMMAND", required=True)

    add = cmds.add_parser("add", help="issue a worker key and register it",
                          description="Make a worker id and key, write the key to a 0600 file for `macd join "
                          "--worker-key`, and add its public half to the run's registry.")
    add.add_argument("name", help="display name of the worker (its id is made from it)")
    _key_options(add, required=True)
    add.add_argument("--out", type=Path, help="worker key file to write (default: ./<worker id>.worker-key)")
    add.add_argument("--worker-id", help="use this worker id instead of a fresh one")
    add.set_defaults(handler=_add)

    for name, text, handler in (
        ("revoke", "revoke a worker's key: nothing it signs is accepted from now on, also records not yet consumed", _revoke),
        ("release", "lift a worker's quarantine (counts one release in the registry; a worker that is "
                    "not quarantined gets none)", _release),
    ):
        cmd = cmds.add_parser(name, help=text, description=text)
        cmd.add_argument("worker", help="worker id (or its display name, if only one worker has it)")
        _key_options(cmd, required=True)
        cmd.set_defaults(handler=handler)

    show = cmds.add_parser("list", help="print the run's registry (verified with the run key)")
    _key_options(show, required=False)
    show.set_defaults(handler=_list)


def _key_options(parser: argparse.ArgumentParser, *, required: bool) -> None:
    add_run_options(parser)
    parser.add_argument(
        "--key", type=Path, required=required, metavar="RUN_KEY_FILE",
        help="the run key (0600 PEM file; `stoa keys create`)" + ("" if required else "; default: the run manifest's public key"),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Issued:
    entry: WorkerEntry
    path: Path
    registry: Registry
    run_key: str  # the run manifest's run_key text: what `macd join --run-key` pins


async def _run_key(store_url: str, run: str, key: SigningKey) -> tuple[tuple[PublicKey, ...], str]:
    """The run's keys (the manifest's and every rotation since) and the manifest's run_key text;
    ValueError unless `key` is the current one (the newest: after `stoa keys rotate`, the new key)."""
    async with open_store(store_url) as store:
        manifest = await read_run_manifest(store, run)
        if manifest.public_key is None:
            raise ValueError(f"run {run!r} is not signed (its manifest has no run_key): it has no worker registry")
        trust = RunTrust(run, manifest.public_key)
        await load_rotations(store, trust)
    if key.public != trust.newest:
        raise ValueError(
            f"key {key.key_id} is not the current run key of run {run!r} (that is {trust.newest.key_id}, "
            f"fingerprint {trust.newest.fingerprint}): use that key file"
        )
    assert manifest.run_key is not None  # public_key is its parse
    return trust.keys, manifest.run_key


async def issue(store_url: str, run: str, name: str, run_key: SigningKey, *, out: Path | None = None,
                worker_id: str | None = None, now: Callable[[], float] = time.time) -> Issued:
    """Issue a worker key: write its 0600 key file (refusing to replace one), then register it.
    If the registry update fails, the key file is removed again."""
    check_display_name(name)
    worker = check_worker_id(worker_id) if worker_id else new_worker_id(name)
    keys, pinned = await _run_key(store_url, run, run_key)
    key = SigningKey.generate()
    path = Path(out) if out is not None else Path.cwd() / f"{worker}.worker-key"
    write_worker_key_file(path, WorkerKeyFile(run=run, worker=worker, key=key))
    try:
        async with open_store(store_url) as store:
            registry = await update_registry(
                store, run, run_key, partial(add_worker, worker=worker, name=name, key=key.public, now=now()), trusted=keys
            )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return Issued(entry=registry.workers[worker], path=path, registry=registry, run_key=pinned)


async def edit(store_url: str, run: str, run_key: SigningKey, change: Callable[[Registry], Registry]) -> Registry:
    keys, _ = await _run_key(store_url, run, run_key)
    async with open_store(store_url) as store:
        return await update_registry(store, run, run_key, change, trusted=keys)


async def show(store_url: str, run: str, run_key: PublicKey | None) -> Registry:
    """The registry, verified with `run_key` (default: the run manifest's, which must have one)."""
    async with open_store(store_url) as store:
        if run_key is None:
            pinned = (await read_run_manifest(store, run)).public_key
            if pinned is None:
                raise ValueError(f"run {run!r} is not signed (its manifest has no run_key): it has no worker registry")
            trust = RunTrust(run, pinned)
            await load_rotations(store, trust)
            read = await read_registry(store, run, trust.keys)
        else:
            read = await read_registry(store, run, run_key)
    assert read is not None
    return read.registry


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def _add(args: argparse.Namespace) -> int:
    try:
        store_url, run = require_run_options(args)
        issued = asyncio.run(issue(store_url, run, args.name, read_key_file(args.key), out=args.out, worker_id=args.worker_id))
    except (StoreError, ValueError) as exc:
        return _fail(exc)
    e = issued.entry
    print(f"added worker {e.worker} ({e.name}) to run {run!r}: key {e.key.key_id} ({e.key.fingerprint}), "
          f"registry serial {issued.registry.serial}")
    print(f"worker key written to {issued.path} (0600). Copy it to the Mac and run:")
    print("  " + join_command(store_url, run, issued))
    return 0


def join_command(store_url: str, run: str, issued: Issued) -> str:
    """The `macd join` that sets up the Mac holding the issued key file (in its current folder),
    pinning the run key so that a run re-created under another key is refused from the start."""
    return shell_command("macd", "join", store_url, "--run", run, "--run-key", issued.run_key,
                         "--worker-key", issued.path.name)


def _edit(args: argparse.Namespace, change: Callable[[Registry], Registry], verb: str) -> int:
    try:
        store_url, run = require_run_options(args)
        registry = asyncio.run(edit(store_url, run, read_key_file(args.key), change))
    except (StoreError, ValueError) as exc:
        return _fail(exc)
    print(f"{verb} in the registry of run {run!r} (serial {registry.serial})")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    return _edit(args, partial(revoke_worker, worker=args.worker, now=time.time()), f"revoked worker {args.worker}")


async def release(store_url: str, run: str, run_key: SigningKey, worker: str) -> tuple[Registry | None, str]:
    """Count one release of `worker` when the trainer's saved state has it quarantined; (the
    registry, what was done), or (None, why nothing was counted) when it is not quarantined or a
    release of it is already waiting for the trainer. A state that cannot be read or verified
    does not say: the release is counted, and the message says so."""
    keys, _ = await _run_key(store_url, run, run_key)
    async with open_store(store_url) as store:
        read = await read_registry(store, run, keys)
        assert read is not None
        entry = find_worker(read.registry, worker)
        note = ""
        try:
            state, _ = await read_state(store, run, signed_by=keys)
        except ValueError as exc:  # UntrustedState among them
            state, note = None, f" (the trainer's state could not be checked: {exc})"
        if not note:
            record = None if state is None else state.quarantine.get(entry.worker)
            if record is None or not record.quarantined:
                return None, (f"worker {entry.worker} is not quarantined by the trainer of run {run!r}: "
                              f"nothing to release, no release counted")
            if entry.releases > record.releases:
                return None, (f"worker {entry.worker} already has a release the trainer has not applied yet "
                              f"(it does when it next reads the registry): no release counted")
        registry = await update_registry(
            store, run, run_key, partial(release_worker, worker=entry.worker), trusted=keys
        )
    count = registry.workers[entry.worker].releases
    return registry, f"released worker {entry.worker} (release {count}){note}"


def _release(args: argparse.Namespace) -> int:
    try:
        store_url, run = require_run_options(args)
        registry, said = asyncio.run(release(store_url, run, read_key_file(args.key), args.worker))
    except (StoreError, ValueError) as exc:
        return _fail(exc)
    print(said if registry is None else f"{said}, in the registry of run {run!r} (serial {registry.serial})")
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        store_url, run = require_run_options(args)
        registry = asyncio.run(show(store_url, run, None if args.key is None else read_key_file(args.key).public))
    except (StoreError, ValueError) as exc:
        return _fail(exc)
    print(f"registry of run {run!r}: serial {registry.serial}, {len(registry.workers)} worker(s)")
    if registry.workers:
        print(f"{'WORKER':<30} {'NAME':<20} {'KEY':<16} {'ADDED':<19} {'REVOKED':<19} RELEASES")
    for e in registry.workers.values():
        print(f"{e.worker:<30} {e.name:<20} {e.key.key_id:<16} {_when(e.added_at):<19} {_when(e.revoked_at):<19} {e.releases}")
    return 0
