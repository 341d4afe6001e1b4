"""A bucket writer deletes or spoils an object of the live weight chain (a patch, a version
manifest, an anchor shard) under a live publisher: after one keeper round the object is back byte
for byte, or the next version is a fresh anchor, and a worker joining then reaches the head bit
for bit (`pulse.chain_keeper`, `pulse.kept_chain`).

The writer attacks at the end (`ATTACKS`) are also counted by the security report
(`writer_stops_trainer`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.chain import ChainPublisher
from slime_stoa.protocol.pulse.chain_keeper import keep_chains, kept_publisher_store, live_keys, publisher_chains
from slime_stoa.protocol.pulse.keepalive import PointerKeeper
from slime_stoa.protocol.pulse.kept_chain import KeptChainStore, kept_chain_store
from slime_stoa.protocol.pulse.manifests import Pointer, VersionManifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig, UntrustedState
from slime_stoa.protocol.pulse.restore import version_ref
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.pulse.sync_result import SyncError
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import NotFound, Store
from tests.test_trust_writer import Attack, Outcome

RUN = "kept-chain"
LAYOUT = RunLayout(RUN)
State = dict[str, np.ndarray]


def states(count: int, first: State | None = None, *, changed: int = 5, seed: int = 7) -> list[State]:
    """`first` (default: random bits) and `count - 1` steps, each flipping the low bit of `changed`
    elements per tensor (sparse, as RL steps are)."""
    rng = np.random.default_rng(seed)
    if first is None:
        first = {"a": rng.integers(0, 1 << 15, (16, 16), dtype=np.uint16), "b": rng.integers(0, 1 << 15, (64,), dtype=np.uint16)}
    out = [first]
    for _ in range(count - 1):
        step = {name: bits.copy() for name, bits in out[-1].items()}
        for bits in step.values():
            flat = bits.reshape(-1)
            flat[rng.choice(flat.size, changed, replace=False)] ^= 1
        out.append(step)
    return out


class Live:
    """A signed run's live publisher, its store wrapped as a publishing process wraps it."""

    def __init__(self, store: Store, keep: Path, *, anchor_every: int = 50, key: SigningKey | None = None) -> None:
        self.key = key or SigningKey.generate()
        self.keep = keep
        wrapped = kept_chain_store(store, RUN, keep)
        assert isinstance(wrapped, KeptChainStore)
        self.store = wrapped
        config = PublisherConfig(catchup=False, keep_dir=keep, anchor_every=anchor_every, retain_anchors=0)
        self.pub = Publisher(self.store, RUN, config, key=self.key)

    @property
    def head(self) -> VersionManifest:
        assert self.pub.weights.head is not None
        return self.pub.weights.head

    async def publish(self, chain: list[State]) -> None:
        at = await self.pub.open()
        for v in range(0 if at is None else at + 1, len(chain)):
            assert (await self.pub.publish(chain[v])).version == v

    async def round(self) -> Any:
        """One keeper round on the publisher's chains (what `PointerKeeper` runs)."""
        [check] = await keep_chains(publisher_chains(self.pub))
        return check

    def trust(self) -> RunTrust:
        return RunTrust(RUN, self.key.public)


def version_of(key: str) -> int:
    parsed = LAYOUT.weight_object_version(key)
    assert parsed is not None, key
    return parsed[0]


def versions(keys: Iterable[str]) -> set[int]:
    return {version_of(k) for k in keys}


def manifest_of(store: KeptChainStore, version: int) -> VersionManifest:
    """The kept copy of the manifest of `version` this process wrote (one attempt each here)."""
    [key] = [k for k in store.written if LAYOUT.parse_version_manifest(k) is not None and version_of(k) == version]
    data = store.copies.kept(key)
    assert data is not None
    return VersionManifest.from_bytes(data, key, key=key)


