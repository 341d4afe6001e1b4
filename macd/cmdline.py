"""What every `macd` command shares: the `--config` option, the file it names, the error line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The commands macd names in its messages, built and shell-quoted where stoa builds its own.
from slime_stoa.protocol.shell import TASK_SOURCES, run_create_command, task_prepare_command

from . import config as cfg

__all__ = ["TASK_SOURCES", "add_config_option", "config_path", "error", "run_create_command", "task_prepare_command"]


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

