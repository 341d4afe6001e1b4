"""The quickstart learner's checkpoints (`slime_stoa.quickstart.checkpoints`): one per version,
the newest few kept, read back whole; and which versions a restart may restore (those on the
pointer's weight lineage, with the checkpoint's digest), against both store backends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.store import Store
from slime_stoa.quickstart.checkpoints import (
    KEEP,
    Checkpoint,
    check_restorable,
    checkpoint_path,
    checkpoint_versions,
    load_checkpoint,
    save_checkpoint,
)
from slime_stoa.quickstart.config import QuickstartError
from tests.test_pulse_sync import random_state, step_state

RUN = "ckpt"


def learner_state(version: int) -> tuple[dict, dict]:
    model = {"w": torch.full((3, 2), float(version)), "b": torch.arange(4, dtype=torch.float32) + version}
    optimizer = {"state": {0: {"step": torch.tensor(float(version)), "exp_avg": torch.ones(3) * version}},
                 "param_groups": [{"lr": 3e-4, "params": [0]}]}  # fmt: skip
    return model, optimizer


def save(folder: Path, version: int, consumer: dict | None, *, run: str = RUN) -> Path:
    model, optimizer = learner_state(version)
    return save_checkpoint(
        folder, run=run, version=version, state_digest=f"{version:064x}", model=model, optimizer=optimizer,
        consumer=consumer,
    )  # fmt: skip


def test_a_checkpoint_per_version_the_newest_kept_and_read_back_whole(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    assert checkpoint_versions(folder) == []
    save(folder, 0, None)
    for v in range(1, 7):
        save(folder, v, {"run": RUN, "cursor": f"key-{v}", "ledger": {f"g{v}": 1}})
    assert checkpoint_versions(folder) == list(range(7 - KEEP, 7))
    assert not checkpoint_path(folder, 0).exists()

    got = load_checkpoint(folder, 5, run=RUN)
    model, optimizer = learner_state(5)
    assert (got.version, got.state_digest, got.run) == (5, f"{5:064x}", RUN)
    assert got.consumer == {"run": RUN, "cursor": "key-5", "ledger": {"g5": 1}}
    assert got.model.keys() == model.keys() and all(torch.equal(got.model[k], model[k]) for k in model)
    assert torch.equal(got.optimizer["state"][0]["exp_avg"], optimizer["state"][0]["exp_avg"])
    assert got.optimizer["param_groups"] == optimizer["param_groups"]

    save(folder, 9, None, run=RUN)  # before any batch: no consumer state
    assert load_checkpoint(folder, 9, run=RUN).consumer is None


def test_a_checkpoint_that_is_gone_foreign_or_damaged_is_refused_with_what_there_is(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    for v in (3, 4):
        save(folder, v, None)
    with pytest.raises(QuickstartError, match=r"no checkpoint .*v2\.pt \(checkpoints kept: v3, v4\)"):
        load_checkpoint(folder, 2, run=RUN)
    with pytest.raises(QuickstartError, match="checkpoints kept: none"):
        load_checkpoint(tmp_path / "elsewhere", 2, run=RUN)
    with pytest.raises(QuickstartError, match="of run 'ckpt', not of v4 of run 'other'"):
        load_checkpoint(folder, 4, run="other")
    checkpoint_path(folder, 4).write_bytes(b"not a checkpoint")
    with pytest.raises(QuickstartError, match="cannot read"):
        load_checkpoint(folder, 4, run=RUN)
    torch.save({"format": "something/1"}, checkpoint_path(folder, 3))
    with pytest.raises(QuickstartError, match=r"is not a stoa\.quickstart-checkpoint/1 file"):
        load_checkpoint(folder, 3, run=RUN)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(folder, run=RUN, version=5, state_digest="", model={}, optimizer={}, consumer=None, keep=0)


def checkpoint(version: int, digest: str) -> Checkpoint:
    return Checkpoint(run=RUN, version=version, state_digest=digest, model={}, optimizer={}, consumer=None)


async def test_only_a_version_on_the_pointers_lineage_can_be_restored(store: Store) -> None:
    rng = np.random.default_rng(5)
    states = [random_state(rng)]
    for _ in range(5):
        states.append(step_state(states[-1], rng))
    pub = Publisher(store, RUN, PublisherConfig(anchor_every=100))
    digests = []
    for s in states:
        await pub.publish(s)
        assert pub.state_digest is not None
        digests.append(pub.state_digest)
    for v in (0, 2, 5):
        await check_restorable(store, RUN, checkpoint(v, digests[v]), head=5, trust=None)
    with pytest.raises(QuickstartError, match="is not the one v3 published"):
        await check_restorable(store, RUN, checkpoint(3, digests[2]), head=5, trust=None)
    with pytest.raises(QuickstartError, match="is at v5"):
        await check_restorable(store, RUN, checkpoint(6, digests[5]), head=5, trust=None)

    restarted = Publisher(store, RUN, PublisherConfig(anchor_every=100))  # restarted from v2's checkpoint
    assert await restarted.open() == 5
    assert (await restarted.publish({n: b.copy() for n, b in states[2].items()})).restored_from == 2
    await restarted.publish(step_state(states[2], rng))  # v7, on the new branch
    assert restarted.state_digest is not None
    for v, digest in ((0, digests[0]), (1, digests[1]), (2, digests[2]), (6, digests[2]), (7, restarted.state_digest)):
        await check_restorable(store, RUN, checkpoint(v, digest), head=7, trust=None)
    for v in (3, 4, 5):  # the branch the restart abandoned
        with pytest.raises(QuickstartError, match="an earlier restart abandoned it"):
            await check_restorable(store, RUN, checkpoint(v, digests[v]), head=7, trust=None)


async def test_a_new_run_has_nothing_to_restart_from(tmp_path: Path) -> None:
    from slime_stoa.quickstart.config import QuickstartConfig
    from slime_stoa.quickstart.run import run_quickstart

    class Notes:
        def note(self, text: str) -> None:
            pass

    with pytest.raises(QuickstartError, match="--restart-from 3: run 'fresh' is new, there is nothing to restart"):
        await run_quickstart(QuickstartConfig(out=tmp_path / "out", run="fresh", restart_from=3), Notes())
    assert not (tmp_path / "out" / "model").exists()  # refused before any slow work
