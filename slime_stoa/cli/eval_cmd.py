"""`stoa eval`: pass@1 and pass@k of weight versions on a held-out split of the run's task.

    stoa eval --store URL --run RUN --version N --split test --k 8 [--prompts 100] \\
        --csv out.csv --png out.png --json out.json
    stoa eval --store URL --run RUN --all --local --split test --k 8 --json out.json
    stoa eval --store URL --run RUN --all --local --engine transformers [--device cuda] ...

Fleet mode (the default) writes an eval request for the version (signed with --run-key on a
signed run) and waits up to --timeout seconds for the workers holding that version to answer;
their records are checked and re-scored here. Workers hold the current version only, so --all
needs --local: every kept version is rebuilt from the bucket and sampled on this machine, with macd's
MLX generation path (`--engine mlx`, the default: a `python -m macd.eval_process` process; the worker extra) or with transformers on the
trainer box (`--engine transformers`, on `--device`, by default a GPU when there is one; the
trainer extra): the same episodes, tool calls and budget either way. pass@k is the unbiased estimator (Chen et al., 2021)
from k samples per prompt; a sample passes with reward >= --pass-threshold (default 1: full
credit). The JSON holds one entry per version: version, split, k, n_prompts, pass@1, pass@k,
reward_mean, search_rate (the share of samples that called a tool; null for single-turn tasks).
Progress of each version goes to stderr: a bar on a terminal, a line per tenth (or every 30 s)
elsewhere; --quiet shows none. --local with the mlx engine on a single-turn task counts it in
tokens of the budget (prompts x k x max tokens; a sample that stops early counts its unused
budget as done), so it moves with every decode step, the prompts done beside it, and its ETA is
an upper bound ("ETA <= 3m"); a tool task, the transformers engine and the fleet count prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from slime_stoa.evaluation.collect import EvalCollector, open_eval_context, read_split
from slime_stoa.evaluation.fleet import EvalTimeout, await_answers, post_request, version_result
from slime_stoa.evaluation.local import ENGINES, local_eval
from slime_stoa.evaluation.passk import DEFAULT_PASS_THRESHOLD
from slime_stoa.evaluation.report import VersionResult, plot_curve, write_csv, write_json
from slime_stoa.protocol.eval_request import EvalRequest
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import HistoryError, find_manifest, read_pointer
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import read_key_file
from slime_stoa.protocol.store import Store, StoreError, open_store
from slime_stoa.quickstart.meter import SamplingMeter, cli_console

from .common import add_run_options, os_error_text, require_run_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="pass@1 / pass@k of weight versions on a held-out split",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", type=int, help="the weight version to evaluate (default: the current one)")
    which.add_argument("--all", action="store_true", help="every version still kept in the bucket (needs --local)")
    p.add_argument("--split", default="test", help="task split to evaluate on (default: test)")
    p.add_argument("--k", type=int, default=8, help="samples per prompt (default: 8)")
    p.add_argument("--prompts", type=int, help="evaluate the split's first N prompts (default: all)")
    p.add_argument("--max-tokens", type=int, help="longest response (default: the run manifest's)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the run manifest's)")
    p.add_argument("--pass-threshold", type=float, default=DEFAULT_PASS_THRESHOLD,
                   help="a sample passes with a reward at least this (default: 1.0)")
    p.add_argument("--local", action="store_true", help="sample on this machine (see --engine) instead of asking the fleet")
    p.add_argument("--engine", choices=ENGINES, default="mlx",
                   help="--local: sample with MLX (macd's path, the default) or transformers (the trainer box)")
    p.add_argument("--device", help="--local --engine transformers: torch device (default: cuda if available)")
    p.add_argument("--seed", type=int, help="--local: sampling seed")
    p.add_argument("--timeout", type=float, default=1800.0, help="fleet: seconds to wait for the answers (default 1800)")
    p.add_argument("--run-key", type=Path, metavar="PATH", help="fleet, signed run: the run key file signing the request")
    p.add_argument("--tokenizer-dir", type=Path, help="fleet: local HF tokenizer folder (default: the anchor's)")
    p.add_argument("--csv", type=Path, help="write one row per version here")
    p.add_argument("--png", type=Path, help="write the learning curve across versions here")
    p.add_argument("--json", type=Path, help="write the per-version results here")
    p.add_argument("--quiet", action="store_true", help="show no progress")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        rows = asyncio.run(evaluate(args))
    except OSError as exc:
        print(f"error: {os_error_text(exc)}", file=sys.stderr)
        return 1
    except (StoreError, HistoryError, EvalTimeout, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for row in rows:
        search = "" if row["search_rate"] is None else f"  search rate {row['search_rate']:.3f}"
        print(f"v{row['version']} {row['split']}: pass@1 {row['pass@1']:.3f}  pass@{row['k']} {row['pass@k']:.3f}  "
              f"({row['n_prompts']} prompts){search}")
    for path, write in ((args.csv, write_csv), (args.json, write_json), (args.png, plot_curve)):
        if path is not None:
            print(f"wrote {write(rows, path)}")
    return 0


def check_args(args: argparse.Namespace) -> None:
    if args.all and not args.local:
        raise ValueError("--all needs --local: workers hold the current version only")
    if not args.local and (args.engine != "mlx" or args.device is not None):
        raise ValueError("--engine and --device choose how --local samples: add --local")
    if not 1 <= args.k <= 64:
        raise ValueError(f"--k must be 1..64, got {args.k}")
    if args.prompts is not None and args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")


async def kept_versions(store: Store, run: str) -> list[int]:
    """Every version with a version manifest still in the bucket, up to the pointer's."""
    layout = RunLayout(run)
    head = (await read_pointer(store, run)).version
    found = {parsed[0] async for info in store.list(layout.versions_prefix)
             if (parsed := layout.parse_version_manifest(info.key)) is not None}
    return sorted(v for v in found if v <= head)


