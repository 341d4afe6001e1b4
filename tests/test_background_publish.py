"""Background publishing (`SyncPublisher.submit`, the slime hook's default): the training loop hands
its weights over and goes on; the published version is exactly the state at the hand-off; the
next publish waits for the previous one and reports that wait; failures surface at the next
publish; a crash mid-upload loses nothing, and a restarted publisher resumes."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_pointer
from slime_stoa.protocol.pulse.publisher import PublishConflict, Publisher, PublisherConfig, PublishResult
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.store import open_store
from slime_stoa.trainer.slime import publish as slime_hook
from slime_stoa.trainer.slime.publish import Handoff, SyncPublisher
from tests.conftest import wait_until
from tests.test_slime_hook import (
    FakeBackuper,
    QwenConfig,
    bf16_from_bits,
    fake_slime,  # noqa: F401 - the fixture (pytest finds it by name)
    model_state,
)

REPO = Path(__file__).resolve().parent.parent
RUN = "bg"

# Shared with the child process of the crash tests (exec'd there): the states it publishes.
STATES_SOURCE = '''
import numpy as np

def make_states(n, seed=7):
    rng = np.random.default_rng(seed)
    state = {f"layer.{i}.w": rng.integers(0, 1 << 16, size=(64, 80), dtype=np.uint16) for i in range(6)}
    out = [state]
    for _ in range(n - 1):
        state = {k: v.copy() for k, v in state.items()}
        for bits in state.values():
            flat = bits.reshape(-1)
            flat[rng.random(flat.size) < 0.05] ^= 1
        out.append(state)
    return out
'''
_ns: dict = {}
exec(STATES_SOURCE, _ns)
make_states = _ns["make_states"]


class GatedPublisher(SyncPublisher):
    """A SyncPublisher whose publishes wait for `gate` before they start (before the publisher
    reads the state): what the training loop does meanwhile is what the tests check."""

    def __init__(self, *args, **kwargs) -> None:
        self.gate = threading.Event()
        super().__init__(*args, **kwargs)

    async def _publish(self, state: Mapping[str, np.ndarray]) -> PublishResult:
        await asyncio.to_thread(self.gate.wait)
        return await super()._publish(state)


async def read_version(url: str, version: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
    async with open_store(url) as store:
        rebuilt = await rebuild(store, RUN, version)
        return rebuilt.manifest.version, rebuilt.state


def assert_same(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert np.array_equal(got[name], want[name]), name


@pytest.fixture
def url(tmp_path: Path) -> str:
    (tmp_path / "bucket").mkdir()
    return f"file://{tmp_path / 'bucket'}"


# -- the snapshot ---------------------------------------------------------------------------------
def test_the_published_version_is_the_state_at_the_hand_off(url: str) -> None:
    s0, s1, s2 = make_states(3)
    with GatedPublisher(url, RUN) as pub:
        pub.gate.set()
        pub.submit(s0)
        assert pub.wait() >= 0 and pub.last is not None and pub.last.version == 0
        pub.gate.clear()  # the next publish cannot start before the test lets it

        live = {n: b.copy() for n, b in s1.items()}
        handoff = pub.submit(live)  # copied: the caller may reuse its arrays at once
        assert pub.busy and handoff.wait_s == 0.0 and handoff.previous is pub.last
        for bits in live.values():  # training goes on and updates its weights in place
            bits ^= 0xFFFF
        pub.gate.set()
        pub.wait()
        assert_same(asyncio.run(read_version(url))[1], s1)

        pub.gate.clear()
        handed = {n: b.copy() for n, b in s2.items()}
        pub.submit(handed, copy=False)  # handed over: no copy, and no more writes through it
        with pytest.raises(ValueError, match="read-only"):
            handed["layer.0.w"][0, 0] ^= 1
        pub.gate.set()
        pub.wait()
    version, state = asyncio.run(read_version(url))
    assert version == 2
    assert_same(state, s2)


def test_the_hook_publishes_the_weights_as_they_were_when_it_returned(fake_slime, url: str) -> None:  # noqa: F811
    import torch

    rng = np.random.default_rng(4)
    weights = {n: bf16_from_bits(b) for n, b in model_state(rng).items()}
    actor = Namespace(weights_backuper=FakeBackuper(weights), hf_config=QwenConfig(), model=[object()])
    args = Namespace(stoa_publish=True, stoa_bucket=url, stoa_run=RUN, model_name=None, offload_train=False)
    pub = slime_hook._PUBLISHER = GatedPublisher(url, RUN)  # what get_publisher(args) returns (closed by the fixture)
    pub.gate.set()
    assert isinstance(slime_hook.publish_weights(actor, args), Handoff)
    pub.wait()
    pub.gate.clear()
    before = {"model." + n: t.view(torch.int16).numpy().view(np.uint16).copy() for n, t in weights.items()}
    handoff = slime_hook.publish_weights(actor, args)  # v1, waiting for the gate
    assert isinstance(handoff, Handoff) and handoff.previous is not None and handoff.previous.version == 0
    assert pub.busy
    for tensor in weights.values():  # the optimizer steps on the live tensors right away
        tensor.view(torch.int16).add_(1)
    pub.gate.set()
    pub.wait()
    version, state = asyncio.run(read_version(url))
    assert version == 1
    assert_same(state, before)


# -- the wait -------------------------------------------------------------------------------------
HOLD_S = 0.2


def test_a_publish_waits_for_the_previous_one_and_reports_the_wait(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="slime_stoa.trainer.slime.publish")
    s0, s1, s2, s3 = make_states(4)
    with GatedPublisher(url, RUN) as pub:
        pub.gate.set()
        pub.submit(s0)
        pub.wait()
        pub.gate.clear()
        pub.submit(s1)  # in flight until the gate opens

        def release() -> None:
            # Once the next submit took the version in flight to wait for it, hold it HOLD_S.
            wait_until(lambda: pub._inflight is None, message="the next submit waiting")
            time.sleep(HOLD_S)
            pub.gate.set()

        opener = threading.Thread(target=release)
        opener.start()
        handoff = pub.submit(s2)
        opener.join()
        assert handoff.wait_s >= HOLD_S and handoff.blocked_s >= handoff.wait_s
        assert handoff.previous is not None and handoff.previous.version == 1
        pub.wait()
        idle = pub.submit(s3)  # nothing in flight: no wait
        assert idle.wait_s == 0.0 and idle.previous is not None and idle.previous.version == 2
        pub.wait()
    lines = {int(m[1]): float(m[2]) for m in re.finditer(r"published weights v(\d+) .* wait=([\d.]+)s", caplog.text)}
    assert lines.keys() == {0, 1, 2, 3}
    assert lines[2] >= HOLD_S - 0.05 and lines[3] == 0.0  # logged with one decimal


# -- failures -------------------------------------------------------------------------------------
def test_a_background_failure_is_raised_by_the_next_publish(url: str, caplog: pytest.LogCaptureFixture) -> None:
    s0, s1, s2 = make_states(3)
    with SyncPublisher(url, RUN, retries=0) as pub, SyncPublisher(url, RUN) as rival:
        pub.submit(s0)
        pub.wait()
        assert rival.publish(s1).version == 1  # another trainer takes v1
        pub.submit(s2)  # handed over; it loses the pointer in the background
        with caplog.at_level(logging.ERROR, logger="slime_stoa.trainer.slime.publish"), pytest.raises(PublishConflict):
            pub.submit(s2)  # the next publish raises it (and hands nothing over)
        assert "background publish to run 'bg' failed" in caplog.text
        assert not pub.busy
    assert asyncio.run(read_version(url))[0] == 1


def test_the_hook_raises_a_background_failure_on_the_next_call(fake_slime, url: str) -> None:  # noqa: F811
    rng = np.random.default_rng(5)
    weights = {n: bf16_from_bits(b) for n, b in model_state(rng).items()}
    actor = Namespace(weights_backuper=FakeBackuper(weights), hf_config=QwenConfig(), model=[object()])
    args = Namespace(
        stoa_publish=True, stoa_bucket=url, stoa_run=RUN, model_name=None, offload_train=False, stoa_publish_retries=0,
    )
    slime_hook.publish_weights(actor, args)
    slime_hook._PUBLISHER.wait()  # type: ignore[union-attr]
    with SyncPublisher(url, RUN) as rival:
        rival.publish({"model." + n: b for n, b in model_state(rng).items()})  # another trainer moves the pointer
    assert isinstance(slime_hook.publish_weights(actor, args), Handoff)  # fails in the background
    with pytest.raises(PublishConflict):
        slime_hook.publish_weights(actor, args)


# -- crashes ----------------------------------------------------------------------------------------
CHILD = STATES_SOURCE + '''
import asyncio, sys, time
from slime_stoa.protocol.pulse.publisher import PublisherConfig
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.trainer.slime.publish import SyncPublisher

url, run, mode, marker = sys.argv[1:5]
CONFIG = PublisherConfig(anchor_every=2, shard_bytes=16 << 10, retain_anchors=0)


class StallingStore(Store):
    """The real store, except that the upload chosen by `mode` (for v2) stalls forever."""

    def __init__(self, inner):
        self.inner, self.url = inner, inner.url

    def _stall(self, key, if_match=None):
        if mode == "anchor":
            return "/anchors/000000000002-" in key and "/model-00002-of-" in key
        if mode == "pointer":
            return key.endswith("/current.json") and if_match is not None and self.v2_manifest
        return False

    v2_manifest = False
    first_shard_landed = False

    async def _maybe_stall(self, key, if_match=None):
        if "/versions/000000000002-" in key:
            self.v2_manifest = True
        if self._stall(key, if_match):
            while mode == "anchor" and not self.first_shard_landed:  # some of the anchor is in
                await asyncio.sleep(0.01)
            open(marker, "w").close()
            await asyncio.sleep(3600)

    async def put(self, key, data, *, if_match=None):
        await self._maybe_stall(key, if_match)
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key, data):
        await self._maybe_stall(key)
        etag = await self.inner.put_if_absent(key, data)
        if "/anchors/000000000002-" in key and "/model-00001-of-" in key:
            self.first_shard_landed = True
        return etag

    async def get(self, key, **kw):
        return await self.inner.get(key, **kw)

    async def head(self, key):
        return await self.inner.head(key)

    def list(self, prefix="", *, start_after=None):
        return self.inner.list(prefix, start_after=start_after)

    async def delete(self, key):
        return await self.inner.delete(key)

    async def close(self):
        await self.inner.close()


class Stalling(SyncPublisher):
    async def _open_store(self, environ, create):
        return StallingStore(open_store(self.url))


states = make_states(3)
pub = Stalling(url, run, CONFIG)
for state in states[:2]:
    pub.submit(state)
    pub.wait()
pub.submit(states[2])  # v2 in the background; the training loop goes on
if mode == "exit":
    sys.exit(0)  # no close(): the interpreter's exit must still finish v2
time.sleep(3600)
'''


def run_child(url: str, mode: str, marker: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", CHILD, url, RUN, mode, str(marker)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


CONFIG = PublisherConfig(anchor_every=2, shard_bytes=16 << 10, retain_anchors=0)


@pytest.mark.parametrize("mode", ["anchor", "pointer"])
def test_a_crash_mid_upload_loses_nothing_and_a_new_publisher_resumes(url: str, tmp_path: Path, mode: str) -> None:
    marker = tmp_path / "stalled"
    child = run_child(url, mode, marker)
    try:
        wait_until(lambda: marker.exists() or child.poll() is not None, timeout=60, message="the upload of v2 to stall")
        assert child.poll() is None, child.communicate()[0].decode()
        os.kill(child.pid, signal.SIGKILL)  # the trainer dies mid-upload
    finally:
        child.kill()
        child.communicate()
    states = make_states(3)

    async def resume() -> None:
        async with open_store(url) as store:
            layout = RunLayout(RUN)
            assert (await read_pointer(store, RUN)).version == 1  # nothing of v2 is visible
            written = [info.key async for info in store.list(layout.root)]
            if mode == "anchor":  # some of v2's anchor landed, its manifest did not
                assert any("/anchors/000000000002-" in k for k in written)
                assert not any("/versions/000000000002-" in k for k in written)
            else:  # everything of v2 landed but the pointer
                assert any("/versions/000000000002-" in k for k in written)
            publisher = Publisher(store, RUN, CONFIG)
            assert await publisher.open() == 1  # the restarted trainer resumes from v1
            result = await publisher.publish(states[2])
            assert result.version == 2 and result.restored_from is None
        for version, state in enumerate(states):
            got_version, got = await read_version(url, version)
            assert got_version == version
            assert_same(got, state)

    asyncio.run(resume())


def test_a_version_in_flight_at_exit_is_finished(url: str, tmp_path: Path) -> None:
    child = run_child(url, "exit", tmp_path / "unused")
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, out.decode()
    version, state = asyncio.run(read_version(url))
    assert version == 2
    assert_same(state, make_states(3)[2])

