"""The search index in a Mac's memory plan (`macd.index_plan`): `macd join` and `macd doctor`
count the run's index at the size its manifest in the bucket gives, without downloading it; a
run without a search task counts none; a missing or hostile manifest is a line of words and 0
counted; `--plan-index-gb` wins over the manifest."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest

from macd import config as cfg
from macd.cli import main as macd
from macd.doctor import plan_rows
from macd.index_plan import (
    COUNTED_FILES,
    MAX_MANIFEST_BYTES,
    QUERY_BYTES_PER_PASSAGE,
    IndexPlan,
    run_index_plan,
)
from macd.join_cmd import plan_lines, plane_line
from macd.memory_plan import GIB, LFM2_5_8B_A1B
from macd.shared_dir import SHARED_DIR_ENV
from slime_stoa.cli.run_cmd import create_run
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import open_store
from slime_stoa.tasks.base import TaskItem, encode_task_data
from slime_stoa.tasks.search.bundle import (
    FORMAT,
    INDEX_FILES,
    MANIFEST,
    MAX_CHUNK_BYTES,
    Chunk,
    IndexFile,
    IndexManifest,
    chunk_name,
    encode_manifest,
)
from slime_stoa.tasks.search.compact import QUERY_THREADS

RUN = "r"
#: A PubMed-like compact index as its manifest describes it: postings 6 GiB, norms 4 bytes a
#: passage, the term table what brings the counted bytes (with the 8 bytes a passage of each of
#: the `QUERY_THREADS` queries a worker runs at once and the 100 bytes of each other counted file)
#: to 6.5 GiB; zstd passage texts 20 GiB (nothing of it exists but the manifest).
BIG_PASSAGES = 16_000_000
BIG_QUERIES = QUERY_THREADS * QUERY_BYTES_PER_PASSAGE * BIG_PASSAGES
BIG_SIZES = {
    "postings.bin": 6 * GIB, "norms.npy": 4 * BIG_PASSAGES,
    "terms.bin": GIB // 2 - 4 * BIG_PASSAGES - BIG_QUERIES - 4 * 100,
    "passages.zst": 19 * GIB, "passages.blocks.npy": GIB,
}
BIG_COUNTED = 6 * GIB + GIB // 2


def described_manifest(sizes: dict[str, int], passages: int = BIG_PASSAGES) -> bytes:
    """An index manifest listing `sizes` (files not named: 100 bytes), chunked as `upload_index` would."""
    files = []
    for name in sorted(INDEX_FILES):
        size = sizes.get(name, 100)
        parts = [MAX_CHUNK_BYTES] * (size // MAX_CHUNK_BYTES) + ([size % MAX_CHUNK_BYTES] if size % MAX_CHUNK_BYTES else [])
        chunks = tuple(Chunk(chunk_name(name, n), part, "0" * 64) for n, part in enumerate(parts))
        files.append(IndexFile(name, size, "0" * 64, chunks))
    return encode_manifest(IndexManifest(passages=passages, files=tuple(files)))


def search_run(tmp_path: Path, *, task: str = "search", planes: tuple = ()) -> tuple[str, RunManifest]:
    """A bucket holding a run of LFM2.5-8B-A1B (its config.json in a local model folder) on `task`."""
    bucket, model = tmp_path / "bucket", tmp_path / "LFM2.5-8B-A1B"
    bucket.mkdir()
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LFM2_5_8B_A1B))
    manifest = RunManifest(run=RUN, model=str(model), task=task, group_size=8, max_tokens=1536,
                           max_prompt_tokens=512, planes=planes)
    url = f"file://{bucket}"
    asyncio.run(create_run(url, manifest))
    return url, manifest


def task_data(task: str, pinned: str | None) -> bytes:
    """The run's task data: a few items, its meta pinning the index manifest `pinned` (or none)."""
    items = [TaskItem(index=i, prompt=f"question {i}", label='["a"]') for i in range(3)]
    return encode_task_data(task, items, meta={} if pinned is None else {"index": {"manifest_sha256": pinned}})