async def evaluate(args: argparse.Namespace) -> list[dict[str, Any]]:
    url, run_name = require_run_options(args)
    check_args(args)
    async with open_store(url) as store:
        manifest = await read_run_manifest(store, run_name)
        trust = RunTrust.from_text(run_name, manifest.run_key) if manifest.run_key else None
        if args.all:
            versions = await kept_versions(store, run_name)
        else:
            versions = [args.version if args.version is not None else (await read_pointer(store, run_name)).version]
        max_tokens = args.max_tokens or manifest.max_tokens
        temperature = args.temperature or manifest.temperature
        console = cli_console(getattr(args, "quiet", False))
        results = []
        for version in versions:
            await find_manifest(store, run_name, version)  # HistoryError naming a version that is not there
            with SamplingMeter(console, f"eval v{version} ({args.split}, k={args.k})") as meter:
                if args.local:
                    with tempfile.TemporaryDirectory(prefix="stoa-eval-") as tmp:
                        result = await local_eval(
                            store, manifest, version=version, split=args.split, k=args.k, n_prompts=args.prompts,
                            max_tokens=max_tokens, temperature=temperature, work_dir=Path(tmp),
                            threshold=args.pass_threshold, seed=args.seed, trust=trust, engine=args.engine,
                            device=args.device, on_progress=meter.show,
                        )
                else:
                    result = await fleet_eval(store, manifest, args, version, max_tokens, temperature, meter)
            results.append(result)
        return [r.row() for r in results]


async def fleet_eval(
    store: Store, manifest: RunManifest, args: argparse.Namespace, version: int, max_tokens: int, temperature: float,
    meter: SamplingMeter | None = None,
) -> VersionResult:
    task = await read_split(store, manifest, args.split)
    n = len(task) if args.prompts is None else min(args.prompts, len(task))
    key = read_key_file(args.run_key) if args.run_key else None
    if manifest.run_key is not None and key is None:
        raise ValueError(f"run {manifest.run!r} is signed: pass --run-key PATH so workers trust the request")
    wanted = EvalRequest(run=manifest.run, version=version, split=args.split, k=args.k, prompts=tuple(range(n)),
                         max_tokens=max_tokens, temperature=temperature)
    posted = await post_request(store, wanted, signing_key=key)
    ctx = await open_eval_context(store, posted, tokenizer_dir=args.tokenizer_dir, run_key=manifest.run_key)
    print(f"asked the fleet for v{version} on {args.split}: {n} prompts x {args.k} samples ({posted.key})")
    collector = EvalCollector(store, ctx, posted)
    if meter is not None:
        meter.start(n)
    await await_answers(collector, signing_key=key, timeout_s=args.timeout,
                        on_progress=meter.update if meter is not None else None)
    return version_result(collector, args.pass_threshold)
