"""`stoa weights`: seed, inspect, verify and export a run's weights in the bucket."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path

from slime_stoa.protocol.hf.architectures import unsupported_model
from slime_stoa.protocol.hf.folders import load_hf_state, save_hf_folder
from slime_stoa.protocol.layout import RunLayout, parse_versioned
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import (
    HistoryError,
    MalformedPointer,
    NotPublished,
    find_manifest,
    read_anchor_manifest,
    read_manifest,
    read_pointer,
    read_pointer_etag,
    walk_back,
)
from slime_stoa.protocol.pulse.manifests import ManifestError, Pointer
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, PublishError, publisher_trust
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, weights_trust
from slime_stoa.protocol.signing import PublicKey, read_key_file
from slime_stoa.protocol.store import GetResult, NotFound, ObjectInfo, Store, StoreError, open_store
from slime_stoa.protocol.store.base import Payload
from slime_stoa.quickstart.meter import StepMeter, cli_console

from .common import REFUSED, add_run_options, human_bytes, os_error_text, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    weights = sub.add_parser("weights", help="seed, inspect, verify and export a run's weights", description=__doc__)
    cmds = weights.add_subparsers(title="weights commands", metavar="COMMAND", required=True)

    seed = cmds.add_parser("publish-anchor", help="seed a new run from an HF checkpoint folder (version 0)")
    seed.add_argument("hf_dir", type=Path, help="HF model folder (config.json, *.safetensors, tokenizer files)")
    add_run_options(seed)
    seed.add_argument("--key", type=Path, metavar="PATH", help="the run key file of a signed run (signs v0)")
    seed.set_defaults(handler=_sync(publish_anchor))

    status = cmds.add_parser("status", help="current version and the recent versions' sizes")
    add_run_options(status)
    status.add_argument("--last", type=int, default=10, help="how many recent versions to show")
    status.set_defaults(handler=_sync(show_status))

    verify = cmds.add_parser("verify", help="rebuild the current version from the bucket and check every digest")
    add_run_options(verify)
    _add_run_key(verify)
    verify.set_defaults(handler=_sync(verify_run))

    inspect = cmds.add_parser("inspect", help="one version's manifest: patches, frames, densest tensors")
    add_run_options(inspect)
    inspect.add_argument("--version", type=int, default=None, help="version (default: current)")
    inspect.set_defaults(handler=_sync(inspect_version))

    export = cmds.add_parser("export", help="write a version still in the bucket (see the run's retain_anchors) as an HF folder")
    add_run_options(export)
    export.add_argument("--version", type=int, default=None, help="version (default: current)")
    export.add_argument("out_dir", type=Path, help="folder to write")
    export.add_argument("--quiet", action="store_true", help="show no progress (stderr: rebuild, model files, write)")
    _add_run_key(export)
    export.set_defaults(handler=_sync(export_version))


def _add_run_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-key", metavar="TEXT",
        help="verify signatures and content hashes against this run key (ed25519:...); default: the run "
        "manifest's key for a signed run",
    )


async def run_trust(store: Store, run: str, pinned: str | None) -> RunTrust | None:
    """The trust weights are checked against: `pinned` (which the run manifest must carry), else a
    signed run's own key; None for an unsigned run without `pinned`."""
    trust = await weights_trust(store, run, pinned)
    if trust is None:
        return None
    print(f"checking signatures against run key {trust.pinned.key_id} ({'given' if pinned else 'the run manifest'})")
    return trust


