"""`stoa quickstart`: train a small model with real workers, real PULSE sync and a local bucket."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    qs = sub.add_parser(
        "quickstart",
        help="the whole loop on this machine: workers, learner, PULSE sync, a local bucket",
        description=(
            "Creates a run in a local bucket (or --store), builds a tiny model (or takes --model), "
            "starts `macd run` workers and a CPU learner (the trainer side without Megatron) and "
            "trains until the reward target or the time limit. Rerun with the same --out to resume."
        ),
    )
    qs.add_argument("--out", type=Path, default=Path("stoa-quickstart"), help="run folder (bucket, logs, report)")
    qs.add_argument("--store", default=None, help="bucket URL (default: file://<out>/bucket)")
    qs.add_argument("--run", default="quickstart", help="run name")
    qs.add_argument("--model", type=Path, default=None, help="HF/MLX model folder (default: a tiny model)")
    qs.add_argument("--workers", type=int, default=2, help="macd worker processes")
    qs.add_argument("--minutes", type=float, default=10.0, help="time budget of the RL part")
    qs.add_argument("--max-versions", type=int, default=300, help="stop after this many versions")
    qs.add_argument("--target", type=float, default=0.9, help="stop once the recent mean reward reaches this")
    qs.add_argument("--kill-worker-at", type=int, default=None, help="SIGKILL worker 0 at this version, then restart it")
    qs.add_argument("--json", type=Path, default=None, help="write the machine-readable summary here")
    qs.add_argument("--seed", type=int, default=0)
    qs.set_defaults(handler=_quickstart)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _quickstart(args: argparse.Namespace) -> int:
    from slime_stoa.quickstart.report import ConsoleReport, plot_curve, write_json
    from slime_stoa.quickstart.run import QuickstartConfig, run_quickstart

    cfg = QuickstartConfig(
        out=args.out, store=args.store, run=args.run, model=args.model, workers=args.workers,
        minutes=args.minutes, max_versions=args.max_versions, target=args.target,
        kill_worker_at=args.kill_worker_at, seed=args.seed,
    )
    if not args.verbose:  # the progress table says it all; keep library chatter for -v
        import logging

        logging.getLogger().setLevel(logging.WARNING)
    report = ConsoleReport()
    signal.signal(signal.SIGTERM, _interrupt)  # stop the workers on SIGTERM too, as on Ctrl-C
    try:
        summary = asyncio.run(run_quickstart(cfg, report))
    except KeyboardInterrupt:
        report.note("interrupted: workers stopped; rerun the same command to resume")
        return 130
    report.summary(summary)
    png = plot_curve(summary, cfg.out / "learning_curve.png")
    write_json(summary, cfg.out / "summary.json")
    if args.json:
        write_json(summary, args.json)
    report.note(f"learning curve: {png}; summary: {cfg.out / 'summary.json'}")
    return 0