async def joins(store: Store, live: Live, want: State, version: int) -> bool:
    """Whether a worker joining now reaches `version` with exactly `want`."""
    sub = Subscriber(store, RUN, trust=live.trust())
    try:
        got = await sub.sync()
    except SyncError:  # no path reaches the head (WeightsRefused: one was spoiled)
        return False
    return (
        got is not None and got.version == version and sub.state is not None and sub.state.keys() == want.keys()
        and all(np.array_equal(sub.state[n], want[n]) and sub.state[n].dtype == want[n].dtype for n in want)
    )


async def gone(store: Store, key: str) -> bool:
    try:
        await store.head(key)
    except NotFound:
        return True
    return False


@pytest.mark.both_backends
async def test_a_deleted_patch_is_put_back_and_a_worker_joins(store: Store, tmp_path: Path) -> None:
    chain = states(4)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain)
    [patch] = manifest_of(live.store, 2).patches
    genuine = await store.get_bytes(patch.key)
    await store.delete(patch.key)
    assert not await joins(store, live, chain[3], 3)  # the chain from the anchor v0 is broken
    check = await live.round()
    assert check.put_back == [patch.key] and check.lost == [] and not check.anchor_forced
    assert await store.get_bytes(patch.key) == genuine
    assert await joins(store, live, chain[3], 3)
    assert (await live.round()).put_back == []  # as written now: nothing more to do


@pytest.mark.both_backends
async def test_an_overwritten_version_manifest_is_put_back_and_a_worker_joins(store: Store, tmp_path: Path) -> None:
    chain = states(4)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain)
    key = LAYOUT.version_manifest(2, manifest_of(live.store, 2).attempt)
    genuine = await store.get_bytes(key)
    await store.put(key, bytes(len(genuine)))  # same size: only the ETag tells
    assert not await joins(store, live, chain[3], 3)
    check = await live.round()
    assert check.put_back == [key] and not check.anchor_forced
    assert await store.get_bytes(key) == genuine
    assert await joins(store, live, chain[3], 3)


@pytest.mark.both_backends
async def test_a_deleted_anchor_shard_makes_the_next_version_an_anchor(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="stoa.pulse")
    chain = states(5)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain[:4])
    anchor = live.head.anchor
    shards = [k for k in live.store.written if k.startswith(anchor.manifest.rsplit("/", 1)[0]) and k != anchor.manifest]
    assert shards
    await store.delete(shards[0])
    assert not await joins(store, live, chain[3], 3)
    check = await live.round()
    assert check.lost == [shards[0]] and check.anchor_forced and check.put_back == []
    assert (await live.round()).anchor_forced is False  # reported once, still forced
    lines = [r.getMessage() for r in caplog.records if "fresh anchor" in r.getMessage()]
    assert len(lines) == 1 and RUN in lines[0] and shards[0] in lines[0]
    result = await live.pub.publish(chain[4])
    assert result.version == 4 and result.anchored
    assert await joins(store, live, chain[4], 4)
    check = await live.round()
    assert check.lost == [] and not check.anchor_forced
    assert versions(live.store.kept_keys(LAYOUT)) == {4}  # the copies before the new anchor are gone


@pytest.mark.both_backends
async def test_a_deleted_anchor_manifest_is_put_back(store: Store, tmp_path: Path) -> None:
    chain = states(3)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain)
    key = live.head.anchor.manifest
    genuine = await store.get_bytes(key)
    await store.delete(key)
    check = await live.round()
    assert check.put_back == [key] and not check.anchor_forced
    assert await store.get_bytes(key) == genuine
    assert await joins(store, live, chain[2], 2)


