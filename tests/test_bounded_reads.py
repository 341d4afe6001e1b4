"""Bounded small reads: every small document read from the bucket is refused when oversize after
at most `limit + 1` bytes (`store.capped.read_capped`), and every limit fits the documents of
real runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_stoa.cli import fleet_cmd, main
from slime_stoa.protocol.heartbeat import MAX_HEARTBEAT_BYTES, MAX_TEXT_CHARS, Heartbeat
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse import history
from slime_stoa.protocol.pulse.patch_index import EntryInfo, FrameInfo, PatchIndex
from slime_stoa.protocol.run_manifest import MAX_RUN_MANIFEST_BYTES, MAX_STOP, MAX_STOP_CHARS, RunManifest
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import GetResult, NotFound, Store, open_store
from slime_stoa.protocol.store.capped import TooLarge, read_capped, read_capped_bytes

from .oversize_reads import ByteCounter, cases, junk, run_case, tally


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.name)
async def test_an_oversize_document_is_refused_after_limit_plus_one_bytes(store: Store, case) -> None:
    outcome = await run_case(store, case)
    assert outcome.refused, case.name
    assert outcome.read > 0 and outcome.over == 0, (case.name, outcome)  # no read took more than limit + 1


async def test_tally(tmp_path: Path) -> None:
    async def fresh(name: str) -> Store:
        (tmp_path / name).mkdir()
        return open_store(f"file://{tmp_path / name}")

    report = await tally(fresh)
    assert report == {"oversize_tried": len(cases()), "oversize_refused": len(cases()), "max_bytes_read_over_limit": 0}


async def test_read_capped(store: Store) -> None:
    await store.put("a/small", b"12345")
    await store.put("a/empty", b"")
    counter = ByteCounter(store)
    got = await read_capped(counter, "a/small", 5)
    assert got is not None and got.data == b"12345" and got.size == 5
    assert await read_capped(counter, "a/small", 5, if_none_match=got.etag) is None
    assert await read_capped_bytes(counter, "a/empty", 0) == b""
    with pytest.raises(TooLarge) as caught:
        await read_capped(counter, "a/small", 4)
    assert caught.value.size == 5 and caught.value.limit == 4 and caught.value.etag == got.etag
    assert str(caught.value) == "a/small is 5 bytes, over the limit of 4 for this document: refused without reading it"
    assert counter.read["a/small"] == 5 + 5  # each read asked for at most limit + 1 bytes
    with pytest.raises(NotFound):
        await read_capped(counter, "a/missing", 4)


async def test_a_claimed_size_is_refused_without_reading_more(store: Store) -> None:
    """An object that says it is 1 GiB (the total size of a ranged read) is refused on that word."""

    class Claims(ByteCounter):
        async def get(self, key: str, **kw) -> GetResult | None:
            got = await super().get(key, **kw)
            assert got is not None and kw["length"] == history.MAX_POINTER_BYTES + 1
            return GetResult(data=got.data, etag=got.etag, size=1 << 30)

    await store.put(RunLayout("r").pointer, b"{}")
    with pytest.raises(history.MalformedPointer, match="1,073,741,824 bytes, over the limit of 65,536"):
        await history.read_pointer(Claims(store), "r")


def test_stoa_fleet_reports_oversize_heartbeats_and_pointer_and_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    assert main(["run", "create", "--store", url, "--run", "r", "--model", "m", "--task", "synthetic"]) == 0
    layout = RunLayout("r")
    big_beat = layout.heartbeat("mac-big-abc123")
    for key, data in (
        (layout.heartbeat("mac-ok-abc123"), Heartbeat(worker_id="mac-ok-abc123", name="ok", status="generating").to_bytes()),
        (big_beat, junk(MAX_HEARTBEAT_BYTES)),
        (layout.pointer, junk(history.MAX_POINTER_BYTES)),
    ):
        (bucket / key).parent.mkdir(parents=True, exist_ok=True)
        (bucket / key).write_bytes(data)
    counters: list[ByteCounter] = []

    def counted(url: str) -> Store:
        counters.append(ByteCounter(open_store(url), listed_size=100))  # the listing says it is small
        return counters[-1]

    monkeypatch.setattr(fleet_cmd, "open_store", counted)
    capsys.readouterr()
    assert main(["fleet", "--store", url, "--run", "r"]) == 0
    out = capsys.readouterr().out
    assert "1 worker(s)" in out and "1 unreadable heartbeat(s)" in out and "mac-ok-abc123" in out, out
    assert "pointer unreadable" in out and "over the limit of 65,536" in out, out
    assert counters[0].read[big_beat] <= MAX_HEARTBEAT_BYTES + 1
    assert counters[0].read[layout.pointer] <= history.MAX_POINTER_BYTES + 1


# -- the limits fit real documents ----------------------------------------------------------------------

#: About the tensor count of LFM2-8B-A1B (24 layers of 32 experts with three matrices each).
LFM2_TENSORS = 2_600


def patch_index(tensors: int, frames: int) -> PatchIndex:
    """An index naming `tensors` tensors with long names over `frames` frames (a tensor in the
    frame before it too, as one split over two frames)."""
    names = [f"model.layers.{i // 96}.feed_forward.experts.{i // 3 % 32}.w{i % 3 + 1}.weight.{i}" for i in range(tensors)]
    per = -(-tensors // frames)
    out = []
    for f in range(frames):
        entries = tuple(
            EntryInfo(name=n, shape=(1792, 2048), count=3_000_000, width=2, high=100_000)
            for n in names[max(f * per - 1, 0) : (f + 1) * per]
        )
        out.append(FrameInfo(offset=f * 12_000_000, length=12_000_000, raw_size=16 << 20, digest="ab" * 16,
                             entries=entries, streams=(1_000_000, 2_000_000, 3_000_000, 400_000)))
    return PatchIndex(mode="rel", frames=tuple(out))


@pytest.mark.parametrize(
    "tensors, frames",
    [
        pytest.param(history.MAX_MODEL_TENSORS, 20_000, marks=pytest.mark.slow),  # ~15 s to build
        (4 * LFM2_TENSORS, 5_000),
        (LFM2_TENSORS, 1_000),
    ],
)
def test_a_version_manifest_of_a_large_model_fits(tensors: int, frames: int) -> None:
    index = json.dumps(patch_index(tensors, frames).to_json())
    assert 2 * len(index) + 4096 < history.MAX_VERSION_MANIFEST_BYTES / 2, len(index)  # step + catch-up, 2x headroom


def test_the_largest_run_manifest_and_heartbeat_fit() -> None:
    escaped = "\u2028" * MAX_STOP_CHARS  # written as \\u2028: 6 bytes a character
    manifest = RunManifest(run="r" * 64, model="m" * 512, task="gsm8k", stop=(escaped,) * MAX_STOP,
                           run_key=SigningKey.generate().public.to_text())
    assert len(manifest.to_bytes()) < MAX_RUN_MANIFEST_BYTES / 2
    beat = Heartbeat(worker_id="mac-a1b2c3", name="\u2028" * MAX_TEXT_CHARS, status="x" * MAX_TEXT_CHARS,
                     tier="x" * MAX_TEXT_CHARS, last_error="\u2028" * 2000, state_digest="f" * MAX_TEXT_CHARS)
    assert len(beat.to_bytes()) < MAX_HEARTBEAT_BYTES / 2


async def test_a_heartbeat_listed_as_oversize_is_not_read_at_all(store: Store) -> None:
    from slime_stoa.protocol.heartbeat import read_heartbeats

    await store.put(RunLayout("r").heartbeat("mac-big-abc123"), junk(MAX_HEARTBEAT_BYTES))
    counter = ByteCounter(store)
    assert await read_heartbeats(counter, "r") == ([], 1)
    assert not counter.read
