"""Command lines printed for a person to run: one quoting for `stoa` and `macd` alike.

A printed command must run as printed in bash and in zsh (macOS's shell). Unquoted, zsh takes the
`?` of an `s3://bucket/prefix?endpoint=...` URL for a glob and stops with "no matches found", and
both shells split at `&` or a space; so every command line stoa or macd prints goes through
`shell_command`, which quotes each word that needs it. The commands both sides name in their
messages (`stoa run create`, `stoa task prepare`) are built here too, once.
"""

from __future__ import annotations

import os
import shlex
import sys

__all__ = ["TASK_SOURCES", "extra_install_command", "run_create_command", "shell_command", "task_prepare_command"]


def shell_command(*argv: str | os.PathLike[str]) -> str:
    """`argv` as one line a person can paste into bash or zsh and get exactly these arguments back:
    every word that needs it is quoted (`shlex.join`)."""
    return shlex.join(os.fspath(a) for a in argv)


def extra_install_command(extra: str) -> str:
    """The command that adds stoa's optional `extra` (pyproject.toml) to the environment running
    this process: its own interpreter's pip, so the packages land where stoa runs, with the
    installed stoa (from a checkout or a wheel) satisfying the requirement; no index is asked for
    stoa itself ("stoa" there is another project, and stoa is not published)."""
    return shell_command(sys.executable, "-m", "pip", "install", f"slime-stoa[{extra}]")


def run_create_command(store: str, run: str, *, model: str = "MODEL", task: str = "TASK") -> str:
    """`stoa run create` of `run` in `store` (by default MODEL and TASK to fill in)."""
    return shell_command("stoa", "run", "create", "--store", store, "--run", run, "--model", model, "--task", task)


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
    return shell_command("stoa", "task", "prepare", task, *sources, "--store", store, "--run", run, "--split", split)