def put_task_data(url: str, data: bytes, task: str = "search") -> None:
    async def put() -> None:
        async with open_store(url) as store:
            await store.put(RunLayout(RUN).task_data(task, "train"), data)

    asyncio.run(put())


def put_index_manifest(url: str, body: bytes, task: str = "search", *, pin: bool = True) -> None:
    """The index manifest `body` in the bucket, with task data pinning its digest when `pin`."""
    async def put() -> None:
        async with open_store(url) as store:
            await store.put(RunLayout(RUN).task_index_file(task, MANIFEST), body)

    asyncio.run(put())
    if pin:
        put_task_data(url, task_data(task, hashlib.sha256(body).hexdigest()), task)


def index_plan(url: str, manifest: RunManifest, shared: Path | None = None) -> IndexPlan | None:
    async def read() -> IndexPlan | None:
        async with open_store(url) as store:
            return await run_index_plan(store, manifest, shared)

    return asyncio.run(read())


def daemon_config(url: str, tmp_path: Path) -> cfg.DaemonConfig:
    return cfg.DaemonConfig(store=url, run=RUN, name="mac", worker_id="mac-1", data_dir=tmp_path / "data", batch=2)


def needs(lines: list[str], plane: str = "bf16") -> float:
    """GiB the plan says this Mac needs on `plane`."""
    row = next(line for line in lines if f"this Mac, {plane}: needs " in line)
    return float(row.split(" needs ")[1].split(" of ")[0])


def test_a_real_index_counts_its_postings_and_tables(tmp_path: Path) -> None:
    from slime_stoa.tasks.search.build import build_index
    from slime_stoa.tasks.search.bundle import fetch_index, upload_index
    from slime_stoa.tasks.search.compact import TERMS_FILE
    from slime_stoa.tasks.search.synthetic import generate

    url, manifest = search_run(tmp_path)
    folder = tmp_path / "built"
    build_index(generate(5, seed=1).passages, folder, compact_format=True)  # as `prepare` builds it

    async def upload() -> str:
        async with open_store(url) as store:
            return await upload_index(store, RUN, folder, passages=20, chunk_bytes=4096)

    digest = asyncio.run(upload())
    put_task_data(url, task_data("search", digest))
    shared = tmp_path / "shared"
    plan = index_plan(url, manifest, shared)
    mapped = sum((folder / name).stat().st_size for name in COUNTED_FILES)
    assert plan is not None and plan.counted == mapped + QUERY_THREADS * QUERY_BYTES_PER_PASSAGE * 20
    assert (folder / TERMS_FILE).stat().st_size < plan.counted < sum(f.stat().st_size for f in folder.iterdir())
    assert plan.line.startswith(f"search index: runs/{RUN}/tasks/search/index, 20 passages: postings, term tables ")
    assert plan.line.endswith("not fetched to this Mac yet")

    local = shared / "search-index" / f"sha256-{digest}"  # where a worker of this Mac fetches it

    async def fetch() -> None:
        async with open_store(url) as store:
            await fetch_index(store, RUN, local, expected_sha256=digest)

    asyncio.run(fetch())
    fetched = index_plan(url, manifest, shared)
    assert fetched is not None and fetched.counted == plan.counted and fetched.line.endswith(f"on this Mac in {local}")


