"""Benchmark what junk in the rollouts prefix costs the trainer's consumer (one token holder's attack).

Workload: a signed run (run key, registry of two workers, the tiny test tokenizer, the synthetic
task). Before the consumer starts, the attacker writes N keys of each kind under the rollouts
prefix:
  invalid       names outside the record grammar: half stamped now (`<ts>-X_<i>.rec`), half
                not starting with a timestamp (`zz-junk-<i>`);
  future        valid names of a registered worker stamped a day or more ahead;
  unregistered  valid names of 997 made-up worker ids, stamped within the last 30 s.
"Now" is when each batch of 4,096 is written (the kinds interleaved): an attacker who keeps
writing, whose junk stamped inside the sweeps' windows is what the last window's writing put
there. (The runs in docs/runs up to 2026-12-06 stamped every key when the writing began.)
Then honest signed records land in waves (`--per-wave` per wave, stamped now) and the consumer
(`RolloutConsumer`, the run's defaults for the windows) takes one batch per wave. The same waves
run against a control bucket with no junk. A first wave warms both up (the tail lists the junk
stamped behind the clock once, then it sorts behind the cursor); the measured waves follow.

Reported per case (junk, control) and as ratios (junk / control):
  tail_lists_per_poll   LIST requests per listing of new keys after the cursor (target: <= 2x)
  polls_per_wave        listings of new keys it took to admit a wave (the pace; target: <= 2x)
  get_requests          GETs (no junk key is downloaded: equal)
  state_bytes           the saved consumer state (JSON) after the waves; growth from junk < 1 MB
  restart_admitted      honest records admitted by a consumer resumed from the bucket's state
  requests_per_record   every LIST and GET per honest record admitted, sweeps included (no
                        target: the sweeps behind the cursor list the junk stamped inside their
                        windows again, the residual cost the discovery module's docstring states;
                        reported as `sweep_ratio`)
  wave_s                wall seconds from a wave's first PUT to its batch, min/median/max (no
                        target: the sweeps through the junk run beside the tail, on the same
                        event loop and cores; reported as `wave_s_ratio`, of the medians)

Progress lines go to stderr: every 100,000 junk keys written, and after each phase.

Bounded by work, not time: every batch must come within `--wait-s` (default 60 s), else the
script says which and exits 1; it also exits 1 when a target is missed.

Usage: python scripts/bench_junk.py [--junk N] [--waves N] [--per-wave N] [--s3] [--json PATH]
(`--junk` per kind; default 100,000 on the folder store, where the junk files are written
directly; with `--s3` the tests' S3 server on loopback, junk written by PUTs: use fewer.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import Session, exit_on_signals, on_signal_exit, ratio, spread, write_json

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.consumer import ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.persistence import state_key
from tests.test_consumer import ITEMS, RUN, Tiny, make_group
from tests.test_signed_records import SignedRun, open_signed_consumer, put, setup_signed_run, signed

KINDS = ("invalid", "future", "unregistered")
DAY_MS = 86_400_000
TARGET_RATIO = 2.0
TARGET_STATE_GROWTH = 1 << 20
FAST = dict(poll_interval_s=0.05, sweep_interval_s=0.5, late_sweep_interval_s=2.0, progress_interval_s=600.0)

Writer = Callable[[str, bytes], Awaitable[None]]


PROGRESS_EVERY = 100_000  # junk keys written between two progress lines
_STARTED = time.monotonic()


def now_ms() -> int:
    return int(time.time() * 1000)


def say(what: str) -> None:
    """A progress line on stderr (writing 3M junk files or one wave behind a sweep takes minutes)."""
    print(f"bench_junk [{time.monotonic() - _STARTED:7.1f} s] {what}", file=sys.stderr, flush=True)


def junk_key(kind: str, i: int, t_ms: int) -> str:
    """Junk key number `i` of `kind` (see the module doc), written at `t_ms`."""
    layout = RunLayout(RUN)
    if kind == "invalid":
        prefix = layout.rollouts_prefix()
        return f"{prefix}{t_ms - 1_000 + i % 1_000:013d}-X_{i}.rec" if i % 2 else f"{prefix}zz-junk-{i}"
    if kind == "future":
        return layout.rollout("mac-a", t_ms + DAY_MS + i, 1_000_000 + i)
    return layout.rollout(f"ghost-{i % 997}", t_ms - 30_000 + i % 30_000, i)


def folder_writer(root: Path) -> Writer:
    """Writes junk straight into a folder store's files (the attacker needs no API)."""

    async def write(key: str, data: bytes) -> None:
        path = root.joinpath(*key.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return write


def store_writer(store: Store, concurrency: int = 32) -> Writer:
    gate = asyncio.Semaphore(concurrency)

    async def write(key: str, data: bytes) -> None:
        async with gate:
            await store.put_if_absent(key, data)

    return write


async def lay_junk(write: Writer, n: int) -> None:
    """`n` keys of each kind, the kinds interleaved, each batch stamped as it is written: an
    attacker who keeps writing, so the junk inside the windows behind the cursor when the waves
    come is what was written during the last window (writing millions takes longer than one)."""
    order = [(kind, i) for i in range(n) for kind in KINDS]
    reported = 0
    for at in range(0, len(order), 4096):
        t_ms = now_ms()
        await asyncio.gather(*(write(junk_key(kind, i, t_ms), b"junk") for kind, i in order[at : at + 4096]))
        done = min(at + 4096, len(order))
        if done - reported >= PROGRESS_EVERY or done == len(order):
            say(f"junk keys written: {done:,} of {len(order):,}")
            reported = done


async def honest_wave(store: Store, run: SignedRun, tiny: Tiny, wave: int, per_wave: int) -> None:
    t = now_ms()
    for i in range(per_wave):
        worker = ("mac-a", "mac-b")[i % 2]
        seq = wave * per_wave + i
        group = make_group(tiny, worker=worker, seq=seq, prompt_index=seq % len(ITEMS))
        await put(store, signed(group, run.workers[worker]), worker, seq, t - 200 + i)


async def batch(consumer: RolloutConsumer, n: int, wait_s: float, what: str) -> None:
    try:
        await consumer.next_batch(n, trainer_version=0, timeout_s=wait_s)
    except ConsumerTimeout as exc:
        raise SystemExit(f"bench_junk: {what}: no batch of {n} within {wait_s:.0f} s: {exc}") from None


async def run_case(
    store: Store, store_url: str, tiny: Tiny, *, name: str, junk: int, write: Writer | None, waves: int, per_wave: int, wait_s: float
) -> dict[str, Any]:
    """One bucket: the signed run, `junk` keys of each kind (written by `write`), the honest waves,
    then a restart from the saved state. Returns the measurements."""
    run = await setup_signed_run(store, tiny, workers=("mac-a", "mac-b"))
    say(f"{name}: signed run set up")
    if junk:
        assert write is not None
        await lay_junk(write, junk)
    kw = dict(FAST, wait_timeout_s=wait_s, registry_refresh_s=3600.0)
    consumer = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, **kw)
    await honest_wave(store, run, tiny, 0, per_wave)
    await batch(consumer, per_wave, wait_s, "warm-up wave")
    say(f"{name}: warm-up wave admitted")
    before = consumer.counters
    wave_s = []
    for wave in range(1, waves + 1):
        landed = time.monotonic()
        await honest_wave(store, run, tiny, wave, per_wave)
        await batch(consumer, per_wave, wait_s, f"wave {wave}")
        wave_s.append(time.monotonic() - landed)
        say(f"{name}: wave {wave} of {waves} admitted in {wave_s[-1]:.1f} s")
    after = consumer.counters
    await consumer.save_state()
    await consumer.close()
    state_bytes = len((await store.get(state_key(RUN))).data)  # type: ignore[union-attr]

    def gained(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    admitted = gained("admitted")
    # A restart through the resume path: the bucket's signed state, then one more wave.
    resumed = await RolloutConsumer.open(
        store, open_signed_config(store_url, run, kw), decode=tiny.decode, eos_ids=frozenset({tiny.eos}),
        prompt_of=tiny.prompt, restore=True, state_key=run.run_key,
    )
    await honest_wave(store, run, tiny, waves + 1, per_wave)
    await batch(resumed, per_wave, wait_s, "wave after the restart")
    say(f"{name}: wave after the restart admitted")
    restart_admitted = resumed.counters.get("admitted", 0) - after.get("admitted", 0)
    await resumed.close()
    return {
        "junk_per_kind": junk,
        "admitted": admitted,
        "tail_lists_per_poll": ratio(gained("tail_list_requests"), gained("tail_listings")),
        "polls_per_wave": ratio(gained("tail_listings"), waves),
        "wave_s": spread(wave_s),  # wall time from a wave's first PUT to its batch (no target: sweeps share the loop)
        "requests_per_record": ratio(gained("list_requests") + gained("get_requests"), admitted),
        "list_requests": gained("list_requests"),
        "get_requests": gained("get_requests"),
        "state_bytes": state_bytes,
        "restart_admitted": restart_admitted,
        "rejected": {k.removeprefix("rejected/"): v for k, v in sorted(after.items()) if k.startswith("rejected/") and v},
    }


def open_signed_config(store_url: str, run: SignedRun, kw: dict[str, Any]):
    from tests.test_consumer import config

    return config(store_url, run_key=run.run_key.public.to_text(), **kw)


def summarize(junk: dict[str, Any], control: dict[str, Any], per_wave: int) -> tuple[dict[str, Any], list[str]]:
    """The headline ratios and the targets missed (empty: all met)."""
    summary = {
        "wave_s_ratio": ratio(junk["wave_s"]["median"], control["wave_s"]["median"]),
        "junk_list_ratio": ratio(junk["tail_lists_per_poll"], control["tail_lists_per_poll"]),
        "pace_ratio": ratio(junk["polls_per_wave"], control["polls_per_wave"]),
        "sweep_ratio": ratio(junk["requests_per_record"], control["requests_per_record"]),
        "junk_state_bytes": junk["state_bytes"] - control["state_bytes"],
    }
    missed = []
    if not summary["junk_list_ratio"] <= TARGET_RATIO:
        missed.append(f"LISTs per poll {summary['junk_list_ratio']:.2f}x the control's (target <= {TARGET_RATIO}x)")
    if not summary["pace_ratio"] <= TARGET_RATIO:
        missed.append(f"listings per wave admitted {summary['pace_ratio']:.2f}x the control's (target <= {TARGET_RATIO}x)")
    if not summary["junk_state_bytes"] < TARGET_STATE_GROWTH:
        missed.append(f"saved state grew {summary['junk_state_bytes']} bytes from junk (target < {TARGET_STATE_GROWTH})")
    for case, row in (("junk", junk), ("control", control)):
        if row["restart_admitted"] != per_wave:
            missed.append(f"{case}: the resumed consumer admitted {row['restart_admitted']} of {per_wave}")
    return summary, missed


async def bench_pair(
    tiny: Tiny, *, junk: int, waves: int, per_wave: int, wait_s: float, s3_url: Callable[[str], str] | None, root: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(junk case, control case), each in its own bucket: the folder store under `root`, or
    with `s3_url` (bucket name -> URL) the S3 server."""
    rows = []
    for name, n in (("junk", junk), ("control", 0)):
        if s3_url is None:
            folder = root / name
            folder.mkdir()
            url = f"file://{folder}"
        else:
            url = s3_url(name)
        store = open_store(url)
        try:
            write = folder_writer(folder) if s3_url is None else store_writer(store)
            rows.append(await run_case(store, url, tiny, name=name, junk=n, write=write, waves=waves, per_wave=per_wave, wait_s=wait_s))
        finally:
            await store.close()
    return rows[0], rows[1]


def build_tiny(folder: Path) -> Tiny:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from slime_stoa.quickstart.tiny_model import IM_END, build_tiny_model

    model = build_tiny_model(folder, hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return Tiny(model, tok, vocab, tok.token_to_id(IM_END), AutoTokenizer.from_pretrained(model))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junk", type=int, default=None, help="junk keys of each kind (default 100000; --s3: 5000)")
    parser.add_argument("--waves", type=int, default=5)
    parser.add_argument("--per-wave", type=int, default=5)
    parser.add_argument("--wait-s", type=float, default=60.0, help="longest wait for one batch before giving up")
    parser.add_argument("--s3", action="store_true", help="the tests' S3 server on loopback instead of a folder")
    parser.add_argument("--json", type=Path, help="write the rows and the summary as JSON here")
    args = parser.parse_args(argv)
    junk = args.junk if args.junk is not None else (5_000 if args.s3 else 100_000)
    session = Session()
    with exit_on_signals(), tempfile.TemporaryDirectory(prefix="bench-junk-") as tmp:
        root = Path(tmp)
        on_signal_exit(lambda: shutil.rmtree(root, ignore_errors=True))  # millions of junk files
        tiny = build_tiny(root / "tiny")
        if args.s3:
            from tests.s3server import LocalS3Server

            with LocalS3Server() as server:
                on_signal_exit(server.stop)
                creds = server.credentials()  # the consumer opens its store from the URL and the environment
                os.environ.update({"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key})

                def s3_url(name: str) -> str:
                    bucket = server.create_bucket(f"junk-{name}")
                    return f"s3://{bucket}/bench?endpoint={server.endpoint_url}"

                junk_row, control = asyncio.run(bench_pair(
                    tiny, junk=junk, waves=args.waves, per_wave=args.per_wave, wait_s=args.wait_s, s3_url=s3_url, root=root
                ))
        else:
            junk_row, control = asyncio.run(bench_pair(
                tiny, junk=junk, waves=args.waves, per_wave=args.per_wave, wait_s=args.wait_s, s3_url=None, root=root
            ))
    summary, missed = summarize(junk_row, control, args.per_wave)
    print(json.dumps({"junk": junk_row, "control": control, "summary": summary}, indent=2))
    if args.json:
        write_json(args.json, {"meta": session.meta(), "args": vars(args) | {"json": str(args.json), "junk": junk},
                               "junk": junk_row, "control": control, "summary": summary})
    for line in missed:
        print(f"bench_junk: target missed: {line}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
