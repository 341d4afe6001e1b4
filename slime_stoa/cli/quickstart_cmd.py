"""`stoa quickstart`: train a small model with real workers, real PULSE sync and a local bucket."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path
from typing import Any, get_args, get_type_hints

from slime_stoa.quickstart.config import QuickstartConfig

INTERRUPTED = 130  # the exit status after Ctrl-C or SIGTERM (the run resumes on a rerun)


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
    add_config_options(qs)
    qs.add_argument("--json", type=Path, default=None, help="write the machine-readable summary here")
    qs.set_defaults(handler=_quickstart)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per QuickstartConfig field, with its type, default and help."""
    hints = get_type_hints(QuickstartConfig)
    for f in dataclasses.fields(QuickstartConfig):
        kind = next((a for a in get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        default = f.default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=default, help=f.metadata["help"] + shown
        )


def _quickstart(args: argparse.Namespace) -> int:
    from slime_stoa.quickstart.interrupt import Interrupt, Interrupted

    interrupt = Interrupt()  # Ctrl-C and SIGTERM: stop at the next safe point, workers included
    try:
        with interrupt.installed():
            summary, report, cfg = _run(args, interrupt)
            interrupt.check()  # a signal after the run's last check still means "interrupted"
    except (Interrupted, KeyboardInterrupt):
        from slime_stoa.quickstart.report import ConsoleReport

        ConsoleReport().note("interrupted: workers stopped; rerun the same command to resume")
        return INTERRUPTED
    from slime_stoa.quickstart.report import plot_curve, write_json

    try:
        report.summary(summary)
        png = plot_curve(summary, cfg.out / "learning_curve.png")
        write_json(summary, cfg.out / "summary.json")
        if args.json:
            write_json(summary, args.json)
    except KeyboardInterrupt:
        return INTERRUPTED
    report.note(f"learning curve: {png}; summary: {cfg.out / 'summary.json'}")
    return 0


def _run(args: argparse.Namespace, interrupt: Any) -> tuple[dict[str, Any], Any, QuickstartConfig]:
    """The run itself: (summary, report, config); `Interrupted` when a stop signal came."""
    from slime_stoa.quickstart.report import ConsoleReport
    from slime_stoa.quickstart.run import run_quickstart  # torch: the slow import, under the handler

    cfg = QuickstartConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(QuickstartConfig)})
    if not args.verbose:  # the progress table says it all; keep library chatter for -v
        import logging

        logging.getLogger().setLevel(logging.WARNING)
    report = ConsoleReport()
    interrupt.check()
    return asyncio.run(run_quickstart(cfg, report, interrupt)), report, cfg
