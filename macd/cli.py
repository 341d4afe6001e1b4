"""`macd`: the rollout daemon's command line (dispatch only).

One module per command group, each with `add_parser(sub, add_config_option)` setting `handler`:
`join_cmd` (join), `run_cmd` (run), `service_cmd` (install, uninstall, start, stop, status,
logs); `doctor` is `macd.doctor`. Handlers import what they need lazily, so `macd --help` and
`macd doctor` stay fast and work without MLX.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import config as cfg
from . import join_cmd, run_cmd, service_cmd


def default_data_dir() -> Path:
    return cfg.default_data_dir()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macd",
        description=(
            "macd: turn this Mac into a stoa rollout worker. It follows a run's weights in the "
            "bucket, generates groups of rollouts with MLX, scores them and uploads them."
        ),
        epilog=(
            "Start with `macd doctor` to see what this machine can run, then "
            "`macd join <bucket-url> --run <run>` and `macd install && macd start`."
        ),
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    doctor = sub.add_parser(
        "doctor", help="check Python, MLX, memory and disk, and recommend a model size and batch"
    )
    doctor.add_argument("--data-dir", type=Path, default=default_data_dir(), help="anchor cache and spool folder")
    add_config_option(doctor)
    doctor.set_defaults(handler=_doctor)
    join_cmd.add_parser(sub, add_config_option)
    run_cmd.add_parser(sub, add_config_option)
    service_cmd.add_parser(sub, add_config_option)
    return parser


def add_config_option(parser: argparse.ArgumentParser) -> None:
    """`--config PATH` (default: $MACD_CONFIG, else macd.toml in the user's config folder)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="config file (default: $MACD_CONFIG, else macd.toml in the user's config folder)",
    )


def config_path(args: argparse.Namespace) -> Path:
    """The config file named by `--config`, else the default one, as an absolute path."""
    path = args.config if args.config is not None else cfg.default_config_path()
    return Path(os.path.abspath(path.expanduser()))


def error(message: str) -> int:
    """Print `error: message` to stderr; the exit status 1."""
    print(f"error: {message}", file=sys.stderr)
    return 1


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.main(args.data_dir, config_path(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:  # `macd join ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
