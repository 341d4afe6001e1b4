"""`stoa quickstart`: train a small model with real workers, real PULSE sync and a local bucket."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from slime_stoa.protocol.cli_fields import add_field_options, field_values
from slime_stoa.protocol.shell import shell_command
from slime_stoa.quickstart.config import QuickstartConfig, QuickstartError

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
    qs.set_defaults(handler=_quickstart)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per QuickstartConfig field, with its type, default and help."""
    add_field_options(parser, QuickstartConfig)


def inspect_commands(cfg: QuickstartConfig) -> list[str]:
    """The commands that show the run in the bucket (shell-quoted: an s3:// URL holds `?`, `&`)."""
    where = ("--store", cfg.store_url, "--run", cfg.run)
    return [shell_command("stoa", *command, *where) for command in (("weights", "status"), ("fleet",), ("run", "show"))]


def _quickstart(args: argparse.Namespace) -> int:
    from slime_stoa.protocol.store import StoreError
    from slime_stoa.quickstart.interrupt import Interrupt, Interrupted

    try:
        cfg = QuickstartConfig(**field_values(args, QuickstartConfig))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    interrupt = Interrupt()  # Ctrl-C and SIGTERM: stop at the next safe point, workers included
    try:
        cfg.check_model()  # a broken --model folder fails before the slow imports, before any write
        with interrupt.installed():
            summary, report = _run(args, cfg, interrupt)
            interrupt.check()  # a signal after the run's last check still means "interrupted"
    except (QuickstartError, StoreError) as exc:  # the message says what to fix
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt) as exc:
        from slime_stoa.quickstart.interrupt import RERUN
        from slime_stoa.quickstart.report import ConsoleReport

        next_step = exc.next_step if isinstance(exc, Interrupted) else RERUN
        ConsoleReport().note(f"interrupted: workers stopped; {next_step}")
        return INTERRUPTED
    from slime_stoa.quickstart.report import plot_curve, write_json

    try:
        report.summary(summary)
        png = plot_curve(summary, cfg.out / "learning_curve.png")
        write_json(summary, cfg.out / "summary.json")
        if cfg.json is not None:
            write_json(summary, cfg.json)
    except KeyboardInterrupt:
        return INTERRUPTED
    report.note(f"learning curve: {png}; summary: {cfg.out / 'summary.json'}")
    report.note("inspect the run:")
    for command in inspect_commands(cfg):  # bare, to copy and paste
        report.console.print(f"  {command}", soft_wrap=True, markup=False, highlight=False)
    return 0


def _run(args: argparse.Namespace, cfg: QuickstartConfig, interrupt: Any) -> tuple[dict[str, Any], Any]:
    """The run itself: (summary, report); `Interrupted` when a stop signal came."""
    from slime_stoa.quickstart.report import ConsoleReport
    from slime_stoa.quickstart.run import run_quickstart  # torch: the slow import, under the handler

    if not args.verbose:  # the progress table says it all; keep library chatter for -v
        import logging

        logging.getLogger().setLevel(logging.WARNING)
    report = ConsoleReport(search=cfg.task == "search")
    interrupt.check()
    return asyncio.run(run_quickstart(cfg, report, interrupt)), report