@pytest.mark.both_backends
async def test_objects_spoiled_while_the_trainer_is_down_are_put_back_before_it_opens(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A patch deleted and a manifest overwritten while no publisher runs: a publisher opening on
    the bare store cannot resume (it reads the chain back); one opening on `kept_publisher_store`
    finds both by HEAD against its saved notes (no download), puts them back and resumes."""
    chain = states(5)
    first = Live(store, tmp_path / "kept")
    await first.publish(chain[:4])
    await first.round()  # saves the notes
    [patch] = manifest_of(first.store, 2).patches
    manifest = LAYOUT.version_manifest(3, manifest_of(first.store, 3).attempt)
    genuine = {key: await store.get_bytes(key) for key in (patch.key, manifest)}
    await store.delete(patch.key)
    await store.put(manifest, bytes(len(genuine[manifest])))
    with pytest.raises((SyncError, UntrustedState)):  # what stopped a restarted trainer
        await Publisher(store, RUN, PublisherConfig(catchup=False), key=first.key).open()
    gets = []
    real_get = store.get

    async def counted(key: str, **kw: Any) -> Any:
        gets.append(key)
        return await real_get(key, **kw)

    monkeypatch.setattr(store, "get", counted)
    wrapped = await kept_publisher_store(store, RUN, tmp_path / "kept")
    assert isinstance(wrapped, KeptChainStore) and gets == []
    monkeypatch.undo()
    assert {key: await store.get_bytes(key) for key in genuine} == genuine
    again = Live(store, tmp_path / "kept", key=first.key)  # a fresh process on the same folder
    await again.publish(chain)
    assert await joins(store, again, chain[4], 4)


async def test_without_readable_notes_spoiled_objects_are_found_by_content(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted publisher whose notes are unreadable checks each small object once by its
    content against the kept copy (a same-size overwrite included), then by HEAD."""
    chain = states(4)
    first = Live(store, tmp_path / "kept")
    await first.publish(chain[:3])
    await first.round()
    first.store.notes_path.write_text("[not notes")
    [patch] = manifest_of(first.store, 2).patches
    genuine = await store.get_bytes(patch.key)
    again = Live(store, tmp_path / "kept", key=first.key)  # same folder, fresh process
    assert again.store.written == {} and any("unreadable notes" in r.getMessage() for r in caplog.records)
    await again.publish(chain[:3])  # resumes at v2
    await store.put(patch.key, bytes(len(genuine)))
    check = await again.round()
    assert check.put_back == [patch.key] and check.lost == []
    assert await store.get_bytes(patch.key) == genuine
    assert (await again.round()).put_back == []  # noted now: by HEAD
    await again.publish(chain)
    assert await joins(store, again, chain[3], 3)


async def test_an_object_the_trainer_holds_no_copy_of_forces_an_anchor(store: Store, tmp_path: Path) -> None:
    chain = states(4)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain[:3])
    [patch] = manifest_of(live.store, 2).patches
    live.store.copies.forget(patch.key)  # e.g. a keep folder restored from an older backup
    await store.delete(patch.key)
    check = await live.round()
    assert check.lost == [patch.key] and check.anchor_forced
    result = await live.pub.publish(chain[3])
    assert result.anchored and await joins(store, live, chain[3], 3)


async def test_a_planes_deleted_patch_is_put_back(store: Store, tmp_path: Path) -> None:
    """A quantized plane's chain is kept as the bf16 one is (its keys under `planes/<plane>/`)."""
    chain = states(3)
    live = Live(store, tmp_path / "kept")
    plane = ChainPublisher(live.store, RUN, live.pub.config, key=live.key, plane="int8")
    await plane.open()
    for v, state in enumerate(chain):  # the plane's bits: any uint16 state will do here
        await live.publish(chain[: v + 1])
        assert (await plane.publish(state, source=version_ref(LAYOUT, live.head))).version == v
    assert plane.head is not None
    [patch] = plane.head.patches
    assert patch.key.startswith(LAYOUT.on_plane("int8").patches_prefix) and live.store.copies.kept(patch.key)
    await store.delete(patch.key)
    [check] = await keep_chains([plane])
    assert check.put_back == [patch.key]
    sub = Subscriber(store, RUN, trust=live.trust(), plane="int8")
    got = await sub.sync()
    assert got is not None and got.version == 2 and sub.state is not None
    assert all(np.array_equal(sub.state[n], chain[2][n]) for n in chain[2])


