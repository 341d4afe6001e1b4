"""Single-bucket mode: no write a worker token can make stops the trainer. Each attack below is
one a worker's token can make when the trainer and the workers share one bucket (overwrite or
delete any key of the run); the trainer, given a folder of its own (`keep_dir`), keeps going
(publishes the next version, admits the honest records), puts back the object from its own
copy (`slime_stoa.protocol.kept`), loses nothing honest, and keeps a revoked worker revoked.

Each attack is a coroutine returning an `Outcome`; the security report (`STOA_SECURITY_JSON`)
runs them too and counts `writer_stops_trainer` and `honest_rejected_for_missing_object`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from slime_stoa.cli.keys_cmd import rotate_in
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.registry import revoke_worker, update_registry
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import rotation_document
from slime_stoa.protocol.signing import SigningKey, canonical_json
from slime_stoa.protocol.store import NotFound, Store
from slime_stoa.trainer.consumer import ConsumerTimeout, RolloutConsumer
from slime_stoa.trainer.consumer.heads import heads_prefix
from slime_stoa.trainer.consumer.metrics import reject_counter
from slime_stoa.trainer.consumer.persistence import parse_state, state_key
from tests.test_consumer import RUN, Tiny, make_group, now_ms, tiny, weights
from tests.test_signed_records import SignedRun, open_signed_consumer, put, setup_signed_run, signed

__all__ = ["tiny"]  # the session fixture

GARBAGE = b'{"format": "not what you think"}'


@dataclass
class Outcome:
    stopped: bool  # the trainer raised (or would not start) on the writer's move
    honest_rejected: int  # honest records rejected (a missing object made them look bad)
    restored: bool  # the object is back in the bucket as the trainer wrote it
    revoked_admitted: int = 0  # records of a revoked worker admitted


async def consumer(store: Store, url: str, tiny: Tiny, run: SignedRun, keep: Path) -> RolloutConsumer:
    c = await open_signed_consumer(store, tiny, url, run, state_key=run.run_key, wait_timeout_s=3.0, keep_dir=str(keep))
    await c.load_from_bucket()  # a restarted trainer resumes from its saved state
    return c


async def records(store: Store, tiny: Tiny, run: SignedRun, worker: str, seqs: range, base: int) -> None:
    for seq in seqs:
        group = make_group(tiny, worker=worker, seq=seq, prompt_index=seq % 8)
        await put(store, signed(group, run.workers[worker]), worker, seq, base + seq)


def honest_rejects(c: RolloutConsumer) -> int:
    return sum(n for name, n in c.counters.items() if name.startswith("rejected/") and "/" not in name[len("rejected/"):])


async def batches(c: RolloutConsumer, groups: int) -> list[str]:
    """The workers of `groups` groups, in batches of two."""
    out = []
    for _ in range(groups // 2):
        out += [g.group.worker_id for g in (await c.next_batch(2, trainer_version=0)).groups]
    return out


async def stopped(step: Awaitable[Any]) -> bool:
    try:
        await step
    except Exception:
        return True
    return False


# -- the consumer's objects ------------------------------------------------------------------------
async def state_overwritten(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """Garbage over consumer.json, under a live trainer's save and again before its restart."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    base = now_ms() - 20_000
    await records(store, tiny, run, "mac-a", range(8), base)
    live = await consumer(store, url, tiny, run, keep)
    assert await batches(live, 4) == ["mac-a"] * 4
    await live.save_state()
    await store.put(state_key(RUN), GARBAGE)
    halted = await stopped(live.save_state())  # was StateConflict
    mine = live.state_dict()
    await live.close()
    await store.put(state_key(RUN), GARBAGE)
    again = await consumer(store, url, tiny, run, keep)  # was UntrustedState
    try:
        resumed = again.state_dict()
        used = await batches(again, 4)  # the other four, none consumed twice
        back = parse_state(await store.get_bytes(state_key(RUN)), RUN, [run.run_key.public])
        return Outcome(
            stopped=halted or resumed["cursor"] != mine["cursor"] or used != ["mac-a"] * 4,
            honest_rejected=honest_rejects(again), restored=back.seq == resumed["seq"],
        )
    finally:
        await again.close()


