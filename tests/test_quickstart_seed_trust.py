"""A quickstart rerun whose run key the bucket's run does not trust (and nothing kept repairs)
stops seeding with one line naming the repair (a QuickstartError, which the command prints and
exits 1 on), never a traceback; a forged run.json with the trainer's kept copy is put back and
the rerun seeds on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.kept_chain import LIVE_CHAIN_FOLDER
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.run_manifest import RunManifest, read_run_manifest
from slime_stoa.protocol.signing import SigningKey, write_key_file
from slime_stoa.protocol.store import Store, open_store
from slime_stoa.quickstart.config import QuickstartConfig, QuickstartError
from slime_stoa.quickstart.interrupt import Interrupt
from slime_stoa.quickstart.progress import Progress
from slime_stoa.quickstart.run import RUN_KEY_FILE, Session, kept_dir, phase_seed
from slime_stoa.quickstart.seeding import tiny_synthetic_model

from .forged_weights import random_state

RUN = "quickstart"


class Notes:
    def note(self, line: str) -> None:
        pass


async def rerun_seed(store: Store, out: Path) -> Publisher:
    """`phase_seed` of a rerun of the quickstart in `out` (the run exists in `store`)."""
    cfg = QuickstartConfig(out=out, run=RUN, workers=1)
    s = Session(cfg=cfg, report=Notes(), stop=Interrupt(), store=store, new_run=False, model_dir=out / "model",
                search_data=None, progress=Progress())
    return (await phase_seed(s, out / "extras")).pub


async def existing_run(store: Store, out: Path, key: SigningKey) -> None:
    """Run RUN signed by `key`, v0 published by a publisher keeping its copies where the quickstart does."""
    manifest = RunManifest(run=RUN, model="m", task="synthetic", run_key=key.public.to_text())
    await store.put_if_absent(RunLayout(RUN).run_manifest, manifest.to_bytes(key))
    keep = kept_dir(QuickstartConfig(out=out, run=RUN))
    await Publisher(store, RUN, PublisherConfig(keep_dir=keep), key=key).publish(random_state(np.random.default_rng(3)))


async def test_a_key_the_run_does_not_trust_stops_seeding_with_the_repair(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    out.mkdir()
    async with open_store(f"file://{tmp_path / 'bucket'}", create=True) as store:
        await existing_run(store, out, SigningKey.generate())
        write_key_file(out / RUN_KEY_FILE, SigningKey.generate())  # a run.key that signed nothing there
        with pytest.raises(QuickstartError, match="not the current key") as refused:
            await rerun_seed(store, out)
    message = str(refused.value)
    assert "Repair: put runs/quickstart/run.json back" in message and str(out / "kept") in message


async def test_a_forged_manifest_is_put_back_and_the_rerun_seeds(tmp_path: Path) -> None:
    out = tmp_path / "qs"
    out.mkdir()
    key = SigningKey.generate()
    write_key_file(out / RUN_KEY_FILE, key)
    async with open_store(f"file://{tmp_path / 'bucket'}", create=True) as store:
        await existing_run(store, out, key)
        forger = SigningKey.generate()
        genuine = await read_run_manifest(store, RUN)
        await store.put(RunLayout(RUN).run_manifest, replace(genuine, run_key=forger.public.to_text()).to_bytes(forger))
        pub = await rerun_seed(store, out)
        assert pub.version == 0
        assert (await read_run_manifest(store, RUN)).run_key == key.public.to_text()


async def test_a_new_run_forgets_only_the_copies_of_the_run_it_replaces(tmp_path: Path) -> None:
    """A new run in an existing folder (its bucket deleted) drops the copies kept for the earlier
    run of its name, which are not its own; another run's copies and other files stay."""
    out = tmp_path / "qs"
    keep = kept_dir(QuickstartConfig(out=out, run=RUN))
    stale = keep / RunLayout(RUN).trainer_file("state.json")
    stale_chain = keep / LIVE_CHAIN_FOLDER / RunLayout(RUN).version_manifest(1, "0badc0de")
    other = keep / RunLayout("other").run_manifest
    other_chain = keep / LIVE_CHAIN_FOLDER / RunLayout("other").version_manifest(1, "0badc0de")
    note = keep / "notes.txt"
    for path in (stale, stale_chain, other, other_chain, note):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"kept")
    cfg = QuickstartConfig(out=out, run=RUN, workers=1)
    model = tiny_synthetic_model(tmp_path / "model")
    async with open_store(f"file://{tmp_path / 'bucket'}", create=True) as store:
        s = Session(cfg=cfg, report=Notes(), stop=Interrupt(), store=store, new_run=True, model_dir=model,
                    search_data=None, progress=Progress())
        assert (await phase_seed(s, model)).pub.version == 0
    assert not stale.exists() and not stale_chain.exists()
    assert other.read_bytes() == other_chain.read_bytes() == note.read_bytes() == b"kept"
    assert (keep / RunLayout(RUN).run_manifest).exists()  # the new run's own copies, kept beside
