"""The folder every macd of this Mac shares: what one copy serves all of them (the search index,
fetched once and memory-mapped read-only by every worker process).

`$STOA_SHARED_DIR` when set, else the user's cache folder: `~/Library/Caches/stoa` on macOS,
`$XDG_CACHE_HOME/stoa` (`~/.cache/stoa`) elsewhere. Not a worker's `data_dir`: two macd of one
Mac on the same run each have their own data folder (one process per spool), and would otherwise
each keep their own copy of a PubMed-sized index.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

SHARED_DIR_ENV = "STOA_SHARED_DIR"


def machine_shared_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """The shared folder of this machine (see the module docstring); always absolute."""
    env = os.environ if environ is None else environ
    if env.get(SHARED_DIR_ENV):
        return Path(os.path.abspath(Path(env[SHARED_DIR_ENV]).expanduser()))
    if (platform or sys.platform) == "darwin":
        return Path("~/Library/Caches/stoa").expanduser()
    return Path(env.get("XDG_CACHE_HOME") or "~/.cache").expanduser().absolute() / "stoa"