async def registry_deleted(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """registry.json deleted before a restart: the honest records that follow are admitted."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    registry = RunLayout(RUN).registry
    genuine = await store.get_bytes(registry)
    base = now_ms() - 20_000
    await records(store, tiny, run, "mac-a", range(2), base)
    first = await consumer(store, url, tiny, run, keep)
    await batches(first, 2)
    await first.save_state()
    await first.close()
    await store.delete(registry)
    await records(store, tiny, run, "mac-a", range(2, 6), base)
    again = await consumer(store, url, tiny, run, keep)
    try:
        halted = await stopped(batches(again, 4))
        return Outcome(
            stopped=halted, honest_rejected=honest_rejects(again), restored=await store.get_bytes(registry) == genuine,
        )
    finally:
        await again.close()


async def heads_deleted_old_registry(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """The consumer's heads (and state) deleted and the registry from before mac-b's revocation
    put back before a restart: mac-b stays revoked, mac-a's records are admitted."""
    run = await setup_signed_run(store, tiny, workers=("mac-a", "mac-b"))
    registry = RunLayout(RUN).registry
    before = await store.get_bytes(registry)
    await update_registry(store, RUN, run.run_key, functools.partial(revoke_worker, worker="mac-b", now=3.0))
    revoking = await store.get_bytes(registry)
    base = now_ms() - 20_000
    await records(store, tiny, run, "mac-a", range(2), base)
    first = await consumer(store, url, tiny, run, keep)
    await batches(first, 2)
    await first.save_state()
    await first.close()
    async for info in store.list(heads_prefix(RUN)):
        await store.delete(info.key)
    await store.delete(state_key(RUN))
    await store.put(registry, before)
    await records(store, tiny, run, "mac-b", range(6), base + 100)
    await records(store, tiny, run, "mac-a", range(2, 6), base + 200)
    again = await consumer(store, url, tiny, run, keep)
    try:
        used = await batches(again, 4)
        heads = [i.key async for i in store.list(heads_prefix(RUN))]
        return Outcome(
            stopped=used.count("mac-a") != 4, honest_rejected=again.counters.get(reject_counter("unknown_key"), 0),
            restored=await store.get_bytes(registry) == revoking and bool(heads),
            revoked_admitted=used.count("mac-b"),
        )
    finally:
        await again.close()


async def run_manifest_deleted(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """run.json deleted before a restart: the trainer starts and puts it back."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    manifest = RunLayout(RUN).run_manifest
    genuine = await store.get_bytes(manifest)
    first = await consumer(store, url, tiny, run, keep)
    await first.close()
    await store.delete(manifest)
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    try:
        again = await consumer(store, url, tiny, run, keep)
    except Exception:
        return Outcome(stopped=True, honest_rejected=0, restored=False)
    try:
        halted = await stopped(batches(again, 2))
        return Outcome(stopped=halted, honest_rejected=honest_rejects(again), restored=await store.get_bytes(manifest) == genuine)
    finally:
        await again.close()


# -- the publisher's objects -----------------------------------------------------------------------
def publisher(store: Store, run: SignedRun, keep: Path) -> Publisher:
    return Publisher(store, RUN, PublisherConfig(catchup=False, keep_dir=keep), key=run.run_key)


async def pointer_overwritten(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """Garbage over current.json under a live publisher, and again before its restart."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    pointer = RunLayout(RUN).pointer
    live = publisher(store, run, keep)
    assert await live.open() == 0
    await live.publish(weights(1))
    await store.put(pointer, GARBAGE)
    halted = await stopped(live.publish(weights(2)))  # was PublishConflict
    committed = await store.get_bytes(pointer)
    await store.put(pointer, GARBAGE)
    restarted = publisher(store, run, keep)
    try:
        at = await restarted.open()  # was UntrustedState
        result = await restarted.publish(weights(3))
    except Exception:
        return Outcome(stopped=True, honest_rejected=0, restored=False)
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)  # drawn from v0
    c = await consumer(store, url, tiny, run, keep)
    try:
        used = await c.next_batch(2, trainer_version=3)
    finally:
        await c.close()
    return Outcome(
        stopped=halted or at != 2 or result.version != 3 or len(used.groups) != 2,
        honest_rejected=honest_rejects(c), restored=committed != GARBAGE and live.version == 2,
    )


async def run_manifest_forged(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """run.json replaced by one naming another run key (signed by it) before a restart: the
    publisher puts back the copy it kept, publishes, and the honest records are admitted."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    manifest = RunLayout(RUN).run_manifest
    genuine = await store.get_bytes(manifest)
    assert await publisher(store, run, keep).open() == 0  # the first read keeps run.json
    forger = SigningKey.generate()
    await store.put(manifest, replace(RunManifest.from_bytes(genuine), run_key=forger.public.to_text()).to_bytes(forger))
    # The open was UntrustedState (not the current key) before the trainer kept its copy.
    return await restarted_carries_on(store, url, tiny, run, keep, lambda: present(store, manifest, genuine))


async def restarted_carries_on(
    store: Store, url: str, tiny: Tiny, run: SignedRun, keep: Path, restored: Callable[[], Awaitable[bool]],
    *, trainer: SignedRun | None = None,
) -> Outcome:
    """After the writer's move, the trainer (`trainer`'s key; default the run's) restarts: its
    publisher opens at v0 and publishes v1 (then `restored()` is judged, before the consumer could
    put anything back itself), and its consumer admits two honest records of mac-a."""
    trainer = trainer or run
    restarted = publisher(store, trainer, keep)
    try:
        at = await restarted.open()
        result = await restarted.publish(weights(1))
    except Exception:
        return Outcome(stopped=True, honest_rejected=0, restored=False)
    back = await restored()
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    c = await consumer(store, url, tiny, trainer, keep)
    try:
        halted = at != 0 or result.version != 1 or await stopped(c.next_batch(2, trainer_version=1))
        return Outcome(stopped=halted, honest_rejected=honest_rejects(c), restored=back)
    finally:
        await c.close()


async def version_manifest_deleted(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """A committed version manifest deleted: the publisher puts it back with its next version, and
    the honest records drawn from that version are admitted."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    pub = publisher(store, run, keep)
    await pub.open()
    await pub.publish(weights(1))
    layout = RunLayout(RUN)
    v1 = [i.key async for i in store.list(layout.version_manifests_prefix(1))]
    genuine = await store.get_bytes(v1[0])
    await store.delete(v1[0])
    halted = await stopped(pub.publish(weights(2)))
    base = now_ms() - 20_000
    for seq in range(2):
        group = make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq, weight_version=1)
        await put(store, signed(group, run.workers["mac-a"]), "mac-a", seq, base + seq)
    c = await consumer(store, url, tiny, run, keep)
    try:
        halted = halted or await stopped(c.next_batch(2, trainer_version=2))
        return Outcome(stopped=halted, honest_rejected=honest_rejects(c), restored=await present(store, v1[0], genuine))
    finally:
        await c.close()


async def rotated_run_rewritten(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """A rotated run (`stoa keys rotate`, the trainer restarted with the new key): run.json and the
    rotation naming the trainer's key replaced by a writer's (its own key first, then a rotation
    from it to the trainer's key, which any key can sign), and the pointer the old key signed put
    back. The restarted trainer puts both back from its copies, publishes, and admits the honest
    records."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    layout = RunLayout(RUN)
    old_pointer = await store.get_bytes(layout.pointer)
    new = SigningKey.generate()
    await rotate_in(store, RUN, run.run_key, new)
    rotated = SignedRun(new, run.workers)
    assert await publisher(store, rotated, keep).open() == 0  # keeps run.json and rotation 1
    genuine = {key: await store.get_bytes(key) for key in (layout.run_manifest, layout.key_rotation(1))}
    forger = SigningKey.generate()
    forged = replace(RunManifest.from_bytes(genuine[layout.run_manifest]), run_key=forger.public.to_text())
    await store.put(layout.run_manifest, forged.to_bytes(forger))
    await store.put(layout.key_rotation(1), canonical_json(rotation_document(RUN, 1, new.public, 10**9, forger)))
    await store.put(layout.pointer, old_pointer)

    async def restored() -> bool:
        return all([await present(store, key, data) for key, data in genuine.items()])

    # The consumer pinned as the slime plugin pins it: the new key.
    return await restarted_carries_on(store, url, tiny, run, keep, restored, trainer=rotated)


async def rotation_junk(store: Store, url: str, tiny: Tiny, keep: Path) -> Outcome:
    """Junk where the run's next key rotation would go: not a document the run key signed, so
    every reader passes it over (a genuine rotation always is one), and nothing it signed is
    lost: the restarted publisher publishes, and the honest records are admitted (the consumer
    reads the rotations for the task manifest and each version manifest)."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await store.put(RunLayout(RUN).key_rotation(1), GARBAGE)

    async def nothing_lost() -> bool:  # the junk is passed over, not replaced: nothing signed was lost
        return True

    return await restarted_carries_on(store, url, tiny, run, keep, nothing_lost)


async def present(store: Store, key: str, data: bytes) -> bool:
    try:
        return await store.get_bytes(key) == data
    except NotFound:
        return False


Attack = Callable[[Store, str, Tiny, Path], Awaitable[Outcome]]
ATTACKS: dict[str, Attack] = {
    "pointer_overwritten": pointer_overwritten,
    "state_overwritten": state_overwritten,
    "registry_deleted": registry_deleted,
    "version_manifest_deleted": version_manifest_deleted,
    "run_manifest_deleted": run_manifest_deleted,
    "run_manifest_forged": run_manifest_forged,
    "heads_deleted_old_registry": heads_deleted_old_registry,
    "rotated_run_rewritten": rotated_run_rewritten,
    "rotation_junk": rotation_junk,
}


@pytest.mark.both_backends
@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_no_writer_stops_the_trainer(name: str, store: Store, store_url: str, tiny: Tiny, tmp_path: Path) -> None:
    outcome = await ATTACKS[name](store, store_url, tiny, tmp_path / "trainer")
    assert outcome == Outcome(stopped=False, honest_rejected=0, restored=True, revoked_admitted=0), name


async def test_without_a_folder_a_deleted_registry_holds_honest_records(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path
) -> None:
    """Without the copies a deleted registry used to refuse every honest record (measured: 2 of
    2); now they are held until it is back (tests/test_missing_objects.py admits them then)."""
    run = await setup_signed_run(store, tiny, workers=("mac-a",))
    await store.delete(RunLayout(RUN).registry)
    await records(store, tiny, run, "mac-a", range(2), now_ms() - 20_000)
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    try:
        with pytest.raises(ConsumerTimeout):  # nothing to train on until the registry is back
            await c.next_batch(2, trainer_version=0)
        assert honest_rejects(c) == 0 and c.counters.get("held", 0) == 2
    finally:
        await c.close()


def test_run_create_says_what_a_worker_token_can_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from slime_stoa.cli import main

    bucket = tmp_path / "bucket"
    bucket.mkdir()
    assert main(["run", "create", "--store", f"file://{bucket}", "--run", RUN, "--model", "m", "--task", "synthetic"]) == 0
    out = capsys.readouterr().out
    assert "single-bucket mode" in out and "ANY key of this run" in out and "keep_dir" in out
