"""The quickstart learner's start-up outlasts store outages: a full outage (longer than the store
client's own retries) that starts as it seeds the run, as it resumes its publisher, reads the
worker registry or rebuilds the published weights pauses the start-up, which goes on when the
store answers. Against the real local S3 server, through the fault-injecting proxy; no workers
(the learner's start-up is the subject).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from slime_stoa.protocol.layout import RunLayout
from tests.chaos.harness import INTERRUPTED, LEARNER, RUN, LearnerProcess, child_env, key_of, processes_left
from tests.conftest import async_wait_until
from tests.faultproxy import FaultyProxy

OUTAGE_S = 6.0  # well past the S3 client's own retries of a request (6 attempts, up to about 2.5 s)
WAIT_S = 180.0


async def outage_at(learner: LearnerProcess, prefix: str, method: str, key: Callable[[str], bool], what: str) -> None:
    """Wait for the learner's next `method` request of a key `key()` accepts, then take the
    store away (that request cut, every connection refused) for `OUTAGE_S`."""
    proxy = learner.proxy
    trap = proxy.hold(lambda m, p: m == method and key(key_of(p, prefix) or ""))

    def hit() -> bool:
        assert learner.alive, f"the learner exited before {what}:\n{learner.tail(40)}"
        return trap.hit.is_set()

    try:
        await async_wait_until(hit, message=lambda: f"the learner {what}:\n{learner.tail()}", timeout=WAIT_S)
    except AssertionError:
        proxy._holds.remove(trap)
        raise
    proxy.set_down()
    trap.drop()
    await asyncio.sleep(OUTAGE_S)
    proxy.set_up()


@pytest.mark.slow  # ~1 minute on two cores
async def test_the_learner_start_up_waits_out_store_outages(s3_server: Any, tmp_path: Path) -> None:
    bucket = s3_server.create_bucket()
    prefix = "startup"
    creds = s3_server.credentials()
    env = child_env({"AWS_ACCESS_KEY_ID": creds.access_key_id, "AWS_SECRET_ACCESS_KEY": creds.secret_access_key})
    layout = RunLayout(RUN)
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    learner: LearnerProcess | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            direct = await stack.enter_async_context(s3_server.store(bucket, prefix))
            proxy = await stack.enter_async_context(FaultyProxy(port, seed=1, name="learner"))
            url = f"s3://{bucket}/{prefix}?endpoint={proxy.endpoint}"
            learner = LearnerProcess(tmp_path / "learner", proxy, {**LEARNER, "store": url, "seed": 3}, env)

            def up() -> bool:  # through its start-up: the consumer is next
                assert learner is not None
                assert learner.alive, f"the learner exited:\n{learner.tail(40)}"
                return not learner.starting()

            # A new run: the outage starts as the learner writes the run manifest (seeding).
            learner.start()
            await outage_at(learner, prefix, "PUT", lambda k: k == layout.run_manifest, "seeding the run")
            await async_wait_until(up, message=learner.tail, timeout=WAIT_S)
            assert await direct.exists(layout.pointer)
            assert await learner.stop(60) == INTERRUPTED, learner.tail()

            # A rerun that rebuilds the published weights (no learner file): an outage as its
            # publisher resumes from the pointer, one as it reads the worker registry, and one as
            # it downloads the anchor to rebuild the weights from.
            (learner.folder / "out" / "learner.pt").unlink()
            learner.start()
            await outage_at(learner, prefix, "GET", lambda k: k == layout.pointer, "resuming its publisher")
            await outage_at(learner, prefix, "GET", lambda k: k.endswith("registry.json"), "reading the registry")
            await outage_at(learner, prefix, "GET", lambda k: k.startswith(layout.anchors_prefix), "rebuilding")
            await async_wait_until(up, message=learner.tail, timeout=WAIT_S)
            assert await learner.stop(60) == INTERRUPTED, learner.tail()
    finally:
        if learner is not None and learner.alive:
            learner.kill()
    assert learner is not None
    assert [how for _, how in learner.exits] == ["stop", "stop"], learner.tail(60)
    log = learner.log_text()
    assert log.count("the store is unavailable") >= 4 and log.count("the store answers again") >= 4, learner.tail(60)
    assert learner.said("resumed run 'chaos' at weights v0 from"), learner.tail(60)  # rebuilt, not from its file
    assert processes_left([learner], str(tmp_path)) == []
