"""`stoa fleet`: one table of the workers of a run, from their heartbeats.

The `quarantine` column is what the trainer's consumer state in the bucket
(`runs/<run>/trainer/consumer.json`, saved after every batch) says: the reason a worker is
quarantined and since when (`stoa worker release WORKER` lifts it). Quarantined workers without
a heartbeat are listed below the table. Like every object in the bucket, that state is only as
trustworthy as the bucket's writers; the trainer acts on its own copy.

`tok/s` is each worker's generation rate over its last ~30 s and `tokens` what it generated
since it started: both move while a cohort is under way, so a slow worker (a low rate, tokens
rising) and a stuck one (tokens standing still) look different long before a group finishes.

In a signed run each heartbeat is judged against the run's worker registry (`key` column):
"signed" by the key registered for its worker, or "unsigned", "unknown" (a key not registered),
"revoked" or "forged"; a heartbeat that is not "signed" shows that word as its status, and none
of what it claims is shown: its version cell says "unverified", its counters (lag, throughput,
tokens, groups uploaded and spooled, last seen, errors) are "-". An unsigned run's heartbeats are shown as
they say (`key` "-").

`--run-key KEY` pins the run key (its public text, fingerprint, key id, or a key file; see
`run_key_pin`), as `macd join --run-key` does: a run whose `run.json` names another key, or
none, is reported as re-keyed and its heartbeats are judged by the registry the pinned key signs
(none trusted when the key is known only by its fingerprint), never by the run's own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping

from slime_stoa.protocol.heartbeat import (
    NOT_RUNNING,
    UNTRUSTED,
    Heartbeat,
    HeartbeatTrust,
    ago,
    read_fleet,
    shown_lag,
    shown_status,
)
from slime_stoa.protocol.pulse.history import NotPublished, read_pointer
from slime_stoa.protocol.pulse.manifests import ManifestError
from slime_stoa.protocol.registry import Registry, RegistryError, read_run_registry
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import Untrusted
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.trainer.consumer.persistence import read_state
from slime_stoa.trainer.consumer.quarantine import WorkerRecord
from slime_stoa.trainer.consumer.shared import CLOCK_REFUSED

from .common import add_run_options, require_run_options
from .run_key_pin import RunKeyPin, parse_run_key, pinned_key

COLUMNS = (
    "worker", "name", "status", "tier", "version", "lag", "tok/s", "tokens", "uploaded", "spool", "last seen",
    "errors", "quarantine", "key",
)
Judged = tuple[Heartbeat, HeartbeatTrust | None]
#: What an untrusted heartbeat's row says in place of its claims (version through errors).
UNVERIFIED = "unverified"


def add_parser(sub: argparse._SubParsersAction) -> None:
    fleet = sub.add_parser("fleet", help="table of a run's workers from their heartbeats", description=__doc__)
    add_run_options(fleet)
    fleet.add_argument("--watch", action="store_true", help="refresh until interrupted")
    fleet.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch")
    fleet.add_argument(
        "--run-key", metavar="KEY",
        help="pin the run key (ed25519:..., SHA256:... fingerprint, key id, or a key file): a run whose "
        "run.json names another key is shown as re-keyed, its heartbeats judged by the pinned key",
    )  # fmt: skip
    fleet.set_defaults(handler=_fleet)


def quarantine_cell(record: WorkerRecord | None, now: float) -> str:
    """ "" for a worker not quarantined, else its reason and since when."""
    if record is None or not record.quarantined:
        return ""
    since = f" ({ago(now - record.since_ms / 1000)})" if record.since_ms else ""
    return f"{record.reason}{since}"


def count_text(n: int) -> str:
    """A count in a few characters: 950, 1.2k, 12k, 4.5M, 1.2G."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n // (size // 10) / 10:.1f}{unit}" if n < 10 * size else f"{n // size}{unit}"  # rounded down
    return str(n)


def fleet_rows(
    beats: list[Heartbeat] | list[Judged],
    now: float,
    pointer_version: int | None = None,
    quarantine: Mapping[str, WorkerRecord] | None = None,
) -> list[tuple[str, ...]]:
    """One row per worker; `lag` is against the run's current version when given, and only for
    workers still running (a stopped worker's version is history, not lag); `quarantine`: the
    trainer's quarantine records; a heartbeat with a signed run's verdict (`read_fleet`) is shown
    as the module doc says."""
    quarantine = quarantine or {}
    judged = [b if isinstance(b, tuple) else (b, None) for b in beats]
    rows: list[tuple[str, ...]] = []
    for b, trust in sorted(judged, key=lambda bt: bt[0].worker_id):
        if trust in UNTRUSTED:  # anyone with a token may have written it: none of its counters is shown
            rows.append((b.worker_id, b.name, shown_status(b, now, trust), b.tier, UNVERIFIED,
                         *("-" for _ in COLUMNS[5:-2]), quarantine_cell(quarantine.get(b.worker_id), now), str(trust)))
            continue
        lag = shown_lag(b, now, pointer_version, trust)
        rows.append(
            (
                b.worker_id,
                b.name,
                shown_status(b, now, trust),
                b.tier,
                "-" if b.version is None else f"v{b.version}",
                "-" if lag is None else str(lag),
                f"{b.tokens_per_s:.0f}",
                count_text(b.tokens_generated),
                str(b.groups_uploaded),
                str(b.groups_spooled),
                ago(now - b.updated_at),
                str(b.errors) + (f" ({b.last_error[:40]})" if b.last_error else ""),
                quarantine_cell(quarantine.get(b.worker_id), now),
                trust or "-",
            )
        )
    return rows


