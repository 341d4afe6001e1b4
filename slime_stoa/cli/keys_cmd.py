"""`stoa keys`: create, show and rotate a run key (Ed25519; the private half never leaves its 0600 file).

- `stoa keys create PATH`: a new key file (mode 0600);
- `stoa keys show PATH`: its public key text (for `stoa run create --key` / `macd join --run-key`),
  key id and fingerprint — never the private key;
- `stoa keys rotate --store URL --run RUN --old PATH --new PATH`: announce a new run key. Writes
  `runs/<run>/keys/<seq>.json` signed by the old key, carrying the new key's signed acceptance of
  the old one (the new key signs every version after the current one), and re-signs the current
  pointer with the new key. Stop the trainer first, then restart it with the new key: from it,
  the acceptances lead back to the run's first key (`run_trust.vouched_first_key`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import (
    RunTrust,
    Untrusted,
    load_rotations,
    read_rotation,
    rotation_bytes,
    rotation_document,
)
from slime_stoa.protocol.signing import (
    KeyFileError,
    PublicKey,
    SigningKey,
    read_key_file,
    verify_document,
    write_key_file,
)
from slime_stoa.protocol.store import NotFound, PreconditionFailed, Store, StoreError, open_store
from slime_stoa.protocol.store.capped import TooLarge

from .common import add_run_options, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="create, show or rotate a run key", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    cmds = keys.add_subparsers(title="keys commands", metavar="COMMAND", required=True)
    create = cmds.add_parser("create", help="write a new Ed25519 key file (mode 0600)")
    create.add_argument("path", type=Path, metavar="PATH")
    create.set_defaults(handler=_create)
    show = cmds.add_parser("show", help="print a key file's public key, key id and fingerprint")
    show.add_argument("path", type=Path, metavar="PATH")
    show.set_defaults(handler=_show)
    rotate = cmds.add_parser("rotate", help="announce a new run key, signed by the old one")
    add_run_options(rotate)
    rotate.add_argument("--old", type=Path, required=True, metavar="PATH", help="the run's current key file")
    rotate.add_argument("--new", type=Path, required=True, metavar="PATH", help="the new key file (`stoa keys create`)")
    rotate.set_defaults(handler=_rotate)


def public_lines(key: PublicKey) -> list[str]:
    return [f"public key   {key.to_text()}", f"key id       {key.key_id}", f"fingerprint  {key.fingerprint}"]


def _create(args: argparse.Namespace) -> int:
    try:
        key = SigningKey.generate()
        write_key_file(args.path, key)
    except (KeyFileError, OSError) as exc:
        return _error(str(exc))
    print(f"wrote key file {args.path} (mode 0600; keep it off the bucket)")
    for line in public_lines(key.public):
        print(line)
    return 0


def _show(args: argparse.Namespace) -> int:
    try:
        key = read_key_file(args.path)
    except KeyFileError as exc:
        return _error(str(exc))
    for line in public_lines(key.public):
        print(line)
    return 0


async def rotate_key(url: str, run: str, old: SigningKey, new: SigningKey) -> tuple[int, int]:
    """Announce `new` as the run key after `old` (the current one) in the bucket at `url`
    (`rotate_in`)."""
    async with open_store(url) as store:
        return await rotate_in(store, run, old, new)


async def rotate_in(store: Store, run: str, old: SigningKey, new: SigningKey) -> tuple[int, int]:
    """Announce `new` as the run key after `old` (the current one); returns (rotation number,
    from_version). ValueError when `old` is not the current key, StoreError on the bucket."""
    from slime_stoa.protocol.pulse.history import NotPublished, read_pointer_etag

    manifest = await read_run_manifest(store, run)
    if manifest.run_key is None:
        raise ValueError(f"run {run!r} is unsigned (no run_key): there is no key to rotate")
    trust = RunTrust.from_text(run, manifest.run_key)
    try:
        await load_rotations(store, trust)
    except Untrusted as exc:
        raise ValueError(f"the run's key rotations do not verify: {exc}") from None
    if trust.newest != old.public:
        raise ValueError(f"--old key {old.key_id} is not run {run!r}'s current key ({trust.newest.key_id})")
    if trust.knows(new.key_id):
        raise ValueError(f"--new key {new.key_id} is already a key of run {run!r}")
    try:
        found = await read_pointer_etag(store, run, trust=trust)
    except NotPublished:
        found = None
    seq = trust.rotations + 1
    version = found[0].version if found else -1
    doc = rotation_document(run, seq, new, version, old)  # with the new key's acceptance
    key = RunLayout(run).key_rotation(seq)
    try:
        await store.put_if_absent(key, rotation_bytes(doc))
    except PreconditionFailed:
        # Something is there. A rotation `old` signed (another rotation meanwhile) stands; anything
        # else is a bucket writer's junk, which readers pass over and the run key's holder replaces.
        try:
            verify_document((await read_rotation(store, key))[1], old.public, where=key)
        except (NotFound, TooLarge, ValueError):
            await store.put(key, rotation_bytes(doc))
        else:
            raise
    if found is not None:
        pointer, etag = found
        await store.cas(RunLayout(run).pointer, pointer.to_bytes(new), etag)
    return seq, version


def _rotate(args: argparse.Namespace) -> int:
    try:
        url, run = require_run_options(args)
        old, new = read_key_file(args.old), read_key_file(args.new)
        seq, version = asyncio.run(rotate_key(url, run, old, new))
    except PreconditionFailed:
        return _error("the pointer or rotation changed while rotating (is a trainer still publishing?); retry")
    except (StoreError, ValueError) as exc:
        return _error(str(exc))
    after = f"every version after v{version}" if version >= 0 else "every version"
    print(f"rotation {seq} of run {run!r}: key {new.key_id} ({new.public.fingerprint}) now signs {after}")
    print("restart the trainer with the new key (stoa_run_key); workers learn the rotation from the bucket")
    return 0


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1
