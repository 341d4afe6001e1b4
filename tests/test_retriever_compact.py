"""The compact index (`compact`, `packing`, the zstd passage blocks): the same hits, scores and
order as the bm25s-array index built from the same passages, smaller files, and a damaged folder
refused with ValueError."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from slime_stoa.protocol.store import Store
from slime_stoa.tasks.search import compact, packing
from slime_stoa.tasks.search.build import build_index
from slime_stoa.tasks.search.passages import BLOCKS_FILE, ZST_FILE, BlockPassageStore, BlockPassageWriter
from slime_stoa.tasks.search.retriever import COMPACT_INDEX_FILES, Retriever
from slime_stoa.tasks.search.tokenizer import PRESETS


def zipf_corpus(n: int, vocab: int, seed: int) -> tuple[list[str], list[str], list[float]]:
    rng = random.Random(seed)
    words = [f"t{i}x" for i in range(vocab)]
    weights = [1 / (i + 1) ** 1.1 for i in range(vocab)]
    docs = [" ".join(rng.choices(words, weights, k=rng.randint(1, 150))) for _ in range(n)]
    return docs, words, weights


@pytest.mark.parametrize("encode_blocks", [1024, 3])
def test_packing_round_trips_blocks_of_every_width(encode_blocks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packing, "ENCODE_BLOCKS", encode_blocks)  # 3: the bits laid out in many pieces
    rng = np.random.default_rng(0)
    dfs = [1, 2, 127, 128, 129, 300, 2000]
    docs, tfs, starts = [], [], []
    for df in dfs:
        starts.append(sum(len(d) for d in docs))
        docs.append(np.sort(rng.choice(1 << 20, df, replace=False)))
        tfs.append(rng.integers(1, 1 << rng.integers(1, 20), df))
    all_docs, all_tfs = np.concatenate(docs), np.concatenate(tfs)
    packed, last, doc_bits, tf_bits, offsets = packing.encode(all_docs, all_tfs, np.array(starts))
    buf = np.frombuffer(packed + b"\0" * packing.PAD, dtype=np.uint8)
    counts = np.diff(np.append(packing.block_starts(np.array(starts), np.array(dfs)), len(all_docs)))
    first_of_term = np.isin(packing.block_starts(np.array(starts), np.array(dfs)), starts)
    prev = np.where(first_of_term, -1, np.concatenate(([-1], last[:-1])))
    got_docs, got_tfs = packing.decode(buf, offsets, counts, doc_bits, tf_bits, prev)
    assert got_docs.tolist() == all_docs.tolist() and got_tfs.tolist() == all_tfs.tolist()
    assert len(packed) < 0.6 * 8 * len(all_docs)  # far below 4 + 4 bytes per posting
    # one block alone decodes the same values (what a lookup does)
    j = len(last) - 2
    one_docs, _ = packing.decode(buf, offsets[j:j + 1], counts[j:j + 1], doc_bits[j:j + 1], tf_bits[j:j + 1], prev[j:j + 1])
    assert one_docs.tolist() == all_docs[int(counts[:j].sum()):int(counts[:j + 1].sum())].tolist()
    with pytest.raises(ValueError):
        packing.encode(np.array([3, 2]), np.array([1, 1]), np.array([0]))


@pytest.mark.parametrize(("preset", "shard_docs", "block_entries"), [("default", 300, 2000), ("search-r1", 10_000, 1 << 20)])
def test_compact_hits_equal_the_bm25s_index(tmp_path: Path, preset: str, shard_docs: int, block_entries: int) -> None:
    docs, words, weights = zipf_corpus(1500, 4000, seed=len(preset))
    settings = PRESETS[preset]  # type: ignore[index]
    build_index(docs, tmp_path / "arrays", settings=settings, shard_docs=shard_docs, block_entries=block_entries,
                compact_format=False)
    stats = build_index(docs, tmp_path / "compact", settings=settings, shard_docs=shard_docs, block_entries=block_entries)
    assert sorted(p.name for p in (tmp_path / "compact").iterdir()) == sorted(COMPACT_INDEX_FILES)
    arrays, small = Retriever.open(tmp_path / "arrays"), Retriever.open(tmp_path / "compact")
    assert small._index is not None and len(small._index) == stats.terms and small._vocab == {}
    rng = random.Random(7)
    compared = hits = 0
    for q in range(300):
        # rare words, common words, their mixes, repeats and unknown words
        query = " ".join(rng.choices(words, None if q % 3 == 0 else weights, k=rng.randint(1, 9)))
        if q % 5 == 0:
            query += " nosuchword " + query.split()[0]
        for k in (1, 3, 10):
            want = [(h.index, h.score, h.text) for h in arrays.search(query, k)]
            assert [(h.index, h.score, h.text) for h in small.search(query, k)] == want, (query, k)
            compared += 1
            hits += len(want)
    assert compared == 900 and hits > 2000
    assert small.search("nosuchword", 3) == [] and small.search("", 3) == []
    size = lambda folder, names: sum((folder / n).stat().st_size for n in names)  # noqa: E731
    assert size(tmp_path / "compact", [compact.POSTINGS_FILE]) < size(tmp_path / "arrays", ["data.csc.index.npy", "indices.csc.index.npy"]) / 3


def test_every_top_k_path_is_the_full_scoring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MaxScore with one and many rounds, the switch to scoring all, and scoring all from the
    start give the same top k."""
    docs, words, weights = zipf_corpus(800, 600, seed=3)
    build_index(docs, tmp_path / "c", compact_format=True)
    index = Retriever.open(tmp_path / "c")._index
    assert index is not None
    rng = random.Random(1)
    queries = [[r for w in rng.choices(words, weights, k=rng.randint(1, 8)) if (r := index.lookup(w)) is not None] for _ in range(150)]
    queries = [q for q in queries if q]
    monkeypatch.setattr(compact, "CANDIDATE_SHARE", 0)  # always score every passage
    full = [tuple(a.tolist() for a in index.top_k(q, 5)) for q in queries]
    scored_all: list[int] = []
    real_score_all = compact.score_all
    monkeypatch.setattr(compact, "score_all", lambda *a: (scored_all.append(1), real_score_all(*a))[1])
    for share, rounds, candidate_cost in ((1, 1, 2), (4, 2, 2), (10**9, 99, 2), (1, 99, 0), (1, 99, 10**6)):
        monkeypatch.setattr(compact, "CANDIDATE_SHARE", share)
        monkeypatch.setattr(compact, "MAX_ROUNDS", rounds)
        monkeypatch.setattr(compact, "CANDIDATE_COST", candidate_cost)  # 10**6: the lookups always lose
        scored_all.clear()
        assert [tuple(a.tolist() for a in index.top_k(q, 5)) for q in queries] == full
        if candidate_cost == 10**6:  # all but the queries whose terms are all decoded whole
            assert len(scored_all) > len(queries) * 3 // 4
        elif candidate_cost == 0:
            assert len(scored_all) < len(queries) // 2


