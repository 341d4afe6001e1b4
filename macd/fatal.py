"""Problems retrying cannot fix: `macd run` stops with their one line (exit status 2) instead.

The worker outlives whatever the bucket does: an outage, a malformed or missing weights object
is reported and retried (`worker.py`), since the bucket may be put right; so is missing task data
(never prepared, or deleted by a token holder: `stoa task prepare` puts it back), which the worker
waits for, naming that command (`worker.TaskNotPrepared`). Some problems are the same on every
try, and a worker retrying them looks busy while it never generates:

- the run's model is of a family macd cannot run (`slime_stoa.protocol.hf.architectures`);
- the model could not be built from the run's anchor (mlx-lm refused its config or its weights);
- an error of the code itself (`PROGRAMMING_ERRORS`: a bug, or an incompatible install such as
  another mlx-lm version), which no store or network problem raises.

Each stops the worker with one line naming the cause and the fix. Under launchd a stopped worker
is started again after its throttle interval (`service.THROTTLE_INTERVAL_S`) and says the same
line again until someone acts, without hammering the bucket.
"""

from __future__ import annotations

from slime_stoa.protocol.store import StoreError
from slime_stoa.protocol.store.retry import describe_error

#: Errors of the code, never of a store, a network or the bucket's contents (the protocol's
#: parsers raise ValueError, the stores StoreError or OSError): a retry meets them again.
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, AttributeError, NameError, ImportError, NotImplementedError, AssertionError,
)


class Fatal(Exception):
    """A problem no retry fixes; the message is one line naming the cause and the fix."""


def permanent(exc: BaseException, what: str) -> Fatal | None:
    """`exc` as a `Fatal` when retrying cannot fix it (a `Fatal` itself, or one of
    `PROGRAMMING_ERRORS`); None when it may pass (an outage, a malformed object: retried).
    `what` names the step that failed ("run", "weights", "tool")."""
    if isinstance(exc, Fatal):
        return exc
    if isinstance(exc, PROGRAMMING_ERRORS) and not isinstance(exc, (StoreError, OSError)):
        return Fatal(
            f"{what}: {describe_error(exc)}: an error in this macd or its packages (e.g. mlx-lm), not in the "
            f"bucket, so retrying cannot fix it: reinstall or upgrade macd (pip install -U with the worker "
            f"extra), or report it with the traceback (log_level = \"DEBUG\" in the config logs it)"
        )
    return None
