"""A run survives a week: the trainer side waits out store outages and quiet fleets, notices a
trainer that stopped publishing, and resumes after a SIGKILL with no group used twice or skipped.

The rollout tests go through the real `slime_stoa.generate_rollout` with slime's argument names
and stand-in slime modules (`tests/slime_standins.py`), against the local folder store and the
real local S3 server; the outage test puts a fault-injecting TCP proxy on loopback in front of
the S3 server. Every wait is on observed state (a log line, a counter, a printed batch).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import types
import uuid
from itertools import islice, pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slime_stoa.protocol.hf.folders import load_hf_state
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError, StoreUnavailable
from slime_stoa.protocol.store.retry import RetryPolicy, outage_policy, through_outages
from slime_stoa.trainer.consumer import ConsumerTimeout, StateConflict, read_state
from slime_stoa.trainer.consumer.counting import CountingStore
from slime_stoa.trainer.slime import rollout
from slime_stoa.trainer.slime.data_source import STATE_FILE, StoaDataSource, state_path
from slime_stoa.trainer.slime.settings import settings_from_args
from tests import slime_standins
from tests.conftest import async_wait_until, random_seed, wait_until
from tests.faultproxy import FaultyProxy
from tests.test_consumer import RUN, G, make_group, now_ms, open_consumer, setup_run, tiny, upload

__all__ = ["tiny"]  # the session fixture, shared with test_consumer

REPO = Path(__file__).resolve().parent.parent
QUICK = dict(  # the consumer's waits, scaled down for tests
    stoa_poll_interval_s=0.02,
    stoa_sweep_interval_s=0.2,
    stoa_progress_interval_s=0.2,
    stoa_store_retry_max_delay_s=0.1,
)


# -- fixtures and helpers ---------------------------------------------------------------------------
@pytest.fixture
async def slime(monkeypatch: pytest.MonkeyPatch):
    """Stand-in slime modules; the rollout function's per-process session is closed afterwards."""
    for name, module in slime_standins.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    yield
    await close_session()


async def close_session() -> None:
    if rollout._SESSION is not None:
        await asyncio.to_thread(rollout._SESSION.close)
        rollout._SESSION = None


@pytest.fixture
def backend_param() -> None:
    """Requested by the S3-only tests: conftest then leaves `store_url` to their own parametrize."""


@pytest.fixture
def creds(monkeypatch: pytest.MonkeyPatch, store_env: dict[str, str]) -> dict[str, str]:
    """The store's credentials in the environment, where the rollout function looks for them."""
    for name, value in store_env.items():
        monkeypatch.setenv(name, value)
    return store_env


def rollout_args(url: str, tiny: Any, **settings: Any) -> types.SimpleNamespace:
    """slime's args as the rollout function sees them: its flags plus the custom-config YAML keys."""
    fields: dict[str, Any] = dict(
        stoa_bucket=url, stoa_run=RUN, stoa_tokenizer_dir=str(tiny.folder), stoa_check_publishing=False,
        rollout_batch_size=2, n_samples_per_prompt=G, save=None, load=None,
    )  # fmt: skip
    fields.update(QUICK)
    fields.update(settings)
    return types.SimpleNamespace(**fields)


def logged(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in list(caplog.records) if needle in r.getMessage()]


def keys_of(out: Any) -> list[str]:
    return [group[0].metadata["stoa_key"] for group in out.samples]


async def upload_groups(
    store: Store, tiny: Any, n: int, *, first_seq: int = 0, worker: str = "w", **overrides: Any
) -> list[str]:
    base = now_ms() - 60_000
    keys = []
    for i in range(first_seq, first_seq + n):
        group = make_group(tiny, worker=worker, seq=i, prompt_index=i % 32, **overrides)
        keys.append(await upload(store, group, base + i))
    return keys