def _sync(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(fn(args))
        except OSError as exc:
            print(f"error: {os_error_text(exc)}", file=sys.stderr)
            return 1
        except (StoreError, HistoryError, ManifestError, PublishError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return run


async def publish_anchor(args: argparse.Namespace) -> int:
    """Seed v0. Refused on a run that does not exist, unsigned on a signed run, and on a run that
    has weights, except one repair: the key holder of a signed run replaces a v0 its keys did not
    sign (`_UnsignedPointerReplaced`)."""
    url, run = require_run_options(args)
    if not args.hf_dir.is_dir():
        raise ValueError(f"model folder {args.hf_dir} does not exist: pass the HF checkpoint folder to seed the run from")
    if why := unsupported_model(args.hf_dir):  # refused before the bucket is touched
        print(f"error: {why}", file=sys.stderr)
        return REFUSED
    key = read_key_file(args.key) if args.key is not None else None
    async with open_store(url) as store:
        manifest = await read_run_manifest(store, run)  # RunNotFound says to `stoa run create` it
        run_key = manifest.public_key
        if run_key is not None and key is None:
            print(
                f"error: run {run!r} is signed (run key {run_key.key_id}): pass its run key file with --key, "
                f"or workers will refuse the anchor",
                file=sys.stderr,
            )
            return 1
        target: Store = store
        try:
            pointer, etag = await _pointer_and_etag(store, run)
        except NotPublished:
            pointer = None
        if pointer is not None:
            if key is None or run_key is None or pointer.version != 0 or await _signed(store, run, run_key):
                print(f"error: run {run!r} already has weights (v{pointer.version}); seed a new run name", file=sys.stderr)
                return 1
            await publisher_trust(store, run, key)  # the key must be the run's current key
            print(f"replacing the unsigned v0 of signed run {run!r} with one signed by key {key.key_id}")
            target = _UnsignedPointerReplaced(store, RunLayout(run).pointer, etag)
        state = load_hf_state(args.hf_dir)
        result = await Publisher(target, run, PublisherConfig(extras_dir=args.hf_dir), key=key).publish(state)
    print(
        f"published anchor v{result.version} of run {run!r}: {len(state)} tensors, "
        f"{result.elements:,} bf16 weights, {human_bytes(result.anchor_bytes)} in {result.seconds:.1f}s"
    )
    return 0


async def _pointer_and_etag(store: Store, run: str) -> tuple[Pointer, str]:
    found = await read_pointer_etag(store, run)
    assert found is not None  # an unconditional read always returns the object
    return found


async def _signed(store: Store, run: str, run_key: PublicKey) -> bool:
    """Whether the run's pointer is signed by its newest run key."""
    try:
        await read_pointer(store, run, trust=RunTrust(run, run_key))
    except MalformedPointer as exc:
        if exc.untrusted:
            return False
        raise
    return True


class _UnsignedPointerReplaced(Store):
    """The store as the publisher repairing a signed run's unsigned v0 sees it: the pointer with
    ETag `etag` reads as absent, and creating the pointer replaces exactly that object
    (If-Match: a pointer moved meanwhile makes the publish a conflict). All else is `inner`'s."""

    def __init__(self, inner: Store, pointer: str, etag: str) -> None:
        self.inner, self.pointer, self.etag, self.url = inner, pointer, etag, inner.url

    async def get(
        self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None
    ) -> GetResult | None:
        if key == self.pointer:
            got = await self.inner.get(key, length=0)
            if got is not None and got.etag == self.etag:
                raise NotFound(f"{key!r} is being replaced")
        return await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        if key == self.pointer:
            return await self.inner.put(key, data, if_match=self.etag)
        return await self.inner.put_if_absent(key, data)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        return self.inner.list(prefix, start_after=start_after)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)


async def show_status(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    async with open_store(url) as store:
        pointer = await read_pointer(store, run)
        when = dt.datetime.fromtimestamp(pointer.updated_at).isoformat(timespec="seconds")
        print(f"run {run}: v{pointer.version}  digest {pointer.state_digest}  anchor v{pointer.anchor.version}  ({when})")
        head = await read_manifest(store, pointer.manifest)
        full = 2 * head.elements
        print(f"model: {head.elements:,} bf16 weights = {human_bytes(full)} per full sync\n")
        print(f"{'version':>8} {'changed':>12} {'density':>8} {'step patch':>11} {'vs full':>8} {'catch-up':>10}  anchor")
        async for m in walk_back(store, head, limit=args.last):
            step, catchup = m.patch("step"), m.patch("catchup")
            changed = step.count if step else 0
            density = f"{changed / m.elements:.3%}" if step and m.elements else "-"
            step_b = human_bytes(step.bytes) if step else "-"
            ratio = f"{full / step.bytes:.0f}x" if step and step.bytes else "-"
            cu = human_bytes(catchup.bytes) if catchup else "-"
            anchored = f"v{m.version} ({human_bytes(m.anchor_bytes)})" if m.anchor.version == m.version else ""
            print(f"{m.version:>8} {changed:>12,} {density:>8} {step_b:>11} {ratio:>8} {cu:>10}  {anchored}")
    return 0


async def verify_run(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    problems: list[str] = []
    async with open_store(url) as store:
        trust = await run_trust(store, run, args.run_key)
        pointer = await read_pointer(store, run, trust=trust)
        head = await read_manifest(store, pointer.manifest, trust=trust)
        if head.state_digest != pointer.state_digest:
            problems.append("the pointer's digest differs from its manifest's")
        checked = 0
        async for m in walk_back(store, head, limit=pointer.version + 1, trust=trust):
            for ref in m.patches:
                try:
                    info = await store.head(ref.key)
                    if info.size != ref.bytes:
                        problems.append(f"v{m.version} {ref.kind} patch is {info.size} bytes, manifest says {ref.bytes}")
                except NotFound:
                    problems.append(f"v{m.version} {ref.kind} patch {ref.key} is missing")
            checked += 1
            if m.anchor.version == m.version:
                break  # the chain from here on is reachable from this anchor
        try:
            rebuilt = await rebuild(store, run, pointer.version, trust=trust)
            print(f"rebuilt v{pointer.version} via {rebuilt.path}: digest {pointer.state_digest} OK")
        except HistoryError as exc:
            problems.append(str(exc))
    print(f"checked {checked} version manifest(s) back to the latest anchor")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("weights OK" if not problems else f"{len(problems)} problem(s) found")
    return 0 if not problems else 1


async def inspect_version(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    async with open_store(url) as store:
        version = args.version if args.version is not None else (await read_pointer(store, run)).version
        m = await find_manifest(store, run, version)
        print(f"v{m.version} (attempt {m.attempt})  digest {m.state_digest}")
        print(f"anchor: v{m.anchor.version} {human_bytes(m.anchor_bytes)}  parent: v{m.parent.version if m.parent else '-'}")
        for ref in m.patches:
            print(
                f"{ref.kind} patch from v{ref.base_min}..v{ref.base_max}: {human_bytes(ref.bytes)}, {ref.count:,} changed, "
                f"{8 * ref.bytes / max(ref.count, 1):.1f} bits/changed, mode {ref.index.mode}, {len(ref.index.frames)} frame(s)"
            )
        step = m.patch("step")
        if step:
            counts: dict[str, tuple[int, int]] = {}
            for frame in step.index.frames:
                for e in frame.entries:
                    c, _ = counts.get(e.name, (0, e.size))
                    counts[e.name] = (c + e.count, e.size)
            print(f"\n{'tensor':<48} {'changed':>10} {'density':>8}")
            for name, (c, size) in sorted(counts.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1))[:10]:
                print(f"{name:<48} {c:>10,} {c / max(size, 1):>8.3%}")
    return 0


async def export_version(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    async with open_store(url) as store:
        trust = await run_trust(store, run, args.run_key)
        # phases: rebuild the version, download the anchor's model files, write the folder
        with StepMeter(cli_console(args.quiet), "weights export", 3, unit="phase") as meter:
            try:
                rebuilt = await rebuild(store, run, args.version, trust=trust)
            except HistoryError as exc:
                if isinstance(exc, NotPublished):
                    raise
                raise HistoryError(f"{exc}; {await exportable_versions(store, run)}") from None
            meter.advance()
            anchor = await read_anchor_manifest(store, rebuilt.manifest.anchor.manifest, trust=trust)
            with tempfile.TemporaryDirectory() as tmp:
                await download_extras(store, anchor, Path(tmp))
                meter.advance()
                out = save_hf_folder(rebuilt.state, args.out_dir, source_dir=Path(tmp))
                meter.advance()
    print(f"exported v{rebuilt.manifest.version} (digest {rebuilt.manifest.state_digest}) to {out}")
    return 0


async def exportable_versions(store: Store, run: str) -> str:
    """Which versions the bucket can still rebuild: from the oldest anchor kept to the pointer
    (the publisher keeps its last `retain_anchors` anchors and every version after the oldest)."""
    pointer = await read_pointer(store, run)
    layout = RunLayout(run)
    kept = [
        parsed[0]
        async for info in store.list(layout.anchors_prefix)
        if info.key.endswith("/manifest.json") and (parsed := parse_versioned(info.key.split("/")[-2]))
    ]
    oldest = min((v for v in kept if v <= pointer.version), default=pointer.version)
    return f"the versions that can be exported are v{oldest}..v{pointer.version}"