def test_join_counts_the_index_its_manifest_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url, manifest = search_run(tmp_path, planes=("int4",))
    put_index_manifest(url, described_manifest(BIG_SIZES))
    monkeypatch.setenv(SHARED_DIR_ENV, str(tmp_path / "shared"))
    assert macd(["join", url, "--run", RUN, "--data-dir", str(tmp_path / "data"), "--config", str(tmp_path / "m.toml")]) == 0
    out = capsys.readouterr().out
    assert "search index 6.50 GiB" in out  # the plan's terms
    assert (f"search index: runs/{RUN}/tasks/search/index, 16,000,000 passages: postings, term tables and "
            "norms 6.26 GiB and the memory of 2 queries at once 0.24 GiB counted, passage texts (zstd) 20.00 GiB "
            "mapped but read per hit, not counted; not fetched to this Mac yet") in out
    assert "\n  memory       " not in out  # one account of memory: the plan

    config, info = daemon_config(url, tmp_path), cfg.RunInfo(manifest=manifest)
    index = index_plan(url, manifest)
    assert index is not None and index.counted == BIG_COUNTED
    without, counted = plan_lines(config, info, 24 * GIB, device="gpu"), plan_lines(config, info, 24 * GIB, index, "gpu")
    assert needs(counted) == pytest.approx(needs(without) + 6.5, abs=0.1)
    assert "               this Mac, bf16: needs 16.3 of 16.0 GiB usable: fits only 2 sequences (the run's plane)" in without
    assert "               this Mac, bf16: needs 22.8 of 16.0 GiB usable: does not fit (the run's plane)" in counted
    # the run's plane does not fit beside the index; the int4 plane it publishes does, and is served
    assert counted[-1].strip() == ("this Mac will serve the int4 plane: needs 11.5 of 16.0 GiB usable: fits "
                                   "(the run's bf16 plane: does not fit)")
    # the plane join says a 32 GB Mac serves: bf16 beside no index, int4 beside this one
    assert plane_line(config, info, 32 * GIB, device="gpu") == "  plane        bf16 (the bf16 weights): 16.3 of 21.3 GiB usable, fits"
    assert plane_line(config, info, 32 * GIB, index, device="gpu") == (
        "  plane        int4 (the run's published plane, held alone): 11.5 of 21.3 GiB usable, fits")


def test_a_run_without_a_search_task_counts_no_index(tmp_path: Path) -> None:
    url, manifest = search_run(tmp_path, task="gsm8k")
    put_index_manifest(url, described_manifest(BIG_SIZES), task="gsm8k")  # not its task's: never read
    assert index_plan(url, manifest) is None
    rows = asyncio.run(plan_rows(daemon_config(url, tmp_path)))
    assert any("search index 0.00 GiB" in finding for _, finding, _ in rows)
    assert not any("search index:" in finding for _, finding, _ in rows)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (None, "missing from the bucket: a worker cannot fetch the index either"),
        (b"{not json", "not valid JSON"),
        (json.dumps({"format": "stoa.search-index/1", "passages": 1, "files": []}).encode(), "built by an earlier stoa"),
        (json.dumps({"format": "stoa.search-index/2", "passages": 1, "files": []}).encode(),
         "built as bm25s arrays by an earlier stoa; rebuild it with `stoa task prepare search`"),
        (described_manifest({"postings.bin": 200 * GIB, "passages.zst": 100 * GIB}), "over the limit"),
        (json.dumps({"format": FORMAT, "passages": 1, "files": [{"name": "../x", "size": -1,
                     "sha256": "0", "chunks": []}]}).encode(), "index file"),
        (b" " * (MAX_MANIFEST_BYTES + 1), "over the limit"),
        (json.dumps({"format": "x" * 100_000, "passages": 1, "files": []}).encode(), "..."),
    ],
    ids=["missing", "not-json", "old-format", "bm25s-arrays-format", "too-big-an-index", "forged-file", "too-big-a-manifest", "long-text"],
)
def test_a_missing_or_hostile_manifest_counts_nothing_and_says_why(tmp_path: Path, body: bytes | None, why: str) -> None:
    url, manifest = search_run(tmp_path)
    if body is not None:
        put_index_manifest(url, body)  # pinned: a genuine but malformed manifest is still refused
    else:
        put_task_data(url, task_data("search", "ab" * 32))
    plan = index_plan(url, manifest)
    assert plan is not None and plan.counted == 0
    assert plan.line.startswith(f"search index: size unknown (runs/{RUN}/tasks/search/index/manifest.json: ")
    assert why in plan.line and plan.line.endswith("); 0 GiB counted") and "\n" not in plan.line
    assert len(plan.line) < 400  # the bucket's text is cut, never echoed whole
    lines = plan_lines(daemon_config(url, tmp_path), cfg.RunInfo(manifest=manifest), 64 * GIB, plan, "gpu")
    assert "search index 0.00 GiB" in "\n".join(lines) and any(plan.line in line for line in lines)
    rows = asyncio.run(plan_rows(daemon_config(url, tmp_path)))  # doctor: that row needs fixing
    assert [ok for _, finding, ok in rows if finding.startswith("search index:")] == [False]


