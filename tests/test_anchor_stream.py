"""Anchors written one shard at a time (`pulse/anchor.py`): each shard's bytes are
`safetensors_bytes`' own, the index and manifest are unchanged, a state read on demand is read
once per tensor, and the writer holds about one shard, not a serialized copy of the state."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np

from slime_stoa.protocol.hf.folders import INDEX_NAME, WEIGHTS_NAME
from slime_stoa.protocol.hf.safetensors_io import safetensors_bytes
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.anchor import anchor_files, read_anchor, write_anchor
from slime_stoa.protocol.pulse.digest import StateDigest
from slime_stoa.protocol.pulse.step_diff import TensorsOnDemand
from slime_stoa.protocol.store import Store, open_store

MIB = 1 << 20


def a_state(tensors: int, elements: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {f"model.layers.{i}.w.weight": rng.integers(0, 1 << 16, (elements // 64, 64), dtype=np.uint16)
             for i in range(tensors)}
    state["model.norm.weight"] = rng.integers(0, 1 << 16, 64, dtype=np.uint16)
    state["model.scale"] = np.array(7, dtype=np.uint16)  # 0-d
    return state


def test_each_shard_is_safetensors_bytes_and_the_index_lists_every_tensor() -> None:
    state = a_state(5, 4096)
    parts = anchor_files(state, shard_bytes=3 * 8192, extras=())
    shards = [p for p in parts if p.is_weights]
    assert [p.name for p in shards] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = json.loads(next(p for p in parts if p.name == INDEX_NAME).build())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in state.values())
    for part in shards:
        names = [n for n, at in index["weight_map"].items() if at == part.name]
        assert bytes(part.build()) == safetensors_bytes({n: state[n] for n in names}, metadata={"format": "pt"})
    assert sorted(index["weight_map"]) == sorted(state)
    (single,) = anchor_files(state, shard_bytes=1 << 30)
    assert single.name == WEIGHTS_NAME and bytes(single.build()) == safetensors_bytes(state, metadata={"format": "pt"})


async def test_an_anchor_read_on_demand_reads_each_tensor_once_and_writes_the_same_files(tmp_path: Path) -> None:
    state = a_state(6, 4096)
    fetched: list[str] = []

    def fetch(name: str) -> np.ndarray:
        fetched.append(name)
        return state[name].copy()

    on_demand = TensorsOnDemand({n: a.shape for n, a in state.items()}, fetch)
    digest = StateDigest.of(state).root()
    async with open_store(f"file://{tmp_path}") as store:
        layout = RunLayout("r")
        _, held = await write_anchor(store, layout, version=0, attempt="0000000a", state=state, state_digest=digest,
                                     shard_bytes=2 * 8192)
        _, streamed = await write_anchor(store, layout, version=0, attempt="0000000b", state=on_demand, state_digest=digest,
                                         shard_bytes=2 * 8192)
        assert sorted(fetched) == sorted(state)  # once each: the plan and the index read shapes only
        assert [(f.name, f.bytes, f.xxh3, f.sha256) for f in (*streamed.weights, *streamed.extras)] == \
               [(f.name, f.bytes, f.xxh3, f.sha256) for f in (*held.weights, *held.extras)]
        assert len(held.weights) == 4
        back, _ = await read_anchor(store, streamed)
        assert back.keys() == state.keys() and all(np.array_equal(back[n], state[n]) for n in state)


class HighWater:
    """The most bytes traced alive (numpy arrays and Python buffers) above the level at `start`."""

    def __enter__(self) -> HighWater:
        tracemalloc.start()
        self.start = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = tracemalloc.get_traced_memory()[1] - self.start
        tracemalloc.stop()


async def anchor_high_water(store: Store, state: TensorsOnDemand, shard_bytes: int, version: int) -> int:
    with HighWater() as seen:
        await write_anchor(store, RunLayout("r"), version=version, attempt="0000000a", state=state, state_digest="0" * 32,
                           shard_bytes=shard_bytes)
    return seen.peak


async def test_the_writer_holds_about_one_shard(tmp_path: Path) -> None:
    """16 tensors of 1 MiB in 8 shards of 2 MiB, read on demand (a fresh copy per read, as from a
    device): the bytes alive while the anchor is written stay under one shard plus one tensor,
    where building every shard first held the serialized state (16 MiB) and more."""
    state = a_state(16, MIB // 2)
    on_demand = TensorsOnDemand({n: a.shape for n, a in state.items()}, lambda name: state[name].copy())
    async with open_store(f"file://{tmp_path}") as store:
        peak = await anchor_high_water(store, on_demand, shard_bytes=2 * MIB, version=0)
        whole = await anchor_high_water(store, on_demand, shard_bytes=1 << 30, version=1)  # one shard: the whole state
    assert peak < 2 * MIB + MIB + MIB // 4, f"{peak / MIB:.2f} MiB alive while writing 2 MiB shards"
    assert 16 * MIB <= whole < 16 * MIB + MIB + MIB // 4, f"{whole / MIB:.2f} MiB alive while writing one 16 MiB shard"