def render(rows: list[tuple[str, ...]]) -> str:
    table = [COLUMNS, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)


async def read_quarantine(store: Store, run: str) -> tuple[dict[str, WorkerRecord], dict[str, int], str | None]:
    """The quarantine records and the per-worker clock refusals (`clock_refusals`) of the
    trainer's saved consumer state ({} when it saved none yet), and a problem reading it (None if read)."""
    try:
        state, _ = await read_state(store, run)
    except (StoreError, ValueError) as exc:
        return {}, {}, str(exc)
    return ({}, {}, None) if state is None else (state.quarantine, clock_refusals(state.counters), None)


def clock_refusals(counters: Mapping[str, int]) -> dict[str, int]:
    """{worker: records the trainer refused for that worker's clock} (`worker/<id>/clock_refused`)."""
    suffix = "/" + CLOCK_REFUSED
    return {
        k[len("worker/") : -len(suffix)]: v
        for k, v in sorted(counters.items())
        if k.startswith("worker/") and k.endswith(suffix) and v > 0
    }


def refusal_line(refused: Mapping[str, int]) -> str | None:
    """The line telling the owners of Macs whose records the trainer refused for their clock."""
    if not refused:
        return None
    shown = ", ".join(f"{w} {n}" for w, n in list(refused.items())[:20])
    more = f" and {len(refused) - 20} more" if len(refused) > 20 else ""
    return (
        f"records refused for the worker's clock (stamped too far ahead of the trainer's; "
        f"sync the Mac's clock, e.g. `sudo sntp -sS time.apple.com`): {shown}{more}"
    )


async def read_trusted_registry(
    store: Store, manifest: RunManifest, pin: RunKeyPin | None = None
) -> tuple[Registry | None, str | None]:
    """A signed run's registry to judge heartbeats by (None for an unsigned run not pinned), and
    a problem reading it (then an empty registry: no heartbeat is trusted). With `pin` (the run
    key given with --run-key) the registry must be signed by the pinned key, whatever
    `run.json` names."""
    key, refused = manifest.public_key, None
    if pin is not None:
        key, refused = pinned_key(pin, manifest.run, key)
    if key is None:
        return (None, None) if refused is None else (Registry(run=manifest.run), refused)
    try:
        registry = await read_run_registry(store, manifest.run, key)
    except (RegistryError, Untrusted) as exc:
        return Registry(run=manifest.run), str(exc) if refused is None else f"{refused}; {exc}"
    return registry, refused


async def _show(url: str, run: str, watch: bool, interval: float, pin: RunKeyPin | None = None) -> None:
    async with open_store(url) as store:
        manifest = await read_run_manifest(store, run)  # a misspelled run is an error, not "0 workers"
        while True:
            registry, registry_problem = await read_trusted_registry(store, manifest, pin)
            beats, bad = await read_fleet(store, run, registry)
            quarantine, refused, problem = await read_quarantine(store, run)
            head: int | None = None
            try:
                head = (await read_pointer(store, run)).version
                at = f"at v{head}"
            except NotPublished:
                at = "no weights published yet"
            except ManifestError as exc:
                at = f"pointer unreadable ({exc})"
            now = time.time()
            if watch:
                print("\033[2J\033[H", end="")
            running = sum(shown_status(b, now, t) not in NOT_RUNNING for b, t in beats)
            untrusted = sum(t in UNTRUSTED for _, t in beats)
            held = sorted(w for w, r in quarantine.items() if r.quarantined)
            print(f"run {run} {at}: {len(beats)} worker(s), {running} running"
                  + (f", {untrusted} untrusted (unsigned, unknown, revoked or forged)" if untrusted else "")
                  + (f", {len(held)} quarantined" if held else "")
                  + (f", {bad} unreadable heartbeat(s)" if bad else ""))
            print(render(fleet_rows(beats, now, head, quarantine)))
            if registry_problem and registry is not None and not registry.workers:
                print(f"no heartbeat trusted: the run's worker registry does not check: {registry_problem}")
            elif registry_problem:
                print(f"warning: {registry_problem}; heartbeats judged by the registry the pinned key signs")
            beating = {b.worker_id for b, _ in beats}
            for worker in (w for w in held if w not in beating):
                print(f"quarantined, no heartbeat: {worker} {quarantine_cell(quarantine[worker], now)}")
            if line := refusal_line(refused):
                print(line)
            if problem:
                print(f"quarantine unknown: the trainer's consumer state could not be read: {problem}")
            if not watch:
                return
            await asyncio.sleep(interval)


def _fleet(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    try:
        pin = None if args.run_key is None else parse_run_key(args.run_key)
        asyncio.run(_show(url, run, args.watch, args.interval, pin))
    except KeyboardInterrupt:
        return 0
    except (StoreError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