def fast_inner_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shorten the S3 backend's own per-request retries (a few seconds by default) so an outage
    reaches the consumer's outage layer, the layer under test, within a test's time."""
    real = rollout.open_store

    def opened(url: str, **kw: Any) -> Store:
        store = real(url, **kw)
        if hasattr(store, "retry"):
            store.retry = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05)
        return store

    monkeypatch.setattr(rollout, "open_store", opened)


# -- the retry layer (pure) ------------------------------------------------------------------------
def test_a_policy_can_retry_forever_with_a_capped_delay() -> None:
    policy = outage_policy(30.0)
    delays = list(islice(policy.delays(random.Random(0)), 500))
    assert len(delays) == 500 and max(delays) <= 30.0 and max(delays[20:]) > 15  # capped, not shrinking
    assert policy.worst_case_seconds() == float("inf")
    assert len(set(delays)) > 450  # jittered
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        outage_policy(float("inf"))


async def test_through_outages_waits_logs_every_interval_and_raises_config_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)
        now[0] += delay

    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        now[0] += 1.0  # each try takes a second
        if calls <= 200:
            raise StoreUnavailable(f"endpoint did not answer (try {calls})")
        return "ok"

    logger = logging.getLogger("tests.outage")
    with caplog.at_level(logging.WARNING, logger="tests.outage"):
        got = await through_outages(
            flaky, describe="LIST rollouts", policy=outage_policy(30.0), log_interval_s=60.0, logger=logger,
            rng=random.Random(1), sleep=sleep, clock=lambda: now[0],
        )  # fmt: skip
    assert got == "ok" and calls == 201 and max(slept) <= 30.0
    down = logged(caplog, "the store is unavailable")
    assert down[0].startswith("stoa: LIST rollouts: the store is unavailable (0 s so far, 1 failed tries)")
    assert "StoreUnavailable: endpoint did not answer (try 1)" in down[0]
    at = [int(m.group(1)) for t in down if (m := re.search(r"\((\d+) s so far", t))]
    assert len(at) == len(down)
    gaps = [b - a for a, b in pairwise(at)]
    assert min(gaps) >= 59 and max(gaps) <= 60 + 30 + 2  # once a minute (±1 s of rounding), none missed
    assert len(down) >= now[0] // 92
    assert logged(caplog, "answers again after")

    for error in (StoreConfigError("bad credentials"), NotFound("k")):
        tries = 0

        async def broken(error: Exception = error) -> None:
            nonlocal tries
            tries += 1
            raise error

        with pytest.raises(type(error)):
            await through_outages(broken, describe="GET k", sleep=sleep)
        assert tries == 1  # at once, no retry


def test_the_new_settings_and_their_defaults() -> None:
    from slime_stoa.trainer.consumer import ConsumerConfig

    cfg = ConsumerConfig(store_url="file:///b", run="r")
    assert (cfg.wait_timeout_s, cfg.progress_interval_s, cfg.store_retry_max_delay_s) == (None, 60.0, 30.0)
    for name, bad in (("wait_timeout_s", 0), ("wait_timeout_s", float("inf")), ("store_retry_max_delay_s", -1)):
        with pytest.raises(ValueError, match=name):
            ConsumerConfig(store_url="file:///b", run="r", **{name: bad})
    from slime_stoa.trainer.slime.settings import DEFAULT_PUBLISH_GRACE_S, StoaSettings

    def settings(**keys: object) -> StoaSettings:
        return StoaSettings.from_args(types.SimpleNamespace(stoa_bucket="file:///b", stoa_run="r", **keys))

    assert settings(stoa_wait_timeout_s=None).consumer.wait_timeout_s is None
    assert settings(stoa_wait_timeout_s="90").consumer.wait_timeout_s == 90.0
    assert rollout.publishing_check(settings()) == DEFAULT_PUBLISH_GRACE_S == 120.0
    assert rollout.publishing_check(settings(stoa_publish_grace_s="5")) == 5.0
    assert rollout.publishing_check(settings(stoa_check_publishing="false")) is None
    for bad_args in (dict(stoa_publish_grace_s=-1), dict(stoa_publish_grace_s="soon"), dict(stoa_check_publishing="x")):
        with pytest.raises(ValueError, match="stoa_"):
            settings(**bad_args)


# -- the consumer through outages --------------------------------------------------------------------
class SwitchStore(CountingStore):
    """A real store whose GETs and HEADs fail as unavailable (or misconfigured) while switched."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.down = False
        self.config_error = False
        self.failed = 0

    def _check(self) -> None:
        if self.config_error:
            raise StoreConfigError("access refused: check the credentials (injected)")
        if self.down:
            self.failed += 1
            raise StoreUnavailable("could not reach the endpoint (injected outage)")

    async def get(self, key: str, **kw: Any):
        self._check()
        return await super().get(key, **kw)

    async def head(self, key: str):
        self._check()
        return await super().head(key)


