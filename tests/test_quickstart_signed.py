"""The quickstart's default path is the signed path: a run key, a worker key per worker, a
registry, and only records signed by registered keys in the bucket and in training."""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.registry import read_registry
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.signed_record import open_signed, verify_signed
from slime_stoa.protocol.signing import read_key_file
from slime_stoa.protocol.store import open_store
from slime_stoa.quickstart.config import QuickstartConfig, QuickstartError
from slime_stoa.quickstart.run import (
    RUN_KEY_FILE,
    register_workers,
    run_key_for,
    worker_id,
    worker_key_path,
)
from slime_stoa.trainer.consumer.admission import SIGNATURE_REASONS


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_keys_are_made_once_and_registered_once(tmp_path: Path) -> None:
    cfg = QuickstartConfig(out=tmp_path / "qs", workers=2)
    cfg.out.mkdir()
    async with open_store(cfg.store_url, create=True) as store:
        key = await run_key_for(store, cfg, new_run=True)
        assert key is not None and _mode(cfg.out / RUN_KEY_FILE) == 0o600
        first = await register_workers(store, cfg, key)
        assert sorted(first.workers) == [worker_id(0), worker_id(1)] and first.serial == 2
        assert all(_mode(worker_key_path(cfg, i)) == 0o600 for i in range(2))
        # A rerun: the same keys, nothing written again.
        await store.put_if_absent(RunLayout(cfg.run).run_manifest,
                                  RunManifest(run=cfg.run, model="m", task="synthetic", run_key=key.public.to_text()).to_bytes(key))
        again_key = await run_key_for(store, cfg, new_run=False)
        assert again_key is not None and again_key.key_id == key.key_id
        assert await register_workers(store, cfg, key) == first
        # A third worker joins a rerun with more workers: registered, the others kept.
        more = await register_workers(store, QuickstartConfig(out=cfg.out, workers=3), key)
        assert more.serial == 3 and len(more.workers) == 3
        # The run key file gone: the signed run cannot go on.
        (cfg.out / RUN_KEY_FILE).unlink()
        with pytest.raises(QuickstartError, match="run key"):
            await run_key_for(store, cfg, new_run=False)


async def test_a_run_made_unsigned_stays_unsigned(tmp_path: Path) -> None:
    cfg = QuickstartConfig(out=tmp_path / "qs")
    cfg.out.mkdir()
    async with open_store(cfg.store_url, create=True) as store:
        await store.put_if_absent(RunLayout(cfg.run).run_manifest, RunManifest(run=cfg.run, model="m", task="synthetic").to_bytes())
        assert await run_key_for(store, cfg, new_run=False) is None
        assert not (cfg.out / RUN_KEY_FILE).exists()


def assert_ran_signed(out: Path, run: str = "quickstart", workers: int = 2) -> None:
    """After a quickstart in `out`: its run key and worker keys are 0600 files, the run manifest
    names the run key, the registry holds the workers, every record in the bucket is signed by a
    registered key of the worker it is filed under, and the trainer refused none for its
    signature. (`tests/test_quickstart.py` runs the quickstart and calls this.)"""
    run_key = read_key_file(out / RUN_KEY_FILE)
    for i in range(workers):
        assert _mode(out / "workers" / f"worker-{i}" / "worker.key") == 0o600
        config = (out / "workers" / f"worker-{i}" / "macd.toml").read_text()
        assert "worker_key" in config
        assert f'run_key = "{run_key.public.to_text()}"' in config  # pinned at join, not trusted at each start

    async def bucket() -> None:
        async with open_store(f"file://{out / 'bucket'}") as store:
            layout = RunLayout(run)
            manifest = RunManifest.from_bytes(await store.get_bytes(layout.run_manifest))
            assert manifest.run_key == run_key.public.to_text()
            read = await read_registry(store, run, run_key.public)
            assert read is not None and sorted(read.registry.workers) == [worker_id(i) for i in range(workers)]
            keys = [info.key async for info in store.list(layout.rollouts_prefix())]
            assert keys
            for key in keys:
                envelope = open_signed(await store.get_bytes(key))
                entry = read.registry.by_key_id(envelope.key_id)
                parsed = layout.parse_rollout(key)
                assert entry is not None and parsed is not None and entry.worker == parsed.worker
                verify_signed(envelope, entry.key, run=run)
            state = json.loads(await store.get_bytes(layout.trainer_file("consumer.json")))
            assert state["signature"]["key"] == run_key.key_id  # the trainer's state, signed
            refused = {f"rejected/{r}" for r in SIGNATURE_REASONS}
            assert not [c for c, n in state["counters"].items() if c in refused and n], state["counters"]

    asyncio.run(bucket())