def test_block_passages_random_access(tmp_path: Path) -> None:
    rng = random.Random(0)
    texts = ["".join(rng.choice("abcé αβ\n") for _ in range(rng.randint(0, 3000))) for _ in range(400)]
    writer = BlockPassageWriter(tmp_path, block_bytes=5000)
    for t in texts:
        writer.add(t)
    assert writer.close() == 400
    store = BlockPassageStore(tmp_path)
    assert len(store) == 400
    order = rng.sample(range(400), 400)
    assert [store[i] for i in order] == [texts[i] for i in order]
    with pytest.raises(IndexError):
        store[400]
    # a block whose bytes changed does not decode to its passages
    data = bytearray((tmp_path / ZST_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / ZST_FILE).write_bytes(bytes(data))
    broken = BlockPassageStore(tmp_path)
    rows = np.load(tmp_path / BLOCKS_FILE)
    block = int(np.searchsorted(rows[:, 1], len(data) // 2, side="right")) - 1
    with pytest.raises(ValueError):
        broken[int(rows[block, 0])]


def _damage(folder: Path, name: str, edit: object) -> None:
    path = folder / name
    if name.endswith(".npy"):
        arr = np.load(path)
        edit(arr)  # type: ignore[operator]
        np.save(path, arr)
    else:
        data = bytearray(path.read_bytes())
        edit(data)  # type: ignore[operator]
        path.write_bytes(bytes(data))


def _raise_df(stats: np.ndarray) -> None:
    stats["df"][0] += 1


def _move_offset(stats: np.ndarray) -> None:
    stats["offset"][-1] += 1


def _wide(blocks: np.ndarray) -> None:
    blocks["doc_bits"][0] = 40


def _bad_norm(norms: np.ndarray) -> None:
    norms[0] = 0


def _cut(data: bytearray) -> None:
    del data[-20:]


def _unsort(offsets: np.ndarray) -> None:
    offsets[1], offsets[2] = offsets[2], offsets[1]


@pytest.mark.parametrize(
    ("name", "edit"),
    [(compact.TERM_STATS_FILE, _raise_df), (compact.TERM_STATS_FILE, _move_offset), (compact.BLOCKS_FILE, _wide),
     (compact.NORMS_FILE, _bad_norm), (compact.POSTINGS_FILE, _cut), (compact.TERM_OFFSETS_FILE, _unsort)],
)
def test_a_damaged_compact_folder_is_refused_at_open(tmp_path: Path, name: str, edit: object) -> None:
    docs, _, _ = zipf_corpus(300, 500, seed=5)
    build_index(docs, tmp_path / "good", compact_format=True)
    Retriever.open(tmp_path / "good")
    shutil.copytree(tmp_path / "good", tmp_path / "bad")
    _damage(tmp_path / "bad", name, edit)
    with pytest.raises(ValueError):
        Retriever.open(tmp_path / "bad")


def test_missing_files_and_a_wrong_format_are_refused(tmp_path: Path) -> None:
    docs, _, _ = zipf_corpus(50, 50, seed=6)
    build_index(docs, tmp_path / "c", compact_format=True)
    (tmp_path / "c" / compact.NORMS_FILE).unlink()
    with pytest.raises(ValueError, match="missing"):
        Retriever.open(tmp_path / "c")
    build_index(docs, tmp_path / "d", compact_format=True)
    (tmp_path / "d" / compact.PARAMS_FILE).write_text('{"format": "stoa.bm25-compact/0"}')
    with pytest.raises(ValueError, match="not a"):
        Retriever.open(tmp_path / "d")


def test_the_build_scratch_goes_to_the_work_dir(tmp_path: Path) -> None:
    seen: list[list[str]] = []
    work = tmp_path / "scratch"
    work.mkdir()

    def passages() -> object:
        docs, _, _ = zipf_corpus(100, 50, seed=8)
        for i, d in enumerate(docs):
            if i == 99:  # the first shards are on disk by now
                seen.append(sorted(p.name for p in work.iterdir()))
            yield d

    build_index(passages(), tmp_path / "index", compact_format=True, shard_docs=10, work_dir=work)  # type: ignore[arg-type]
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith(".stoa-index-build-")
    assert list(work.iterdir()) == [] and not any(p.name.startswith(".stoa") for p in tmp_path.iterdir())


async def test_a_compact_folder_travels_through_the_bucket(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket's manifest carries the compact files (`bundle.INDEX_FILES` is
    `compact.INDEX_FILES`): upload, verified fetch and open give the same hits as the folder built
    here, and the second start opens without the scan."""
    from slime_stoa.tasks.search import bundle
    from slime_stoa.tasks.search.synthetic import generate

    assert frozenset(compact.INDEX_FILES) == bundle.INDEX_FILES
    data = generate(40, seed=9)
    folder = tmp_path / "built"
    build_index(data.passages, folder, compact_format=True)
    digest = await bundle.upload_index(store, "r", folder, passages=len(data.passages), chunk_bytes=4096)
    dest = tmp_path / "fetched"
    await bundle.fetch_index(store, "r", dest, expected_sha256=digest)
    assert bundle.verified_digest(dest) == digest
    scans: list[int] = []
    real_scan = compact.CompactIndex.scan
    monkeypatch.setattr(compact.CompactIndex, "scan", lambda self: (scans.append(1), real_scan(self))[1])
    built, fetched = Retriever.open(folder), Retriever.open(dest, scanned=True)
    assert scans == [1]  # the folder built here was scanned, the verified one was not
    for q in data.qa:
        assert [(h.index, h.score, h.text) for h in fetched.search(q.question, 3)] == \
            [(h.index, h.score, h.text) for h in built.search(q.question, 3)]
    assert sum(fetched.search(q.question, 1)[0].index == q.passage for q in data.qa) >= len(data.qa) * 3 // 4
