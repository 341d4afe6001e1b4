"""Run a command's `main(argv)` in a fresh interpreter with some installed modules hidden, as on a
machine where their packages are not installed: an import of one raises ModuleNotFoundError and
`importlib.util.find_spec` says None, so optional imports take their fallbacks as they would there."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence

# Which modules belong to which distribution is read in the child: a test process's own sys.path
# (pytest's, or setuptools' vendored packages once it is imported) can name more.
_RUNNER = """
import importlib, importlib.metadata, json, sys
spec = json.loads(sys.argv[1])
hidden = set(spec["hidden"])
if spec["only"] is not None:
    only = set(spec["only"])
    for top, dists in importlib.metadata.packages_distributions().items():
        if not {d.lower().replace("_", "-") for d in dists} & only:
            hidden.add(top)
for name in hidden - set(sys.modules):  # what the interpreter loaded at start-up stays
    sys.modules[name] = None
sys.path[:0] = spec["path"]
module, _, function = sys.argv[2].partition(":")
sys.exit(getattr(importlib.import_module(module), function)(sys.argv[3:]))
"""


def run_hiding(
    entry: str, argv: Sequence[str], *, hidden: Iterable[str] = (), only: Collection[str] | None = None,
    path: Sequence[str] = (), env: Mapping[str, str] | None = None, timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`entry` ("module:function", called with `argv`) with the top-level modules `hidden` hidden,
    and with `only` every module of an installed distribution not named in it (lower case, "-"
    for "_"); `path` first on sys.path. Its exit status, stdout and stderr."""
    spec = {"hidden": sorted(hidden), "only": None if only is None else sorted(only), "path": list(path)}
    return subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(spec), entry, *argv], capture_output=True,
                          text=True, timeout=timeout, env=None if env is None else dict(env))