async def test_copies_before_the_newest_anchor_are_forgotten(store: Store, tmp_path: Path) -> None:
    chain = states(8)
    live = Live(store, tmp_path / "kept", anchor_every=3)
    await live.publish(chain)
    assert live.head.anchor.version == 6
    await live.round()
    assert versions(live.store.kept_keys(LAYOUT)) == {6, 7}
    assert versions(live.store.written) == {6, 7}
    keys = live_keys(LAYOUT, live.head, live.store.copies.kept)
    assert len(keys) == 5  # v7's manifest and step patch, v6's, then the anchor's manifest
    await live.store.delete(keys[1])  # the publisher's own delete (retention): not kept any more
    assert live.store.copies.kept(keys[1]) is None and keys[1] not in live.store.written


async def test_the_pointer_keeper_runs_the_check(store: Store, tmp_path: Path) -> None:
    chain = states(3)
    live = Live(store, tmp_path / "kept")
    await live.publish(chain)
    [patch] = manifest_of(live.store, 1).patches
    await store.delete(patch.key)
    keeper = PointerKeeper.of_publisher(lambda: live.pub, every_s=3600)
    keeper.start()  # its first round at once
    try:
        while keeper.rounds < 1:  # a round counts when it ends, failed or not
            assert keeper.running
            await asyncio.sleep(0.01)
    finally:
        await keeper.stop()
    assert not await gone(store, patch.key) and await joins(store, live, chain[2], 2)


async def test_the_quickstart_publisher_keeps_its_chain(tmp_path: Path) -> None:
    """The quickstart wires it: its seeded publisher's store keeps the chain, its keeper checks it."""
    from slime_stoa.protocol.signing import write_key_file
    from slime_stoa.protocol.store import open_store
    from slime_stoa.quickstart.run import RUN_KEY_FILE, pointer_keeper
    from tests.forged_weights import random_state, step_state
    from tests.test_quickstart_seed_trust import RUN as QS_RUN
    from tests.test_quickstart_seed_trust import existing_run, rerun_seed

    out = tmp_path / "qs"
    out.mkdir()
    key = SigningKey.generate()
    write_key_file(out / RUN_KEY_FILE, key)
    rng = np.random.default_rng(5)
    v0 = random_state(np.random.default_rng(3))  # what `existing_run` publishes
    async with open_store(f"file://{tmp_path / 'bucket'}", create=True) as store:
        await existing_run(store, out, key)
        pub = await rerun_seed(store, out)
        assert isinstance(pub.store, KeptChainStore)
        v1 = step_state(v0, rng)
        await pub.publish(v1)
        assert pub.weights.head is not None
        [patch] = pub.weights.head.patches
        await store.delete(patch.key)
        keeper = pointer_keeper(pub, every_s=3600)
        keeper.start()
        try:
            while keeper.rounds < 1:  # a round counts when it ends, failed or not
                assert keeper.running
                await asyncio.sleep(0.01)
        finally:
            await keeper.stop()
        assert not await gone(store, patch.key)
        await store.delete(patch.key)  # again, and the quickstart stops before a round: its rerun puts it back
        rerun = await rerun_seed(store, out)
        assert rerun.version == 1 and not await gone(store, patch.key)
        sub = Subscriber(store, QS_RUN, trust=RunTrust(QS_RUN, key.public))
        got = await sub.sync()
        assert got is not None and got.version == 1 and sub.state is not None
        assert all(np.array_equal(sub.state[n], v1[n]) for n in v1) and sub.state.keys() == v1.keys()


async def test_without_a_folder_the_store_is_not_wrapped(store: Store) -> None:
    assert kept_chain_store(store, RUN, None) is store


# -- writer attacks counted by the security report -------------------------------------------------
async def _attack(
    store: Store, keep: Path, spoil: Callable[[Store, Live], Awaitable[Any]], versions: int = 4
) -> tuple[bool, bool]:
    """(stopped, restored): `spoil` under a live publisher of `versions - 1` versions, one keeper
    round, the next version published, and a worker joining then."""
    chain = states(versions + 1)
    live = Live(store, keep)
    await live.publish(chain[:versions])
    await spoil(store, live)
    try:
        await live.round()
        await live.pub.publish(chain[versions])
    except Exception:
        return True, False
    return False, await joins(store, live, chain[versions], versions)


async def _delete_patch(store: Store, live: Live) -> None:
    await store.delete(manifest_of(live.store, 2).patches[0].key)


