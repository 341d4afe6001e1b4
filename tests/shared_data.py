"""Where the tests find the real data the project does not ship: GSM8K's train and test files.

Looked for, in order: $STOA_GSM8K_DIR, then shared/data/gsm8k in the checkout and beside it. A
developer's clone without them skips the tests that need them (`needs_gsm8k`); CI ($CI set) has
them, so there their absence stops the whole run at start-up (`check_in_ci`): a skip would hide
that the real-data tests never ran.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GSM8K_ENV = "STOA_GSM8K_DIR"  # a folder holding GSM8K's train.jsonl and test.jsonl


def gsm8k_dirs() -> list[Path]:
    """The folders GSM8K is looked for in, in order (module docstring)."""
    checkout = Path(__file__).resolve().parents[1]
    named = os.environ.get(GSM8K_ENV)
    return [*([Path(named)] if named else []), *(root / "shared" / "data" / "gsm8k" for root in (checkout, checkout.parent))]


def _found() -> Path:
    return next((d for d in gsm8k_dirs() if (d / "train.jsonl").is_file()), gsm8k_dirs()[0])


GSM8K_DIR = _found()
MISSING = (
    f"GSM8K files (train.jsonl, test.jsonl) not found: set ${GSM8K_ENV} to their folder, or put them in "
    f"shared/data/gsm8k beside the checkout (looked in {', '.join(map(str, gsm8k_dirs()))})"
)
needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason=MISSING)


def check_in_ci() -> None:
    """In CI, stop before any test runs when the GSM8K files are missing (module docstring)."""
    if os.environ.get("CI") and not all((GSM8K_DIR / name).is_file() for name in ("train.jsonl", "test.jsonl")):
        raise pytest.UsageError(f"CI needs the real-data tests: {MISSING}")
