"""One preflight finding: a check's name, its status (ok, warn, fix) and what to change.

Apart from `preflight` so that the checks in other modules (`preflight_slime_api`) report the
same way without importing the module that runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FIX = "ok", "warn", "fix"
STATUSES = (OK, WARN, FIX)


@dataclass(frozen=True)
class Finding:
    """The outcome of one check."""

    check: str  # short name, e.g. "rollout-temperature"
    status: str  # OK, WARN or FIX
    message: str  # what was found and, unless OK, exactly what to change

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        return self.status == FIX


def ok(check: str, message: str) -> Finding:
    return Finding(check, OK, message)


def warn(check: str, message: str) -> Finding:
    return Finding(check, WARN, message)


def fix(check: str, message: str) -> Finding:
    return Finding(check, FIX, message)
