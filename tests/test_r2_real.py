"""Opt-in tests against a real R2 (or any S3-compatible) bucket: the store conformance suite, weight
publish/subscribe and the signed path, each run under a fresh prefix of the bucket that
`STOA_R2_TEST_URL` names (e.g. ``r2://<account-id>/<bucket>/stoa-tests``), with the credentials
the store reads for it (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or ~/.r2env, or STOA_ENV_FILE).
Without them every test here is skipped, saying so. Run: ``python -m pytest -m r2``.

The tests are the suites' own functions (the same assertions as on the local folder and the local
S3 server), called with a store on the real bucket; what each leaves under its prefix is deleted.
"""

from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from slime_stoa.protocol.store import Store, StoreConfigError, open_store
from slime_stoa.protocol.store.credentials import load_credentials
from tests import test_pulse_sync, test_signed_records, test_store_conformance
from tests.test_consumer import tiny  # noqa: F401  (fixture of the signed-path tests)

URL_ENV = "STOA_R2_TEST_URL"
STORE_ARGS = {"store", "store_url", "store_env"}
SIGNED_PATH = (
    "test_every_record_attack_is_refused_and_counted",
    "test_a_forged_pointer_does_not_make_a_forged_version_published",
    "test_the_trainer_signs_its_state_and_refuses_a_forged_one",
)

pytestmark = pytest.mark.r2


def _backend_tests(module: Any, names: tuple[str, ...] | None = None) -> list[Callable[..., Any]]:
    """The module's tests that take a store and are meant for every backend (not `file_only`)."""
    found = []
    for name, fn in inspect.getmembers(module, inspect.iscoroutinefunction):
        if not name.startswith("test_") or (names is not None and name not in names):
            continue
        marks = {m.name for m in getattr(fn, "pytestmark", [])}
        if "file_only" in marks or not STORE_ARGS & set(inspect.signature(fn).parameters):
            continue
        if names is None and "both_backends" not in marks and module is not test_store_conformance:
            continue
        found.append(fn)
    return found


def with_prefix(url: str, prefix: str) -> str:
    """`url` with `prefix` appended to its path (before any ?endpoint= query)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + prefix))


@pytest.fixture
def r2_url() -> str:
    base = os.environ.get(URL_ENV, "")
    if not base:
        pytest.skip(f"real-bucket test: set {URL_ENV} (e.g. r2://<account-id>/<bucket>/stoa-tests) and its credentials")
    scheme = base.partition("://")[0]
    if scheme not in ("r2", "s3"):
        pytest.fail(f"{URL_ENV} must be an r2:// or s3:// URL, got {base!r}")
    try:
        creds = load_credentials(scheme)
    except StoreConfigError as exc:
        pytest.skip(f"real-bucket test: {exc}")
    if creds is None:
        pytest.skip(f"real-bucket test: {URL_ENV} is set but no credentials are (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.r2env or STOA_ENV_FILE)")
    return with_prefix(base, f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def r2_store(r2_url: str) -> AsyncIterator[Store]:
    async with open_store(r2_url) as store:
        yield store
        async for info in store.list(""):  # leave the bucket as it was
            await store.delete(info.key)


async def _call(fn: Callable[..., Any], request: pytest.FixtureRequest, store: Store, url: str) -> None:
    kwargs: dict[str, Any] = {}
    for name in inspect.signature(fn).parameters:
        kwargs[name] = {"store": store, "store_url": url, "store_env": dict(os.environ)}.get(name)
        if kwargs[name] is None:
            kwargs[name] = request.getfixturevalue(name)
    await fn(**kwargs)


@pytest.mark.parametrize("fn", _backend_tests(test_store_conformance), ids=lambda f: f.__name__)
async def test_store_conformance_on_the_real_bucket(fn: Callable[..., Any], request: pytest.FixtureRequest, r2_store: Store, r2_url: str) -> None:
    await _call(fn, request, r2_store, r2_url)


@pytest.mark.parametrize("fn", _backend_tests(test_pulse_sync), ids=lambda f: f.__name__)
async def test_publish_subscribe_on_the_real_bucket(fn: Callable[..., Any], request: pytest.FixtureRequest, r2_store: Store, r2_url: str) -> None:
    await _call(fn, request, r2_store, r2_url)


@pytest.mark.parametrize("fn", _backend_tests(test_signed_records, SIGNED_PATH), ids=lambda f: f.__name__)
async def test_signed_path_on_the_real_bucket(fn: Callable[..., Any], request: pytest.FixtureRequest, r2_store: Store, r2_url: str) -> None:
    await _call(fn, request, r2_store, r2_url)


def test_the_suites_are_collected() -> None:
    """What runs on the real bucket (so a renamed suite test cannot silently drop out)."""
    assert len(_backend_tests(test_store_conformance)) >= 15
    assert len(_backend_tests(test_pulse_sync)) >= 4
    assert [f.__name__ for f in _backend_tests(test_signed_records, SIGNED_PATH)] == sorted(SIGNED_PATH)
    assert with_prefix("r2://0123/b/p?endpoint=https://x", "t-1") == "r2://0123/b/p/t-1?endpoint=https://x"
