"""Shared fixtures: one conformance `store` fixture over both backends.

The S3 backend runs against a real SeaweedFS server started on 127.0.0.1 for the test session.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

# MLX: skip the g++ kernel compile (same results) and keep its cache in a per-session folder.
os.environ.setdefault("MLX_DISABLE_COMPILE", "1")

from slime_stoa.protocol.store import Store, open_store
from tests.s3server import LocalS3Server
from tests.shared_data import check_in_ci

BACKENDS = ["file", "s3"]
T = TypeVar("T")


# -- waiting on observed state ----------------------------------------------------------------------
# Tests wait for what they can observe (a counter, a key in the bucket, a status), never for a fixed
# time: a sleep is too short on a loaded machine and, before an "it did not happen" assert, proves
# nothing when the code under test has not even run yet.


def _timed_out(timeout: float, message: str | Callable[[], str]) -> AssertionError:
    what = message() if callable(message) else message
    return AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str | Callable[[], str] = "the condition",
) -> T:
    """Poll `predicate()` until it returns something truthy and return that; AssertionError after
    `timeout` seconds. `message` (a string, or a function called on failure to describe the state
    seen) names what was awaited."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, message)
        time.sleep(interval)
    return value


async def async_wait_until(
    predicate: Callable[[], Any | Awaitable[Any]],
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    message: str | Callable[[], str] = "the condition",
) -> Any:
    """`wait_until` for async tests: sleeps without blocking the event loop, and `predicate` may be
    a coroutine function (e.g. one that lists the bucket)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, message)
        await asyncio.sleep(interval)


def random_seed(name: str = "STOA_TEST_SEED") -> int:
    """The seed of a randomised test: `$STOA_TEST_SEED` if set (to replay a failure), else a fresh
    one. It is printed (pytest shows it with a failure) and the test should name it in its asserts."""
    raw = os.environ.get(name)
    seed = int(raw) if raw else int.from_bytes(os.urandom(4), "little")
    print(f"{name}={seed}")
    return seed


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    with LocalS3Server() as server:
        yield server


@pytest.fixture(scope="session")
def s3_bucket(s3_server: LocalS3Server) -> str:
    name = f"stoa-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(name)
    return name


def s3_url(server: LocalS3Server, bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}?endpoint={server.endpoint_url}"


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store URL of the parametrized backend."""
    backend = getattr(request, "param", "file")
    if backend == "file":
        root = tmp_path / "bucket"
        root.mkdir()
        return f"file://{root}"
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return s3_url(server, bucket, f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def store_env(request: pytest.FixtureRequest, store_url: str) -> dict[str, str]:
    """Environment holding the credentials for `store_url` (empty for file://)."""
    if not store_url.startswith("s3://"):
        return {}
    server = request.getfixturevalue("s3_server")
    creds = server.credentials()
    return {"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key}


@pytest.fixture
async def store(store_url: str, store_env: dict[str, str]) -> AsyncIterator[Store]:
    async with open_store(store_url, environ=store_env) as s:
        yield s


@pytest.fixture(scope="session")
def short_search_quickstart(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One short `stoa quickstart --task search` run (25 versions, a few minutes), shared by the
    slow tests that read it: (its output folder, its JSON summary)."""
    from slime_stoa.cli import main

    root = tmp_path_factory.mktemp("search_quickstart")
    out, summary = root / "qs", root / "summary.json"
    args = ["quickstart", "--task", "search", "--out", str(out), "--minutes", "60", "--max-versions", "25",
            "--json", str(summary)]
    assert main(args) == 0
    return out, json.loads(summary.read_text())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests that use `store`/`store_url` run on the local folder; those marked `both_backends`
    (where the backend matters: the store itself, names and paths, an end-to-end path per half)
    run once per backend, but for those also marked `file_only`."""
    if "store_url" in metafunc.fixturenames and "backend_param" not in metafunc.fixturenames:
        marks = {m.name for m in metafunc.definition.iter_markers()}
        both = "both_backends" in marks and "file_only" not in marks
        metafunc.parametrize("store_url", BACKENDS if both else ["file"], indirect=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow", action="store_true", default=False,
        help="also run the long tests marked `slow` (the learning runs, the wheel install); also STOA_SLOW=1",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_backends: run a store test on the local folder and on S3")
    config.addinivalue_line("markers", "file_only: in a both_backends module, run this test on the local folder only")
    config.addinivalue_line("markers", "slow: a long test (a learning run, the wheel install), only with --slow or STOA_SLOW=1")
    config.addinivalue_line("markers", "r2: runs against a real bucket when STOA_R2_TEST_URL and its credentials are set, else skipped")
    os.environ.setdefault("TMPDIR", tempfile.gettempdir())
    check_in_ci()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `slow` run only with `--slow` (or STOA_SLOW=1): the default suite stays short."""
    if config.getoption("--slow", default=False) or os.environ.get("STOA_SLOW", "") == "1":
        return
    skip = pytest.mark.skip(reason="a long test: python -m pytest --slow (or STOA_SLOW=1)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