async def test_downloads_wait_out_an_outage_without_rejecting(store: Store, store_url: str, tiny: Any) -> None:
    await setup_run(store, tiny)
    await upload_groups(store, tiny, 3)
    switch = SwitchStore(store)
    consumer = await open_consumer(
        switch, tiny, store_url, wait_timeout_s=None, max_download_attempts=1, store_retry_max_delay_s=0.02
    )
    switch.down = True  # the listing still answers, every download and the probe fail
    task = asyncio.create_task(consumer.next_batch(3, trainer_version=0))
    await async_wait_until(
        lambda: consumer.counters.get("store_outage_retries", 0) >= 5,
        message=lambda: f"5 failed probes (counters {consumer.counters})",
    )
    assert not task.done() and not any(k.startswith("rejected/") for k in consumer.counters)
    switch.down = False
    batch = await asyncio.wait_for(task, 30)
    assert len(batch.groups) == 3 and batch.metrics["rollout/stoa_rejected"] == 0
    assert batch.metrics["rollout/stoa_store_outage_retries"] >= 5
    # A config error is no outage: it fails the batch at once.
    await upload_groups(store, tiny, 1, first_seq=10)
    switch.config_error = True
    with pytest.raises(StoreConfigError, match="credentials"):
        await asyncio.wait_for(consumer.next_batch(1, trainer_version=0), 30)
    await consumer.close()


class LostAnswerStore(CountingStore):
    """The next write lands, but its answer is lost (the caller sees StoreUnavailable)."""

    lose_next = False

    async def _maybe_lose(self, etag: str) -> str:
        if self.lose_next:
            self.lose_next = False
            raise StoreUnavailable("connection dropped before the answer (injected)")
        return etag

    async def put(self, key: str, data: Any, *, if_match: str | None = None) -> str:
        return await self._maybe_lose(await super().put(key, data, if_match=if_match))

    async def put_if_absent(self, key: str, data: Any) -> str:
        return await self._maybe_lose(await super().put_if_absent(key, data))


async def test_a_state_write_whose_answer_was_lost_is_not_a_conflict(store: Store, store_url: str, tiny: Any) -> None:
    await setup_run(store, tiny)
    await upload_groups(store, tiny, 2)
    lossy = LostAnswerStore(store)
    consumer = await open_consumer(lossy, tiny, store_url, store_retry_max_delay_s=0.02)
    for _ in range(2):  # the create (put-if-absent), then a compare-and-swap
        await consumer.next_batch(1, trainer_version=0)
        snapshot = consumer.state_dict()
        lossy.lose_next = True
        await consumer.save_state(snapshot)
        saved, _ = await read_state(store, RUN)
        assert saved is not None and saved.to_json() == snapshot
    await upload_groups(store, tiny, 1, first_seq=5)
    other = await open_consumer(store, tiny, store_url)
    await other.load_from_bucket()
    await other.next_batch(1, trainer_version=0)
    await other.save_state()  # another trainer moved it: a real conflict stays one
    with pytest.raises(StateConflict):
        await consumer.save_state()
    await consumer.close()
    await other.close()


