"""`stoa`: the operator and trainer-side command line.

Each command group lives in its own module with `add_parser(subparsers)`; the parser stores the
function to run in `args.handler`.
"""

from __future__ import annotations

import argparse
import logging
import sys

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
from .common import StoaParser

GROUPS = (quickstart_cmd, store_cmd, run_cmd, task_cmd, weights_cmd, fleet_cmd, preflight_cmd, worker_cmd, keys_cmd, eval_cmd, rollouts_cmd)


def build_parser() -> argparse.ArgumentParser:
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
    for group in GROUPS:
        group.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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


if __name__ == "__main__":
    sys.exit(main())