async def _overwrite_manifest(store: Store, live: Live) -> None:
    await store.put(LAYOUT.version_manifest(2, manifest_of(live.store, 2).attempt), b'{"format": "not yours"}')


async def _delete_shard(store: Store, live: Live) -> None:
    anchor = live.head.anchor.manifest
    await store.delete(next(k for k in live.store.written if k.startswith(anchor.rsplit("/", 1)[0]) and k != anchor))


def attack(spoil: Callable[[Store, Live], Awaitable[Any]]) -> Attack:
    """`spoil` as a `test_trust_writer` attack: its Outcome (no records are involved)."""

    async def run(store: Store, url: str, tiny: Any, keep: Path) -> Outcome:
        stopped, restored = await _attack(store, keep, spoil)
        return Outcome(stopped=stopped, honest_rejected=0, restored=restored)

    return run


async def _shard_deleted_while_down(store: Store, url: str, tiny: Any, keep: Path) -> Outcome:
    """An anchor shard (no copy kept: it is large) deleted while no trainer runs: the restarted
    publisher resumes at the signed head and publishes the next version as a fresh anchor."""
    chain = states(5)
    first = Live(store, keep)
    await first.publish(chain[:4])
    await first.round()
    await _delete_shard(store, first)
    try:
        await kept_publisher_store(store, RUN, keep)  # what a restart runs first
        again = Live(store, keep, key=first.key)
        await again.publish(chain)
    except Exception:
        return Outcome(stopped=True, honest_rejected=0, restored=False)
    return Outcome(stopped=False, honest_rejected=0, restored=await joins(store, again, chain[4], 4))


ATTACKS: dict[str, Attack] = {
    "live_patch_deleted": attack(_delete_patch),
    "live_version_manifest_overwritten": attack(_overwrite_manifest),
    "live_anchor_shard_deleted": attack(_delete_shard),
    "anchor_shard_deleted_while_down": _shard_deleted_while_down,
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_no_writer_breaks_the_live_chain(name: str, store: Store, store_url: str, tmp_path: Path) -> None:
    no_records: Any = None  # the `tiny` model the record attacks need: none here
    assert await ATTACKS[name](store, store_url, no_records, tmp_path / "trainer") == Outcome(
        stopped=False, honest_rejected=0, restored=True
    )


async def test_the_slime_publisher_keeps_its_chain(store: Store, store_url: str, store_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """The slime publisher wires it: with a keep_dir its store keeps the chain, and its keeper
    puts back a patch a writer deleted under it; a worker then joins at the head."""
    from slime_stoa.trainer.slime.publish import SyncPublisher
    from tests.conftest import async_wait_until
    from tests.forged_weights import random_state, step_state

    key = SigningKey.generate()
    rng = np.random.default_rng(11)
    config = PublisherConfig(keep_dir=str(tmp_path / "keep"))
    pub = SyncPublisher(store_url, RUN, config, key=key, environ=store_env, refresh_s=0.01, create=True)
    try:
        assert await asyncio.to_thread(pub.open) is None
        state = random_state(rng)
        for _ in range(3):
            await asyncio.to_thread(pub.publish, state)
            state = step_state(state, rng)
        assert pub.last is not None and pub.last.version == 2 and not pub.last.anchored
        pointer = Pointer.from_bytes(await store.get_bytes(LAYOUT.pointer), LAYOUT.pointer, run=RUN,
                                     trust=RunTrust(RUN, key.public))
        manifest = VersionManifest.from_bytes(await store.get_bytes(pointer.manifest), pointer.manifest,
                                              key=pointer.manifest)
        patch = manifest.patches[0]  # the step's patch (catch-ups after it)
        await store.delete(patch.key)
        await async_wait_until(lambda: _present(store, patch.key), timeout=60, message="the patch put back")
        sub = Subscriber(store, RUN, trust=RunTrust(RUN, key.public))
        got = await sub.sync()
        assert got is not None and got.version == 2
    finally:
        await asyncio.to_thread(pub.close)


async def _present(store: Store, key: str) -> bool:
    return not await gone(store, key)