# -- (a) a store outage in the middle of a rollout's wait ------------------------------------------------
@pytest.mark.parametrize("store_url", ["s3"], indirect=True)
async def test_a_rollout_waits_out_a_store_outage(
    store: Store, store_url: str, tiny: Any, s3_server: Any, creds: dict, slime: None, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, backend_param: None,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="slime_stoa")
    fast_inner_retries(monkeypatch)
    await setup_run(store, tiny)
    first = await upload_groups(store, tiny, 1)
    server_port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    async with FaultyProxy(server_port) as proxy:
        proxied = store_url.replace(f"endpoint={s3_server.endpoint_url}", f"endpoint={proxy.endpoint}")
        assert proxied != store_url
        args = rollout_args(proxied, tiny, rollout_batch_size=2, save=str(tmp_path / "ckpt"))
        source = StoaDataSource(args)
        task = asyncio.ensure_future(asyncio.to_thread(rollout.generate_rollout, args, 0, source))
        await async_wait_until(lambda: logged(caplog, "have 1 of 2 ready"), message="the rollout waiting with 1 of 2")
        proxy.set_down()
        await async_wait_until(
            lambda: len(logged(caplog, "the store is unavailable")) >= 3,
            message=lambda: f"three outage logs (have {logged(caplog, 'the store is unavailable')})",
        )
        second = await upload_groups(store, tiny, 1, first_seq=1)  # lands while the trainer cannot see it
        dropped = proxy.dropped
        await async_wait_until(lambda: proxy.dropped >= dropped + 3, message="the consumer trying again")
        assert not task.done()  # it waits; before, StoreUnavailable ended the rollout after ~3 s
        text = logged(caplog, "the store is unavailable")[-1]
        assert re.search(r"listing (new|late) records of run", text) and "s so far" in text and "StoreUnavailable" in text
        proxy.set_up()
        out = await asyncio.wait_for(task, 60)
    assert sorted(keys_of(out)) == sorted(first + second)
    assert logged(caplog, "the store answers again")
    assert out.metrics["rollout/stoa_store_outage_retries"] >= 3
    assert json.loads(state_path(tmp_path / "ckpt").read_text())["consumer"]["counters"]["groups_used"] == 2


@pytest.mark.parametrize("store_url", ["s3"], indirect=True)
async def test_bad_credentials_fail_at_once(
    store: Store, store_url: str, tiny: Any, creds: dict, slime: None, monkeypatch: pytest.MonkeyPatch,
    backend_param: None,
) -> None:
    await setup_run(store, tiny)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    args = rollout_args(store_url, tiny)
    with pytest.raises(StoreConfigError, match="access refused"):
        await asyncio.wait_for(asyncio.to_thread(rollout.generate_rollout, args, 0, StoaDataSource(args)), 60)


