"""The chaos suite's options: the short form runs with the slow tests (`--slow`); the long form (about
30 minutes: more workers, 5-30 s outages, many more kills) with

    python -m pytest --slow tests/chaos --chaos-long        (or STOA_SLOW=1 STOA_CHAOS_LONG=1)

`STOA_CHAOS_JSON=<path>` writes the run's reconciliation as JSON; `STOA_TEST_SEED` replays a run.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.harness import LONG, SHORT, ChaosPlan


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long", action="store_true", default=False,
        help="run the chaos suite's long form (about 30 minutes); also STOA_CHAOS_LONG=1",
    )  # fmt: skip


def long_form(config: pytest.Config) -> bool:
    return bool(config.getoption("--chaos-long", default=False)) or os.environ.get("STOA_CHAOS_LONG", "") == "1"


@pytest.fixture
def chaos_plan(request: pytest.FixtureRequest) -> ChaosPlan:
    return LONG if long_form(request.config) else SHORT