def test_the_override_wins_over_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = search_run(tmp_path)
    put_index_manifest(url, described_manifest(BIG_SIZES))
    config = daemon_config(url, tmp_path)
    looked_up = [finding for _, finding, _ in asyncio.run(plan_rows(config))]
    assert any("and the memory of 2 queries at once 0.24 GiB counted" in f for f in looked_up)
    given = [finding for _, finding, _ in asyncio.run(plan_rows(config, 2.0))]
    assert "search index: 2.00 GiB counted, as --plan-index-gb says" in given
    assert any("search index 2.00 GiB" in f for f in given) and not any("6.50" in f for f in given)

    assert macd(["doctor", "--plan-for", "24", "--plan-index-gb", "2"]) == 0
    out = capsys.readouterr().out
    assert "  search index: 2.00 GiB counted, as --plan-index-gb says" in out and "search index 2.00 GiB" in out
    assert macd(["doctor", "--plan-for", "24", "--plan-index-gb", "-1"]) == 1
    assert macd(["doctor", "--plan-index-gb", "-1"]) == 1
    assert capsys.readouterr().err.count("error: --plan-index-gb must be between 0 and") == 2


def test_the_plan_counts_the_mapped_tables_and_each_query_a_worker_runs_at_once(tmp_path: Path) -> None:
    """Postings, term tables and norms whole, plus the memory of each query one worker process
    runs at once (`QUERY_THREADS`, the retriever's bound: `test_retriever`); the zstd passages
    not at all."""
    from macd.index_plan import PASSAGE_FILES, known_plan
    from slime_stoa.tasks.search.build import build_index
    from slime_stoa.tasks.search.synthetic import generate

    folder = tmp_path / "compact"
    stats = build_index(generate(5, seed=1).passages, folder)
    files = tuple(IndexFile(p.name, p.stat().st_size, "0" * 64, ()) for p in sorted(folder.iterdir()))
    assert {f.name for f in files} == COUNTED_FILES | PASSAGE_FILES | {"stoa.index.json"}
    plan = known_plan("runs/r/tasks/search/index", IndexManifest(passages=stats.passages, files=files), None)
    mapped = sum((folder / name).stat().st_size for name in COUNTED_FILES)
    queries = QUERY_THREADS * QUERY_BYTES_PER_PASSAGE * stats.passages
    assert QUERY_THREADS >= 1 and plan.counted == mapped + queries
    assert mapped < plan.counted < sum(f.size for f in files) + queries  # the passages left out
    assert (f"postings, term tables and norms {mapped / GIB:.2f} GiB and the memory of {QUERY_THREADS} queries at once "
            in plan.line and "passage texts (zstd)" in plan.line)


