"""The BM25 retriever and its index in the bucket: build, upload, resumable verified fetch,
memory-mapped search, hostile manifests and folders, and `stoa task prepare search` end to end.

Store tests run on the local backend and the real S3 server (conftest's `store` fixture)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import Counter
from collections.abc import AsyncGenerator
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.store import GetResult, ObjectInfo, Store, open_store
from slime_stoa.protocol.store.base import Payload
from slime_stoa.tasks import load_task
from slime_stoa.tasks.search import Search, build, bundle, compact, decode_label
from slime_stoa.tasks.search.bundle import (
    FORMAT,
    MANIFEST,
    PARTIAL,
    PARTS,
    STAMP,
    encode_manifest,
    fetch_index,
    parse_manifest,
    upload_index,
)
from slime_stoa.tasks.search.passages import OFFSETS_FILE, TEXT_FILE, ZST_FILE
from slime_stoa.tasks.search.retriever import QUERY_THREADS, Retriever, SearchTool, build_index, open_run_index
from slime_stoa.tasks.search.synthetic import generate

RUN = "r"
SMALL_CHUNK = 4096  # several chunks per index file


class CountingStore(Store):
    """A real store that also counts the GETs per key (to see what a fetch downloads)."""

    def __init__(self, inner: Store):
        self.inner, self.url, self.gets = inner, inner.url, Counter[str]()

    async def get(self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None) -> GetResult | None:
        self.gets[key] += 1
        return await self.inner.get(key, offset=offset, length=length, if_none_match=if_none_match)

    async def put(self, key: str, data: Payload, *, if_match: str | None = None) -> str:
        return await self.inner.put(key, data, if_match=if_match)

    async def put_if_absent(self, key: str, data: Payload) -> str:
        return await self.inner.put_if_absent(key, data)

    async def head(self, key: str) -> ObjectInfo:
        return await self.inner.head(key)

    async def list(self, prefix: str = "", *, start_after: str | None = None) -> AsyncGenerator[ObjectInfo, None]:
        async for info in self.inner.list(prefix, start_after=start_after):
            yield info

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)


@pytest.fixture(scope="module")
def synthetic_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The index `stoa task prepare search` ships: the compact format."""
    data = generate(150, seed=11)
    folder = tmp_path_factory.mktemp("ix") / "index"
    build.build_index(data.passages, folder, compact_format=True)
    return folder, data


@pytest.fixture(scope="module")
def arrays_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """The bm25s-array index an earlier stoa shipped (`Retriever.open` still opens it)."""
    data = generate(150, seed=11)
    folder = tmp_path_factory.mktemp("arrays") / "index"
    build.build_index(data.passages, folder, compact_format=False)
    return folder, data


def gold_top1(retriever: Retriever, data: object) -> float:
    qa = data.qa  # type: ignore[attr-defined]
    return sum(retriever.search(q.question, 1)[0].index == q.passage for q in qa) / len(qa)


# -- the retriever on a local folder ---------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["synthetic_index", "arrays_index"])
def test_gold_passage_is_top1(fixture: str, request: pytest.FixtureRequest) -> None:
    synthetic_index = request.getfixturevalue(fixture)
    folder, data = synthetic_index
    retriever = Retriever.open(folder)
    assert len(retriever) == 600
    assert gold_top1(retriever, data) == 1.0
    q = data.qa[0]  # type: ignore[attr-defined]
    hits = retriever.search(q.question, 3)
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert q.answer in hits[0].text and hits[0].text == data.passages[q.passage]  # type: ignore[attr-defined]
    body = retriever.observe(q.question, k=3, max_chars=120)
    assert body.startswith("Doc 1: ") and q.answer in body and len(body) <= 120


def test_queries_without_matches(synthetic_index: tuple[Path, object]) -> None:
    retriever = Retriever.open(synthetic_index[0])
    assert retriever.search("", 3) == []
    assert retriever.search("the of and is", 3) == []  # stop words only
    assert retriever.search("qqqxxyz", 3) == []  # unknown words
    assert retriever.observe("qqqxxyz") == "No results."
    assert len(retriever.search("registry", 10_000)) == 600  # k over the corpus size
    with pytest.raises(ValueError):
        retriever.search("registry", 0)


