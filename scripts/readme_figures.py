"""The README's quickstart sample output and figures, from one real run.

    python scripts/readme_figures.py [--out FILE] [--png FILE] [--keep DIR] [-- QUICKSTART OPTIONS]

Runs `stoa quickstart` (the default synthetic task, its defaults) in a scratch folder, reads its
summary JSON and prints the README block: the run's output (stdout) as a terminal shows it (the
progress lines, a bar there, left out), its version table elided (first rows, a middle one, last
rows) and the scratch paths written as the README writes them, then the figures the README's
prose quotes and the count of its log lines (stderr), with the date, the machine's core count
and its load average before and after the run. `--png` copies the run's learning curve there (the README's
figure is docs/quickstart.png); `--out` writes the block to a file instead of printing it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

README_OUT = "stoa-quickstart"  # how the README names the run folder
VERSION_ROW = re.compile(r"^\s*v\d+\s")
PROGRESS_LINE = re.compile(r"^stoa .*: \w+ \d+/\d+ \(\d+%\), .*/s, ETA ")  # a meter's line off a terminal
HEAD_ROWS, TAIL_ROWS = 3, 2


def load_text() -> str:
    """The load average (1, 5, 15 minutes) as "1.23 1.10 0.98" ("unknown" where there is none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def elide_versions(lines: Sequence[str], head: int = HEAD_ROWS, tail: int = TAIL_ROWS) -> list[str]:
    """`lines` with the version table cut to its first `head` rows, the middle row and the last
    `tail`, each cut marked "   ..."."""
    rows = [i for i, line in enumerate(lines) if VERSION_ROW.match(line)]
    if len(rows) <= head + tail + 1:
        return list(lines)
    middle = rows[len(rows) // 2]
    kept = set(rows[:head]) | {middle} | set(rows[-tail:])
    out: list[str] = []
    for i, line in enumerate(lines):
        if i in rows and i not in kept:
            if out and out[-1] != "   ...":
                out.append("   ...")
            continue
        out.append(line)
    return out


def terminal_lines(text: str) -> list[str]:
    """The lines of `text` a terminal keeps: a progress bar is gone once done."""
    return [line for line in text.splitlines() if not PROGRESS_LINE.match(line)]


def log_summary(text: str) -> str:
    """The log lines (stderr) counted by level: "4 (4 WARNING)", "0"."""
    lines = [line for line in text.splitlines() if line.strip()]
    levels: dict[str, int] = {}
    for line in lines:
        level = next((w for w in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") if f" {w} " in line), "other")
        levels[level] = levels.get(level, 0) + 1
    counted = ", ".join(f"{n} {level}" for level, n in sorted(levels.items()))
    return f"{len(lines)} ({counted})" if lines else "0"


def readme_paths(text: str, scratch: Path) -> str:
    """`text` with the scratch run folder written as the README writes it."""
    text = text.replace(f"file://{scratch}", f"file:///.../{README_OUT}")
    return text.replace(str(scratch), README_OUT)


def figures(summary: dict[str, Any]) -> list[str]:
    """The figures the README's prose quotes, one per line, from the run's summary JSON."""

    def num(key: str, fmt: str = ".3f") -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    return [
        f"reward {num('reward_first')} (v{summary.get('first_version')}) -> {num('reward_last')} "
        f"(last {summary.get('window')} versions) in {summary.get('versions_run')} versions",
        f"eval pass@1 {num('eval_pass1_first')} -> {num('eval_pass1_last')} "
        f"({summary.get('eval_prompts')} held-out prompts)",
        f"search rate {num('search_rate_first', '.2f')} -> {num('search_rate_last', '.2f')}",
        f"patch per version {num('patch_bytes_mean', '.0f')} B vs full bf16 sync {num('full_bytes', '.0f')} B",
        f"groups used {summary.get('groups_used_run')}, lost {summary.get('groups_lost')}; "
        f"digests checked {summary.get('digests_checked')}, mismatched {summary.get('digest_mismatches')}",
        f"run time {num('seconds_run', '.0f')} s",
    ]


def block(output: str, log: str, summary: dict[str, Any], scratch: Path, *, date: str, cores: int | None,
          load_before: str, load_after: str, exit_code: int) -> str:
    """The whole README block (see the module doc) of a run's stdout `output` and stderr `log`."""
    lines = terminal_lines(readme_paths(output, scratch))
    machine = f"{date}, {cores or '?'} cores, load average (1/5/15 min) {load_before} before, {load_after} after"
    parts = [
        f"# stoa quickstart, {machine}; exit {exit_code}",
        "```",
        *(line.rstrip() for line in elide_versions(lines)),
        "```",
        "figures:",
        *(f"  {f}" for f in figures(summary)),
        f"  log lines (stderr): {log_summary(log)}",
    ]
    return "\n".join(parts) + "\n"


def run_quickstart(out: Path, extra: Sequence[str]) -> tuple[int, str, str]:
    """`stoa quickstart --out OUT` as its own process: (exit status, stdout, stderr)."""
    env = {**os.environ, "COLUMNS": "120", "TERM": "dumb"}  # the summary table unwrapped, no colours
    cmd = [sys.executable, "-m", "slime_stoa.cli", "quickstart", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    return done.returncode, done.stdout, done.stderr


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the block here (default: print it)")
    parser.add_argument("--png", type=Path, help="copy the run's learning curve here (e.g. docs/quickstart.png)")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a scratch folder, removed)")
    parser.add_argument("quickstart", nargs=argparse.REMAINDER, help="after --: more `stoa quickstart` options")
    args = parser.parse_args(argv)
    extra = [a for a in args.quickstart if a != "--"]
    with tempfile.TemporaryDirectory(prefix="stoa-readme-") as tmp:
        scratch = (args.keep or Path(tmp) / README_OUT).resolve()
        if scratch.exists() and any(scratch.iterdir()):
            print(f"error: {scratch} is not empty: a quickstart there would resume, not start a run", file=sys.stderr)
            return 2
        date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        before = load_text()
        started = time.monotonic()
        code, output, log = run_quickstart(scratch, extra)
        after = load_text()
        try:
            summary = json.loads((scratch / "summary.json").read_text())
        except (OSError, ValueError) as exc:
            print(output + log, end="")
            print(f"error: the quickstart (exit {code}) left no readable summary: {exc}", file=sys.stderr)
            return 1
        summary.setdefault("seconds_run", time.monotonic() - started)
        text = block(output, log, summary, scratch, date=date, cores=os.cpu_count(), load_before=before,
                     load_after=after, exit_code=code)
        if args.png is not None:
            shutil.copyfile(scratch / "learning_curve.png", args.png)
    if args.out is not None:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
