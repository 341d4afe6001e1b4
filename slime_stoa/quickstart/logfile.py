"""Where the consumer's own pause lines go in a quickstart: `<out>/quickstart.log`, not the console.

The consumer reports a pause (`trainer.consumer.pause`) in a slime trainer's words, at tries 1, 2,
4, 8, ..., its repairs a slime trainer's. The quickstart says each pause once on the console in
its own words (`spoiled.Paused`), so the consumer's lines are kept in the run folder's log file
only: one line per pause on the console, the consumer's account beside the run for whoever
looks into it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slime_stoa.trainer.consumer import pause

LOG_FILE = "quickstart.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the CLI's console format


@contextmanager
def pause_lines_to_file(out: Path) -> Iterator[Path]:
    """While inside, the consumer's pause lines go to `out`/`LOG_FILE` (appended, created at the
    first line) and not to the console's handlers; the log file's path."""
    path = out / LOG_FILE
    handler = logging.FileHandler(path, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter(FORMAT))
    logger = pause.log
    propagated = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield path
    finally:
        logger.propagate = propagated
        logger.removeHandler(handler)
        handler.close()


__all__ = ["LOG_FILE", "pause_lines_to_file"]
