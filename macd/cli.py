"""`macd`: the rollout daemon's command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def default_data_dir() -> Path:
    if sys.platform == "darwin":
        return Path("~/Library/Application Support/stoa").expanduser()
    return Path(os.environ.get("XDG_DATA_HOME", "~/.local/share")).expanduser() / "stoa"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macd",
        description=(
            "macd: turn this Mac into a stoa rollout worker. It follows a run's weights in the "
            "bucket, generates groups of rollouts with MLX, scores them and uploads them."
        ),
        epilog="Start with `macd doctor` to see what this machine can run.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    doctor = sub.add_parser(
        "doctor", help="check Python, MLX, memory and disk, and recommend a model size and batch"
    )
    doctor.add_argument("--data-dir", type=Path, default=default_data_dir(), help="anchor cache and spool folder")
    doctor.set_defaults(handler=lambda args: _doctor(args))
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main(args.data_dir)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
