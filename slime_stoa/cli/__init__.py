"""`stoa`: the operator and trainer-side command line.

Each command group lives in its own module with `add_parser(subparsers)`; the parser stores the
function to run in `args.handler`. The group modules are imported by `main`, not when this
package is: they pull in numpy, the store backends and more, and a Ctrl-C during those imports
must end `stoa` as quietly as one during the command itself.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from slime_stoa.protocol.extras import missing_line

from .common import StoaParser, os_error_text

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def groups() -> tuple[ModuleType, ...]:
    """The command group modules, in the order `stoa --help` lists them."""
    from . import (
        eval_cmd,
        fleet_cmd,
        keys_cmd,
        preflight_cmd,
        quickstart_cmd,
        rollouts_cmd,
        run_cmd,
        store_cmd,
        task_cmd,
        weights_cmd,
        worker_cmd,
    )

    return (quickstart_cmd, store_cmd, run_cmd, task_cmd, weights_cmd, fleet_cmd, preflight_cmd, worker_cmd, keys_cmd,
            eval_cmd, rollouts_cmd)


def __getattr__(name: str) -> Any:
    if name == "GROUPS":  # the group modules, imported on first use
        return groups()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_parser() -> StoaParser:
    parser = StoaParser(
        prog="stoa",
        description=(
            "stoa: RL post-training where Macs generate rollouts and a GPU trainer learns, "
            "meeting only in an S3-compatible bucket (or a local folder)."
        ),
        epilog=(
            "Store URLs: file:///path/to/dir (local folder, no setup), s3://bucket/prefix"
            "?endpoint=https://host (any S3-compatible service), r2://<account-id>/<bucket>/prefix "
            "(Cloudflare R2). Credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or an env file "
            "(~/.r2env for r2://, chmod 600). Run `stoa COMMAND --help` for details."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for group in groups():
        group.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C, wherever it landed: asked for, so one line, not a traceback
        print("stoa: interrupted", file=sys.stderr)
        return INTERRUPTED


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # `stoa ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except ModuleNotFoundError as exc:  # a command reached without its extra (torch, mlx, ...): how to add it
        if (line := missing_line(exc)) is None:
            raise
        logging.getLogger("stoa").debug("the command failed", exc_info=True)
        print(f"error: {line}", file=sys.stderr)
        return 1
    except OSError as exc:  # a full disk, a path: the message says what to fix (the trace, with -v)
        logging.getLogger("stoa").debug("the command failed", exc_info=True)
        print(f"error: {os_error_text(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