async def test_async_search_runs_off_the_loop(synthetic_index: tuple[Path, object]) -> None:
    folder, data = synthetic_index
    retriever = Retriever.open(folder)
    questions = [q.question for q in data.qa[:20]]  # type: ignore[attr-defined]
    hits = await asyncio.gather(*(retriever.asearch(q, 2) for q in questions))
    assert hits == [retriever.search(q, 2) for q in questions]
    assert await retriever.aobserve(questions[0], k=2, max_chars=500) == retriever.observe(questions[0], k=2, max_chars=500)


def test_a_local_example_builds_the_shipped_index(synthetic_index: tuple[Path, object], tmp_path: Path) -> None:
    """`build_index` (a local example's index) writes the very files `prepare` ships: the bundle's
    file set, byte for byte the folder the bundle's build makes of the same passages."""
    shipped, data = synthetic_index
    local = build_index(data.passages, tmp_path / "local")  # type: ignore[attr-defined]
    assert sorted(p.name for p in local.iterdir()) == sorted(bundle.INDEX_FILES)
    for name in bundle.INDEX_FILES:
        assert (local / name).read_bytes() == (shipped / name).read_bytes(), name


async def test_queries_in_flight_never_exceed_the_query_threads(
    synthetic_index: tuple[Path, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many episodes query at once, a process runs at most `QUERY_THREADS` queries (the
    working memory `macd.index_plan` counts): the first ones wait for each other, so the pool
    is seen to run that many together, and never more."""
    folder, data = synthetic_index
    retriever = Retriever.open(folder)
    questions = [q.question for q in data.qa[:8 * QUERY_THREADS]]  # type: ignore[attr-defined]
    expected = [retriever.observe(q, k=2, max_chars=500) for q in questions]
    lock, together = threading.Lock(), threading.Barrier(QUERY_THREADS, timeout=60)
    active, peak, started, threads = [0], [0], [0], set()
    search = Retriever.search

    def watched(self: Retriever, query: str, k: int = 3) -> list:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            started[0] += 1
            first = started[0] <= QUERY_THREADS
            threads.add(threading.current_thread().name)
        try:
            if first:
                together.wait()
            return search(self, query, k)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(Retriever, "search", watched)
    bodies = await asyncio.gather(*(retriever.aobserve(q, k=2, max_chars=500) for q in questions))
    assert bodies == expected and started[0] == len(questions)
    assert peak[0] == QUERY_THREADS and len(threads) == QUERY_THREADS
    assert all(name.startswith("stoa-search") for name in threads)


def _copy(folder: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in folder.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_open_refuses_damaged_folders(arrays_index: tuple[Path, object], tmp_path: Path) -> None:
    folder = arrays_index[0]
    cases = {
        "backend": lambda d: (d / "params.index.json").write_text(
            json.dumps({**json.loads((d / "params.index.json").read_text()), "backend": "numba"})
        ),
        "extra-param": lambda d: (d / "params.index.json").write_text(
            json.dumps({**json.loads((d / "params.index.json").read_text()), "corpus": "x"})
        ),
        "num-docs": lambda d: (d / "params.index.json").write_text(
            json.dumps({**json.loads((d / "params.index.json").read_text()), "num_docs": 7})
        ),
        "indices": lambda d: np.save(
            d / "indices.csc.index.npy", np.load(d / "indices.csc.index.npy") + 10_000
        ),
        "indptr": lambda d: np.save(d / "indptr.csc.index.npy", np.load(d / "indptr.csc.index.npy")[::-1].copy()),
        "pickle": lambda d: np.save(d / "data.csc.index.npy", np.array([object()]), allow_pickle=True),
        "vocab": lambda d: (d / "vocab.index.json").write_text(json.dumps({"a": 0, "b": 0})),
        "offsets": lambda d: np.save(d / OFFSETS_FILE, np.array([0, 5], dtype=np.int64)),
        "missing": lambda d: (d / TEXT_FILE).unlink(),
    }
    for name, damage in cases.items():
        d = _copy(folder, tmp_path / name)
        damage(d)
        with pytest.raises(ValueError):
            Retriever.open(d)
        print(f"refused: {name}")


# -- the index in the bucket -----------------------------------------------------------------------


async def test_upload_fetch_search(store: Store, synthetic_index: tuple[Path, object], tmp_path: Path) -> None:
    folder, data = synthetic_index
    digest = await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK)
    layout = RunLayout(RUN)
    keys = [info.key async for info in store.list(layout.task_prefix("search"))]
    assert layout.task_index_file("search", MANIFEST) in keys and len(keys) > 8
    assert await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK) == digest  # a re-run is a no-op
    dest = await fetch_index(store, RUN, tmp_path / "cache", expected_sha256=digest)
    assert sorted(p.name for p in dest.iterdir()) == sorted([*(p.name for p in folder.iterdir()), MANIFEST, PARTS, STAMP, bundle.LOCK])
    assert list((dest / PARTS).iterdir()) == []
    assert gold_top1(Retriever.open(dest), data) == 1.0
    with pytest.raises(ValueError, match="not the one the task names"):
        await fetch_index(store, RUN, tmp_path / "other", expected_sha256="0" * 64)


async def test_fetch_verifies_once_and_refetches_only_what_is_damaged(
    store: Store, synthetic_index: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, data = synthetic_index
    digest = await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK)
    counting = CountingStore(store)
    dest = tmp_path / "cache"
    await fetch_index(counting, RUN, dest, expected_sha256=digest)
    manifest = parse_manifest((dest / MANIFEST).read_bytes())
    chunk_keys = {RunLayout(RUN).task_index_file("search", c.name) for f in manifest.files for c in f.chunks}
    assert set(counting.gets) - chunk_keys == {RunLayout(RUN).task_index_file("search", MANIFEST)}
    assert all(counting.gets[k] == 1 for k in chunk_keys)

    # verified once: later starts with the task's digest hash and read nothing
    with monkeypatch.context() as m:
        m.setattr(bundle, "_sha256_file", lambda path: pytest.fail(f"re-hashed {path}"))
        counting.gets.clear()
        await fetch_index(counting, RUN, dest, expected_sha256=digest)
        assert not counting.gets
    with pytest.raises(ValueError, match="not the one the task names"):  # a stamp for another digest is no pass
        await fetch_index(counting, RUN, dest, expected_sha256="0" * 64)

    # a file changed on disk breaks the stamp: that file alone is fetched again
    text = next(f for f in manifest.files if f.name == ZST_FILE)
    assert len(text.chunks) >= 3
    (dest / ZST_FILE).write_bytes(b"garbage")
    counting.gets.clear()
    await fetch_index(counting, RUN, dest, expected_sha256=digest)
    fetched = {k.rsplit("/", 1)[1] for k in counting.gets} - {MANIFEST}
    assert fetched == {c.name for c in text.chunks}
    assert (dest / ZST_FILE).read_bytes() == (folder / ZST_FILE).read_bytes()
    assert gold_top1(Retriever.open(dest), data) == 1.0


async def test_worker_start_scans_the_index_once(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slime_stoa.tasks.search.prepare import prepare_search
    from slime_stoa.tasks.search.synthetic import task_items

    data = generate(20, seed=2)
    prepared = await prepare_search(store, RUN, {"train": task_items(data)}, iter(data.passages), chunk_bytes=SMALL_CHUNK)
    task = load_task(prepared.objects["train"])
    assert isinstance(task, Search)
    scans = []
    real_scan = compact.CompactIndex.scan
    monkeypatch.setattr(compact.CompactIndex, "scan", lambda index: (scans.append(index.passages), real_scan(index)))
    first = await open_run_index(store, RUN, task, tmp_path / "cache")
    again = await open_run_index(store, RUN, task, tmp_path / "cache")
    assert scans == [80]  # the second start trusts the stamp: no full scan, no re-hash
    q = data.qa[0]
    assert first.search(q.question, 1) == again.search(q.question, 1) and again.search(q.question, 1)[0].index == q.passage
    # damage after the stamp: the fetch notices (size/mtime), refetches, and the files are whole again
    (tmp_path / "cache" / compact.POSTINGS_FILE).write_bytes(b"x")
    healed = await open_run_index(store, RUN, task, tmp_path / "cache")
    assert healed.search(q.question, 1)[0].index == q.passage


async def test_a_worker_meeting_an_old_bm25s_index_is_told_to_rebuild(
    store: Store, arrays_index: tuple[Path, object], tmp_path: Path
) -> None:
    """A bucket prepared by an earlier stoa holds a stoa.search-index/2 manifest (the bm25s arrays):
    the worker's join refuses it, pinned as it is, with one line naming the rebuild, and writes no
    index file."""
    from slime_stoa.tasks.base import encode_task_data
    from slime_stoa.tasks.search.synthetic import task_items

    folder, data = arrays_index
    files = []
    for p in sorted(folder.iterdir()):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        size = p.stat().st_size
        files.append({"name": p.name, "size": size, "sha256": digest,
                      "chunks": [{"name": f"{p.name}.00000", "size": size, "sha256": digest}]})
        await store.put(RunLayout(RUN).task_index_file("search", f"{p.name}.00000"), p.read_bytes())
    body = json.dumps({"format": "stoa.search-index/2", "passages": 150, "files": files}).encode()
    await store.put(RunLayout(RUN).task_index_file("search", MANIFEST), body)
    meta = {"index": {"manifest_sha256": hashlib.sha256(body).hexdigest(), "passages": 150}}
    task = load_task(encode_task_data("search", task_items(data), meta=meta))
    assert isinstance(task, Search)
    dest = tmp_path / "cache"
    with pytest.raises(ValueError) as refused:
        await open_run_index(store, RUN, task, dest)
    line = str(refused.value)
    assert "\n" not in line and "'stoa.search-index/2'" in line
    assert line.endswith("built as bm25s arrays by an earlier stoa; rebuild it with `stoa task prepare search`")
    assert not any(p.name in {*bundle.INDEX_FILES, TEXT_FILE} for p in dest.iterdir())


class CutStore(CountingStore):
    """Fails every chunk GET after the first `allowed` (a connection lost mid-download)."""

    def __init__(self, inner: Store, allowed: int):
        super().__init__(inner)
        self.allowed = allowed

    async def get(self, key: str, *, offset: int = 0, length: int | None = None, if_none_match: str | None = None) -> GetResult | None:
        if not key.endswith(MANIFEST):
            if self.allowed <= 0:
                raise ConnectionError("cut")
            self.allowed -= 1
        return await super().get(key, offset=offset, length=length, if_none_match=if_none_match)


async def test_interrupted_fetch_resumes_in_place(store: Store, synthetic_index: tuple[Path, object], tmp_path: Path) -> None:
    folder, data = synthetic_index
    digest = await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK)
    manifest = parse_manifest(await store.get_bytes(RunLayout(RUN).task_index_file("search", MANIFEST)))
    all_chunks = {c.name for f in manifest.files for c in f.chunks}
    dest = tmp_path / "cache"
    got: set[str] = set()
    for allowed in (3, 5, len(all_chunks)):  # two cuts, then the rest
        cut = CutStore(store, allowed)
        try:
            await fetch_index(cut, RUN, dest, expected_sha256=digest, parallel=1)
        except ConnectionError:
            partial = [p for p in dest.iterdir() if p.name.endswith(PARTIAL)]
            assert len(partial) == 1 and not (dest / STAMP).exists()
            # in place: the partial file has its final size and no chunk is stored beside it
            size = next(f.size for f in manifest.files if f"{f.name}{PARTIAL}" == partial[0].name)
            assert partial[0].stat().st_size == size
            assert not [p for p in dest.rglob("*") if p.name in all_chunks]
        fetched = {k.rsplit("/", 1)[1] for k in cut.gets} - {MANIFEST}
        assert not fetched & got, "a verified chunk was fetched again"
        got |= fetched
    assert got == all_chunks and (dest / STAMP).is_file()
    for p in folder.iterdir():
        assert (dest / p.name).read_bytes() == p.read_bytes()
    assert gold_top1(Retriever.open(dest), data) == 1.0


async def test_tampered_chunk_is_refused(store: Store, synthetic_index: tuple[Path, object], tmp_path: Path) -> None:
    folder, _ = synthetic_index
    digest = await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK)
    key = RunLayout(RUN).task_index_file("search", f"{ZST_FILE}.00001")
    original = await store.get_bytes(key)
    await store.put(key, original[:-1] + bytes([original[-1] ^ 1]))  # any token can overwrite a chunk
    dest = tmp_path / "cache"
    with pytest.raises(ValueError, match="digest"):
        await fetch_index(store, RUN, dest, expected_sha256=digest)
    assert not (dest / MANIFEST).exists() and not (dest / ZST_FILE).exists()


def _manifest_doc(folder: Path) -> dict:
    from slime_stoa.tasks.search.bundle import build_manifest

    return json.loads(encode_manifest(build_manifest(folder, chunk_bytes=SMALL_CHUNK, passages=600)))


@pytest.mark.parametrize(
    "hostile",
    ["../compact.index.json", "/etc/passwd", "compact.index.json/x", ".parts", "..", "NUL", "sub\\dir", "a" * 70, ""],
)
def test_hostile_names_in_the_manifest(synthetic_index: tuple[Path, object], hostile: str) -> None:
    doc = _manifest_doc(synthetic_index[0])
    renamed = json.loads(json.dumps(doc))
    renamed["files"][0]["name"] = hostile
    with pytest.raises(ValueError):
        parse_manifest(json.dumps(renamed).encode())
    chunk = json.loads(json.dumps(doc))
    chunk["files"][0]["chunks"][0]["name"] = hostile
    with pytest.raises(ValueError):
        parse_manifest(json.dumps(chunk).encode())


def test_malformed_manifests(synthetic_index: tuple[Path, object]) -> None:
    doc = _manifest_doc(synthetic_index[0])
    assert parse_manifest(json.dumps(doc).encode()).passages == 600

    def variant(edit) -> bytes:
        d = json.loads(json.dumps(doc))
        edit(d)
        return json.dumps(d).encode()

    bad = [
        variant(lambda d: d.update(format="stoa.search-index/9")),
        variant(lambda d: d["files"].pop()),  # a file missing
        variant(lambda d: d["files"].append(d["files"][0])),  # a file twice
        variant(lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1)),  # chunks do not add up
        variant(lambda d: d["files"][0]["chunks"][0].update(size=-1)),
        variant(lambda d: d["files"][0].update(sha256="XYZ")),
        variant(lambda d: d["files"][0]["chunks"].reverse()),  # chunk names out of order
        variant(lambda d: d.update(extra=1)),
        b'{"format": "stoa.search-index/1", "format": "x"}',
        b"[]",
    ]
    for data in bad:
        with pytest.raises(ValueError):
            parse_manifest(data)
    with pytest.raises(ValueError, match="1000"):
        parse_manifest(json.dumps(doc).encode(), max_bytes=1000)


async def test_hostile_manifest_in_the_bucket_writes_nothing_outside(store: Store, tmp_path: Path) -> None:
    layout = RunLayout(RUN)
    doc = {"format": FORMAT, "passages": 1, "files": [
        {"name": "../../evil", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest(),
         "chunks": [{"name": "../../evil.00000", "size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}]}
    ]}
    body = json.dumps(doc).encode()
    await store.put(layout.task_index_file("search", MANIFEST), body)
    dest = tmp_path / "deep" / "cache"
    with pytest.raises(ValueError):  # even pinned (a task prepared from a bad manifest), it is checked
        await fetch_index(store, RUN, dest, expected_sha256=hashlib.sha256(body).hexdigest())
    outside = [p for p in tmp_path.rglob("*") if dest not in (p, *p.parents) and p.is_file() and "bucket" not in p.parts]
    assert outside == []


async def test_an_unpinned_or_forged_manifest_is_refused_before_it_is_parsed(
    store: Store, synthetic_index: tuple[Path, object], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the task's pin nothing authenticates the manifest, so it is not read; a forged one
    (a token holder's) is refused for its digest without being parsed."""
    folder, _ = synthetic_index
    digest = await upload_index(store, RUN, folder, passages=600, chunk_bytes=SMALL_CHUNK)
    await store.put(RunLayout(RUN).task_index_file("search", MANIFEST), b'{"forged": true}')
    monkeypatch.setattr(bundle, "parse_manifest", lambda *a, **k: pytest.fail("an unauthenticated manifest was parsed"))
    with pytest.raises(ValueError, match="pins no index manifest"):
        await fetch_index(store, RUN, tmp_path / "a")
    with pytest.raises(ValueError, match="not the one the task names"):
        await fetch_index(store, RUN, tmp_path / "b", expected_sha256=digest)
    assert not (tmp_path / "b" / MANIFEST).exists()


# -- `stoa task prepare search` --------------------------------------------------------------------


def test_cli_prepare_search_end_to_end(store_url: str, store_env: dict[str, str], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for k, v in store_env.items():
        monkeypatch.setenv(k, v)
    data = generate(30, seed=5)
    qa = tmp_path / "train.jsonl"
    qa.write_text("".join(json.dumps({"question": q.question, "answer": [q.answer]}) + "\n" for q in data.qa))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(
        json.dumps({"id": str(i), "title": f"Entry {i}", "text": p} if i % 2 else {"id": str(i), "contents": p}) + "\n"
        for i, p in enumerate(data.passages)
    ))
    args = ["task", "prepare", "search", str(qa), str(corpus), "--store", store_url, "--run", RUN, "--chunk-mb", "1", "--top-k", "2"]
    assert main(args) == 0, capsys.readouterr().err
    assert "index: 120 passages" in capsys.readouterr().out
    assert main(args) == 0  # the same data again is fine

    async def check() -> None:
        async with open_store(store_url, environ=store_env) as store:
            task = load_task(await store.get_bytes(RunLayout(RUN).task_data("search", "train")))
            assert isinstance(task, Search) and len(task) == 30 and task.config.top_k == 2
            assert task.config.index["passages"] == 120
            retriever = await open_run_index(store, RUN, task, tmp_path / "worker-cache")
            tool = SearchTool(task, store, RUN, tmp_path / "tool-cache")
            bodies = await asyncio.gather(*(tool(q.question) for q in data.qa[:3]))
            for body, q in zip(bodies, data.qa, strict=False):
                assert body.startswith("Doc 1: ") and q.answer in body.split("\n")[0]
                assert len(body) <= task.config.max_observation_chars
            assert task.tool_format is not None and task.tool_format.call_close == "</search>"
        for item, q in zip(task.items, data.qa, strict=True):
            assert decode_label(item.label) == (q.answer,)
            top = retriever.search(item.prompt, task.config.top_k)[0]
            assert top.index == q.passage and q.answer in top.text
            assert task.reward(f"<answer>{q.answer}</answer>", item.label) == 1.0

    asyncio.run(check())


def test_cli_prepare_search_synthetic_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    base = ["task", "prepare", "search", "--store", url, "--run", RUN]
    assert main([*base, "--synthetic", "20", "--seed", "3"]) == 0
    task = asyncio.run(_load(url, "train"))
    assert len(task) == 20 and task.meta["seed"] == 3 and task.config.index["passages"] == 80
    assert main([*base, "--synthetic", "21", "--seed", "3"]) == 1  # another index: refused
    assert "immutable" in capsys.readouterr().err
    assert main(base) == 1  # no files, no --synthetic
    files = ["task", "prepare", "search", str(tmp_path / "missing.jsonl"), str(tmp_path / "corpus.jsonl")]
    assert main([*files[:4], *base[3:], "--synthetic", "5"]) == 1
    assert main([*files, *base[3:]]) == 1
    assert "missing.jsonl" in capsys.readouterr().err


async def _load(url: str, split: str) -> Search:
    async with open_store(url) as store:
        task = load_task(await store.get_bytes(RunLayout(RUN).task_data("search", split)))
    assert isinstance(task, Search)
    return task


async def test_prepare_builds_in_the_work_dir(store: Store, tmp_path: Path) -> None:
    from slime_stoa.tasks.search.prepare import prepare_search
    from slime_stoa.tasks.search.synthetic import task_items

    data = generate(20, seed=4)
    work = tmp_path / "work"
    work.mkdir()
    during: list[list[str]] = []
    prepared = await prepare_search(store, RUN, {"train": task_items(data)}, iter(data.passages), chunk_bytes=SMALL_CHUNK,
                                    work_dir=work, on_passages=lambda _: during.append([p.name for p in work.iterdir()]))
    assert prepared.passages == 80
    assert len(during) == 1 and len(during[0]) == 1 and during[0][0].startswith("stoa-index-")  # the build, under work
    assert list(work.iterdir()) == []  # and gone after the upload
    with pytest.raises(ValueError, match="work folder"):
        await prepare_search(store, RUN, {"train": task_items(data)}, iter(data.passages), work_dir=tmp_path / "missing")


def test_cli_refuses_a_missing_work_dir(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    (tmp_path / "bucket").mkdir()
    assert main(["task", "prepare", "search", "--store", url, "--run", RUN, "--synthetic", "5", "--work-dir", str(tmp_path / "missing")]) == 1
    assert "--work-dir" in capsys.readouterr().err