def test_a_forged_manifest_is_refused_for_its_digest_and_never_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token holder replaces the index manifest with one claiming 200 GiB: the task data pins
    the genuine one, so the forged one is refused before it is parsed and counts nothing."""
    url, manifest = search_run(tmp_path)
    put_index_manifest(url, described_manifest(BIG_SIZES))
    genuine = index_plan(url, manifest)
    assert genuine is not None and genuine.counted == BIG_COUNTED
    put_index_manifest(url, described_manifest({"postings.bin": 200 * GIB}, passages=1), pin=False)

    def parse_would_raise(body: bytes) -> IndexManifest:
        raise AssertionError("an unauthenticated manifest was parsed")

    monkeypatch.setattr("macd.index_plan.parse_manifest", parse_would_raise)
    forged = index_plan(url, manifest)
    assert forged is not None and forged.counted == 0 and not forged.known
    assert "not the manifest the task data pins (index.manifest_sha256): refused unread" in forged.line
    assert "200" not in forged.line


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (None, "the task data is missing from the bucket"),
        (task_data("search", None), "pins no index manifest (index.manifest_sha256)"),
        (task_data("search", "not hex"), "pins no index manifest (index.manifest_sha256)"),
        (b"not zstd at all", "not a zstd frame"),
    ],
    ids=["no-task-data", "no-pin", "malformed-pin", "not-task-data"],
)
def test_an_index_manifest_no_task_data_pins_is_not_planned_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes | None, why: str
) -> None:
    url, manifest = search_run(tmp_path)
    put_index_manifest(url, described_manifest(BIG_SIZES), pin=False)
    if data is not None:
        put_task_data(url, data)

    def parse_would_raise(body: bytes) -> IndexManifest:
        raise AssertionError("an unauthenticated manifest was parsed")

    monkeypatch.setattr("macd.index_plan.parse_manifest", parse_would_raise)
    plan = index_plan(url, manifest)
    assert plan is not None and plan.counted == 0 and not plan.known
    assert why in plan.line and "\n" not in plan.line


def test_the_header_is_read_from_the_task_datas_first_bytes() -> None:
    """A large task data's pin is found in its first bytes: the items are never decompressed."""
    from macd.index_plan import task_header_digest

    items = [TaskItem(index=i, prompt=f"question {i} " * 20, label='["a"]') for i in range(20_000)]
    data = encode_task_data("search", items, meta={"index": {"manifest_sha256": "cd" * 32}})
    assert len(data) > 64 * 1024
    assert task_header_digest(data[:4096]) == "cd" * 32


def test_a_signed_runs_forged_split_is_refused_by_its_task_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A signed run: a token holder replaces the split to pin a forged manifest claiming 200 GiB;
    the plan reads the split as the worker's task load does (checked against the run key's task
    manifest), so the forged manifest is never parsed and the line is the load's refusal."""
    from dataclasses import replace

    from slime_stoa.protocol.signing import SigningKey
    from slime_stoa.tasks.objects import put_task_objects

    key = SigningKey.generate()
    url, unsigned = search_run(tmp_path)
    manifest = replace(unsigned, run_key=key.public.to_text())
    genuine = described_manifest(BIG_SIZES)
    put_index_manifest(url, genuine, pin=False)

    async def sign() -> None:
        async with open_store(url) as store:
            await put_task_objects(store, RUN, "search", {"train": task_data("search", hashlib.sha256(genuine).hexdigest())},
                                   key=key)

    asyncio.run(sign())
    plan = index_plan(url, manifest)
    assert plan is not None and plan.counted == BIG_COUNTED and plan.refused is None
    put_index_manifest(url, described_manifest({"postings.bin": 200 * GIB}, passages=1))  # and a split pinning it

    def parse_would_raise(body: bytes) -> IndexManifest:
        raise AssertionError("a manifest pinned by a refused split was parsed")

    monkeypatch.setattr("macd.index_plan.parse_manifest", parse_would_raise)
    forged = index_plan(url, manifest)
    assert forged is not None and forged.counted == 0 and not forged.known and forged.refused is not None
    assert str(forged.refused) in forged.line and "\n" not in forged.line
    assert forged.line.startswith(f"search index: size unknown ({RunLayout(RUN).task_data('search', 'train')}: larger than "
                                  "the task data the run key signed") and "stoa task prepare search" in forged.line
    assert forged.line.endswith("--key RUN_KEY_FILE`); 0 GiB counted")
    monkeypatch.undo()
    unchecked = index_plan(url, unsigned)  # an unsigned run has no run key to check its split: read as before
    assert unchecked is not None and unchecked.counted >= 200 * GIB
