"""`stoa preflight`: check a slime launch against its stoa run before starting it.

    stoa preflight --store URL --run RUN [--slime-dir DIR] [--slime-args-file FILE] [--] SLIME FLAGS...

Give it the same flags you give slime's `train.py` (all of them, or only those it reads: unknown
flags are ignored), directly or in a file. It reads the bucket (run manifest, task data,
published weights), the `--custom-config-path` YAML and, with `--slime-dir`, the slime checkout
(stoa's patch applied), and prints one line per check: `ok`, `warn`, or `FIX` with what to change.
Exit status: 0 when nothing needs fixing, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from slime_stoa.trainer.slime import preflight

from .common import add_run_options, require_run_options

SLIME_ARGS = "slime_args"


class _TolerantParser(argparse.ArgumentParser):
    """A sub-command parser that keeps every token it does not know in `args.slime_args`, so the
    top-level `parse_args` sees no unrecognised arguments."""

    def parse_known_args(  # type: ignore[override]  # typeshed overloads it on the namespace type
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        setattr(parsed, SLIME_ARGS, [*getattr(parsed, SLIME_ARGS, []), *rest])
        return parsed, []


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "preflight",
        help="check the slime flags, the custom-config YAML and the bucket before launching the trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # never let a slime flag pass for an abbreviation of ours
    )
    parser.__class__ = _TolerantParser
    add_run_options(parser)
    parser.add_argument(
        "--slime-dir",
        default=os.environ.get("SLIME_DIR"),
        help="root of the slime checkout, to check that stoa's patch is applied; default $SLIME_DIR",
    )
    parser.add_argument(
        "--slime-args-file",
        action="append",
        default=[],
        help="file of slime flags (shell words, # comments); read before the flags on the command line",
    )
    parser.set_defaults(handler=run_preflight, **{SLIME_ARGS: []})


def slime_argv(args: argparse.Namespace) -> list[str]:
    """The slime flags: those of each --slime-args-file, then those on the command line (so the
    command line wins, as the last occurrence of a flag does in slime)."""
    argv: list[str] = []
    for path in args.slime_args_file:
        argv += preflight.read_args_file(path)
    return argv + [t for t in getattr(args, SLIME_ARGS, []) if t != "--"]


def run_preflight(args: argparse.Namespace) -> int:
    url, run = require_run_options(args)
    try:
        argv = slime_argv(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    facts = asyncio.run(preflight.inspect_store(url, run))
    findings = preflight.run_checks(url, run, argv, slime_dir=args.slime_dir, facts=facts)
    print(preflight.format_findings(findings))
    return 1 if preflight.failed(findings) else 0
