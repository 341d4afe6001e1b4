"""What every `macd` command shares: the `--config` option, the file it names, the error line."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import config as cfg


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


# -- commands macd names in its messages, as a shell runs them (bash, zsh: every value quoted) ------


def run_create_command(store: str, run: str) -> str:
    """`stoa run create` of `run` in `store` (MODEL and TASK to fill in)."""
    return shlex.join(["stoa", "run", "create", "--store", store, "--run", run, "--model", "MODEL", "--task", "TASK"])


#: What `stoa task prepare` reads for each task (placeholders to fill in); synthetic generates its own.
TASK_SOURCES: dict[str, tuple[str, ...]] = {
    "synthetic": (),
    "gsm8k": ("FILE.jsonl",),
    "math": ("MATH_FOLDER_OR_JSONL",),
    "search": ("QA_FILE", "CORPUS_FILE"),
}


def task_prepare_command(task: str, split: str, store: str, run: str) -> str:
    """`stoa task prepare` writing the `split` of `task` for `run` in `store`."""
    sources = TASK_SOURCES.get(task, ("FILES",))
    return shlex.join(["stoa", "task", "prepare", task, *sources, "--store", store, "--run", run, "--split", split])