# -- (b) a fleet that stays quiet longer than the old timeout --------------------------------------------
async def test_a_rollout_waits_for_a_quiet_fleet(
    store: Store, store_url: str, tiny: Any, creds: dict, slime: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slime_stoa")
    await setup_run(store, tiny)
    timed = rollout_args(store_url, tiny, stoa_wait_timeout_s=0.5)
    with pytest.raises(ConsumerTimeout, match=f"for 2 rollout groups of run {RUN!r}"):
        await asyncio.to_thread(rollout.generate_rollout, timed, 0, StoaDataSource(timed))  # opted in: fails
    await close_session()
    args = rollout_args(store_url, tiny)  # the default: no timeout
    assert settings_from_args(args).consumer.wait_timeout_s is None
    task = asyncio.ensure_future(asyncio.to_thread(rollout.generate_rollout, args, 0, StoaDataSource(args)))

    def waited() -> int:
        found = [int(m.group(1)) for t in logged(caplog, "have 0 of 2 ready") if (m := re.search(r"waited (\d+) s", t))]
        return max(found, default=-1)

    await async_wait_until(lambda: waited() >= 2, message=lambda: f"a wait of 2 s or more (logged {waited()} s)")
    assert not task.done()  # four times the old-style timeout, and still waiting
    assert "no record discovered yet" in logged(caplog, "have 0 of 2 ready")[-1]
    keys = await upload_groups(store, tiny, 2)
    out = await asyncio.wait_for(task, 60)
    assert sorted(keys_of(out)) == sorted(keys)


# -- (c) a trainer that does not publish -----------------------------------------------------------------
def bumped(state: dict[str, np.ndarray], step: int) -> dict[str, np.ndarray]:
    """The state with one element of its first tensor changed (a train step's worth)."""
    out = {k: v.copy() for k, v in state.items()}
    name = sorted(out)[0]
    out[name].reshape(-1)[0] ^= np.uint16(step)
    return out


async def test_a_missing_publish_fails_loudly_with_the_likely_causes(
    store: Store, store_url: str, tiny: Any, creds: dict, slime: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="slime_stoa")
    await setup_run(store, tiny, staleness=8, published=None)
    publisher = Publisher(store, RUN, PublisherConfig(extras_dir=tiny.folder, catchup=False))
    state = load_hf_state(tiny.folder)
    await publisher.publish(state)  # v0: the trainer's first update_weights
    await upload_groups(store, tiny, 8, state_digest=publisher.state_digest)
    args = rollout_args(store_url, tiny, rollout_batch_size=1, stoa_check_publishing=True, stoa_background_publish=False, stoa_publish_grace_s=0.3)
    source = StoaDataSource(args)

    def call(rollout_id: int, call_args: Any = args) -> Any:
        return asyncio.to_thread(rollout.generate_rollout, call_args, rollout_id, source)

    assert (await call(0)).metrics["rollout/stoa_trainer_version"] == 0  # the first call is exempt
    await publisher.publish(bumped(state, 1))  # after the train step of rollout 0: v1
    assert (await call(1)).metrics["rollout/stoa_trainer_version"] == 1
    with pytest.raises(rollout.PublishingStalled) as info:  # rollout 1 trained, nothing published
        await call(2)
    text = str(info.value)
    for needle in (
        f"run {RUN!r}", "from v1", "to v2", "still v1", "stoa_publish_grace_s",
        "python scripts/apply_slime_patches.py <slime checkout> --check", "`stoa_publish: true` is missing",
        "errors in the trainer log", "stoa_check_publishing: false", "train_async.py",
    ):  # fmt: skip
        assert needle in text, needle
    # A publish that lands during the grace wait is waited for.
    late = rollout_args(store_url, tiny, rollout_batch_size=1, stoa_check_publishing=True, stoa_background_publish=False, stoa_publish_grace_s=60)
    task = asyncio.ensure_future(call(2, late))
    await async_wait_until(lambda: logged(caplog, "for the trainer to publish v2"), message="the grace wait")
    await publisher.publish(bumped(state, 2))
    assert (await asyncio.wait_for(task, 60)).metrics["rollout/stoa_trainer_version"] == 2
    # Opted out (train_async.py), or a debug mode in which slime publishes nothing: no check.
    off = rollout_args(store_url, tiny, rollout_batch_size=1, stoa_check_publishing=False)
    assert (await call(3, off)).metrics["rollout/stoa_trainer_version"] == 2
    assert (await call(4, off)).metrics["rollout/stoa_trainer_version"] == 2
    debug = rollout_args(
        store_url, tiny, rollout_batch_size=1, stoa_check_publishing=True, stoa_background_publish=False, stoa_publish_grace_s=0.3,
        debug_rollout_only=True,
    )  # fmt: skip
    assert (await call(5, debug)).metrics["rollout/stoa_trainer_version"] == 2
    assert (await call(6, debug)).metrics["rollout/stoa_trainer_version"] == 2
    assert logged(caplog, "--debug-rollout-only is set")

async def test_with_background_publishing_the_last_steps_version_may_still_be_uploading(
    store: Store, store_url: str, tiny: Any, creds: dict, slime: None
) -> None:
    """A hand-off waits for the previous publish, so at each rollout the version of the step before
    the last has committed: the check allows one version in flight and catches a stall one call later."""
    await setup_run(store, tiny, staleness=8, published=None)
    publisher = Publisher(store, RUN, PublisherConfig(extras_dir=tiny.folder, catchup=False))
    state = load_hf_state(tiny.folder)
    await publisher.publish(state)  # v0
    await upload_groups(store, tiny, 8, state_digest=publisher.state_digest)
    args = rollout_args(store_url, tiny, rollout_batch_size=1, stoa_check_publishing=True, stoa_publish_grace_s=0.3)
    source = StoaDataSource(args)

    def call(rollout_id: int) -> Any:
        return asyncio.to_thread(rollout.generate_rollout, args, rollout_id, source)

    assert (await call(0)).metrics["rollout/stoa_trainer_version"] == 0
    assert (await call(1)).metrics["rollout/stoa_trainer_version"] == 0  # step 0's version still uploading
    await publisher.publish(bumped(state, 1))  # step 0's version lands while step 1 trains
    assert (await call(2)).metrics["rollout/stoa_trainer_version"] == 1
    assert (await call(3)).metrics["rollout/stoa_trainer_version"] == 1  # step 1's (v2) may be in flight
    with pytest.raises(rollout.PublishingStalled) as info:  # two steps later, still v1: nothing publishes
        await call(4)
    assert "stoa_publish_grace_s" in str(info.value)


# -- (c2) a trainer restarted from an earlier checkpoint --------------------------------------------------
async def test_a_trainer_restarted_from_an_earlier_checkpoint_follows_the_new_lineage(
    store: Store, store_url: str, tiny: Any, creds: dict, slime: None, tmp_path: Path
) -> None:
    """Through the real rollout function and data source: the trainer trained v1 and v2, crashed,
    and restarted from the checkpoint of v1 (its first publish is v3 = v1's weights, a restore:
    v2 abandoned). Groups of the abandoned v2 are dropped as off the lineage, groups of v1 are as
    fresh as v3's (the same weights), and nothing used before the crash is used again."""
    from tests.test_consumer import digest_of, publish_versions
    from tests.test_lineage import restart_from

    await setup_run(store, tiny, staleness=2, published=0)
    first = await upload_groups(store, tiny, 2)  # made at v0
    args = rollout_args(store_url, tiny, rollout_batch_size=2, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"))
    source = StoaDataSource(args)
    out = await asyncio.to_thread(rollout.generate_rollout, args, 0, source)
    assert sorted(keys_of(out)) == sorted(first)
    await publish_versions(store, 2)  # the trainer went on: v1, v2
    on_v1 = await upload_groups(store, tiny, 2, first_seq=2, weight_version=1, state_digest=digest_of(1))
    on_v2 = await upload_groups(store, tiny, 2, first_seq=4, weight_version=2, state_digest=digest_of(2))
    await close_session()  # the trainer process is gone

    await restart_from(store, 1)  # restarted from v1's checkpoint: v3 = v1's weights, epoch 1
    on_v3 = await upload_groups(store, tiny, 2, first_seq=6, weight_version=3, state_digest=digest_of(1))
    source = StoaDataSource(args)
    source.load(0)
    used = []
    for rollout_id in (1, 2):
        out = await asyncio.to_thread(rollout.generate_rollout, args, rollout_id, source)
        assert out.metrics["rollout/stoa_trainer_version"] == 3
        assert out.metrics["rollout/stoa_version_lag_max"] == 0  # v1 and v3: the same weights, no step apart
        used += keys_of(out)
    assert sorted(used) == sorted(on_v1 + on_v3) and not set(used) & set(on_v2)  # none of v2's, none used twice
    state = json.loads(state_path(tmp_path / "ckpt").read_text())["consumer"]
    assert state["counters"]["off_lineage"] == 2 and state["counters"]["groups_used"] == 6


# -- (d) SIGKILL and restart ---------------------------------------------------------------------------------
class Child:
    """`python -m tests.slime_standins`: slime's train loop around the real rollout function."""

    def __init__(self, tmp_path: Path, args: dict[str, Any], env: dict[str, str], *, start: int, num_rollout: int) -> None:
        config = tmp_path / f"child-{uuid.uuid4().hex[:8]}.json"
        config.write_text(json.dumps({"args": args, "start_rollout_id": start, "num_rollout": num_rollout}))
        self.batches: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.slime_standins", str(config)],
            cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: Any, batches: bool) -> None:
        for line in stream:
            if batches:
                self.batches.append(json.loads(line))
            else:
                self.log.append(line.rstrip("\n"))

    @property
    def keys(self) -> list[str]:
        return [k for b in list(self.batches) for k in b["keys"]]

    def idle(self) -> bool:
        """It waits for a batch with nothing ready, downloading or queued: everything it could
        discover is used."""
        return any("have 0 of 2 ready, 0 downloading, 0 queued" in line for line in list(self.log))

    def wait_for(self, what: str, predicate: Any) -> None:
        wait_until(
            lambda: predicate() or self.proc.poll() is not None,
            timeout=60,
            message=lambda: f"{what} (stderr tail: {self.log[-5:]})",
        )
        assert self.proc.poll() is None, f"the child exited ({self.proc.returncode}) before {what}: {self.log[-20:]}"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL
        self.proc.wait(30)
        for t in self._readers:
            t.join(30)


def child_args(url: str, tiny: Any, ckpt: Path, **settings: Any) -> dict[str, Any]:
    args = vars(rollout_args(url, tiny, save=str(ckpt), load=str(ckpt), stoa_prefetch_groups=2))
    return {**args, **settings}


async def test_a_killed_trainer_resumes_with_no_group_used_twice_or_skipped(
    store: Store, store_url: str, tiny: Any, creds: dict, tmp_path: Path
) -> None:
    await setup_run(store, tiny)
    keys = await upload_groups(store, tiny, 6)
    ckpt = tmp_path / "ckpt"
    args = child_args(store_url, tiny, ckpt)
    first = Child(tmp_path, args, creds, start=0, num_rollout=100)
    try:
        await asyncio.to_thread(first.wait_for, "3 batches, then an idle wait", lambda: len(first.batches) == 3 and first.idle())
    finally:
        first.kill()  # SIGKILL while it waits for its fourth batch
    saved = json.loads(state_path(ckpt).read_text())
    assert saved["consumer"]["counters"]["groups_used"] == 6 and saved["sample_group_index"] == 6
    keys += await upload_groups(store, tiny, 6, first_seq=6)  # the fleet keeps going meanwhile
    second = Child(tmp_path, args, creds, start=3, num_rollout=6)  # slime resumes at the next rollout
    await asyncio.to_thread(second.proc.wait, 60)
    second.kill()
    assert second.proc.returncode == 0, second.log[-20:]
    used = first.keys + second.keys
    assert sorted(used) == sorted(keys)  # every group exactly once: none twice, none skipped
    assert [b["group_index"][0] for b in second.batches] == [6, 8, 10]  # ids continue from the file
    assert second.batches[0]["index"][0] == 6 * G
    bucket, _ = await read_state(store, RUN)
    assert bucket is not None and bucket.counters["groups_used"] == 12


async def test_a_trainer_killed_at_a_random_moment_loses_at_most_the_batch_in_hand(
    store: Store, store_url: str, tiny: Any, creds: dict, tmp_path: Path
) -> None:
    seed = random_seed()
    await setup_run(store, tiny)
    keys = await upload_groups(store, tiny, 16)
    ckpt = tmp_path / "ckpt"
    args = child_args(store_url, tiny, ckpt)
    first = Child(tmp_path, args, creds, start=0, num_rollout=100)
    batches = random.Random(seed).randint(1, 4)
    try:
        await asyncio.to_thread(first.wait_for, f"{batches} batches", lambda: len(first.batches) >= batches)
    finally:
        first.kill()  # somewhere in the middle of consuming, at a moment the seed picks
    saved = json.loads(state_path(ckpt).read_text())["consumer"]  # always whole: written atomically
    second = Child(tmp_path, args, creds, start=len(first.batches), num_rollout=100)
    try:
        await asyncio.to_thread(second.wait_for, "every group used", second.idle)
    finally:
        second.kill()
    assert not set(first.keys) & set(second.keys), f"seed {seed}: a group used twice"
    assert len(first.keys) == len(set(first.keys)) and len(second.keys) == len(set(second.keys)), f"seed {seed}"
    missing = set(keys) - set(first.keys) - set(second.keys)
    # The only groups neither process trained: the batch handed out in the instant between its
    # state being persisted and slime receiving it (the same loss as a kill during training).
    assert len(missing) <= 2, f"seed {seed}: {len(missing)} groups skipped"
    prefix = RunLayout(RUN).rollouts_prefix("train")
    open_names = set(saved["ledger"]) | {name for name, _ in saved["pending"]}
    for key in missing:
        name = key[len(prefix) :]
        assert name not in open_names and name <= saved["cursor"], f"seed {seed}: {key} skipped, not handed out"


# -- the data source -----------------------------------------------------------------------------------------
def test_the_data_source_hands_out_ids_and_keeps_the_state_next_to_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import slime_stoa

    for name, module in slime_standins.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    assert slime_stoa.StoaDataSource is StoaDataSource
    args = types.SimpleNamespace(n_samples_per_prompt=3, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"))
    source = StoaDataSource(args)
    groups = source.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [g[0].group_index for g in groups] == [0, 1] and len(source) == 0
    with pytest.raises(RuntimeError, match="stoa bucket"):
        source.add_samples(groups)
    assert source.consumer_state(RUN) is None  # nothing saved yet
    state = {"run": RUN, "counters": {"groups_used": 2}}
    path = source.commit(state)
    assert path == tmp_path / "ckpt" / "rollout" / STATE_FILE
    source.save(7)
    again = StoaDataSource(args)
    again.load(7)
    assert again.consumer_state(RUN) == state and (again.sample_group_index, again.sample_index) == (2, 6)
    with caplog.at_level(logging.WARNING):
        assert StoaDataSource(args).consumer_state("other-run") is None
    assert logged(caplog, "not 'other-run'")
    assert StoaDataSource(types.SimpleNamespace(n_samples_per_prompt=1, save=None, load=None)).commit(state) is None
    path.write_text("{not json")
    with pytest.raises(ValueError, match="move it away"):
        StoaDataSource(args).load(7)


async def test_slimes_default_data_source_keeps_the_metadata_path_and_says_so(
    store: Store, store_url: str, tiny: Any, slime: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="slime_stoa")
    await setup_run(store, tiny)
    keys = await upload_groups(store, tiny, 2)

    class DefaultSource:  # slime's RolloutDataSourceWithBuffer without --prompt-data
        def __init__(self) -> None:
            self.metadata: dict[str, Any] = {}
            self.index = 0

        def get_samples(self, n: int) -> list[list[Any]]:
            out = [[slime_standins.Sample(group_index=i, index=self.index + i * G + j) for j in range(G)] for i in range(n)]
            self.index += n * G
            return out

    source = DefaultSource()
    args = rollout_args(store_url, tiny)
    out = await asyncio.to_thread(rollout.generate_rollout, args, 0, source)
    assert sorted(keys_of(out)) == sorted(keys)
    assert source.metadata[rollout.METADATA_KEY]["counters"]["groups_used"] == 2
    assert logged(caplog, "--data-source-path slime_stoa.StoaDataSource")
