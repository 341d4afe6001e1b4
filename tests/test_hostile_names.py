"""Hostile names from the bucket: every reader refuses them, and nothing is written outside its folder.

Every Mac holds a token that can write to the bucket, so any name, key or path read from an
object is hostile until checked against the layout grammar. `HOSTILE_NAMES` is the corpus (kept at
module level, reusable by a security report); each test throws all of it at one reader.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from slime_stoa.protocol.heartbeat import Heartbeat
from slime_stoa.protocol.hf.folders import INDEX_NAME, load_hf_state, safe_child
from slime_stoa.protocol.layout import RunLayout, check_name, check_worker_id
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.codec import diff, shapes_of
from slime_stoa.protocol.pulse.frames import encode_delta
from slime_stoa.protocol.pulse.manifests import (
    AnchorFile,
    AnchorManifest,
    ManifestError,
    PatchRef,
    Pointer,
    Ref,
    VersionManifest,
)
from slime_stoa.protocol.records import (
    RolloutGroup,
    Sample,
    SamplingParams,
    encode_group,
    encode_payload,
    frame_payload,
)
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordLimits, RecordRejected, load_record

#: (label, name): names no reader may accept as a run, task, file or worker name, key segment or
#: file name. Labels are ASCII and unique (test ids).
HOSTILE_NAMES: list[tuple[str, str]] = [
    ("dotdot", ".."),
    ("dot", "."),
    ("dotdot-path", "../../etc/passwd"),
    ("dotdot-suffix", "a/.."),
    ("absolute", "/etc/passwd"),
    ("absolute-windows", "C:\\Windows\\win.ini"),
    ("nul-byte", "config\x00.json"),
    ("backslash", "a\\b"),
    ("backslash-dotdot", "..\\..\\x"),
    ("slash", "a/b"),
    ("trailing-slash", "config.json/"),
    ("fullwidth-solidus", "a\uff0fb"),
    ("division-slash", "a\u2215b"),
    ("fraction-slash", "a\u2044b"),
    ("one-dot-leader", "\u2024\u2024"),
    ("one-dot-leader-path", "\u2024\u2024\u2215etc"),
    ("fullwidth-dot", "\uff0e\uff0e"),
    ("rtl-override", "model\u202enosj.exe"),
    ("zero-width-space", "config\u200b.json"),
    ("cyrillic-lookalike", "c\u043enfig.json"),
    ("very-long", "a" * 300),
    ("long-65", "b" * 65),
    ("empty", ""),
    ("space", " "),
    ("whitespace", " \t\n"),
    ("tab", "a\tb"),
    ("newline-end", "name\n"),
    ("crlf", "name\r\n"),
    ("leading-space", " name"),
    ("trailing-space", "name "),
    ("trailing-dot", "name."),
    ("trailing-dots", "name.."),
    ("leading-dot", ".hidden"),
    ("leading-dash", "-rf"),
    ("device-con", "CON"),
    ("device-nul", "nul"),
    ("device-aux-ext", "aux.json"),
    ("device-com1", "COM1"),
    ("device-lpt9-ext", "lpt9.txt"),
    ("device-prn", "Prn"),
    ("colon-stream", "config.json:evil"),
    ("tilde-home", "~"),
    ("percent-encoded", "%2e%2e%2f"),
    ("star", "*"),
    ("question", "a?b"),
    ("quote", 'a"b'),
    ("lt-gt", "<a>"),
    ("pipe", "a|b"),
    ("escape", "\x1b[31m"),
    ("del", "a\x7fb"),
    ("surrogate", "a\udcffb"),
    ("non-ascii-letter", "mod\u00e8l"),
]

assert len({label for label, _ in HOSTILE_NAMES}) == len(HOSTILE_NAMES)
NAMES = [name for _, name in HOSTILE_NAMES]
IDS = [label for label, _ in HOSTILE_NAMES]
hostile = pytest.mark.parametrize("name", NAMES, ids=IDS)

RUN = "run-1"
LAYOUT = RunLayout(RUN)
ATTEMPT = "0badcafe"
DIGEST = "ab" * 16


# -- the grammar ---------------------------------------------------------------------------------


@hostile
def test_check_name_and_worker_id_refuse(name: str) -> None:
    for kind in ("run", "task", "file"):
        with pytest.raises(ValueError, match=f"invalid {kind} name"):
            check_name(kind, name)
    with pytest.raises(ValueError, match="invalid worker id"):
        check_worker_id(name)
    with pytest.raises(ValueError):
        safe_child("folder", name)


@hostile
def test_layout_builds_no_key_from_them(name: str) -> None:
    with pytest.raises(ValueError):
        RunLayout(name)
    for build in (
        lambda: LAYOUT.anchor_file(1, ATTEMPT, name),
        lambda: LAYOUT.task_file("gsm8k", name),
        lambda: LAYOUT.task_file(name, "train.jsonl.zst"),
        lambda: LAYOUT.task_data("gsm8k", name),
        lambda: LAYOUT.trainer_file(name),
        lambda: LAYOUT.heartbeat(name),
        lambda: LAYOUT.rollout(name, 1, 1),
        lambda: LAYOUT.version_manifest(1, name),
    ):
        with pytest.raises(ValueError):
            build()


@hostile
def test_layout_parses_no_key_holding_them(name: str) -> None:
    v = "000000000001"
    assert LAYOUT.parse_version_manifest(f"{LAYOUT.versions_prefix}{name}.json") is None
    assert LAYOUT.parse_anchor_file(f"{LAYOUT.anchors_prefix}{v}-{ATTEMPT}/{name}") is None
    assert LAYOUT.parse_anchor_manifest(f"{LAYOUT.anchors_prefix}{name}/manifest.json") is None
    assert LAYOUT.parse_patch(f"{LAYOUT.patches_prefix}{v}-{ATTEMPT}/{name}") is None
    assert LAYOUT.parse_rollout(f"{LAYOUT.rollouts_prefix()}1700000000000-{name}-0000000001.rec") is None


def test_good_names_still_pass() -> None:
    for name in ("gsm8k", "run-1", "Qwen2.5_1.5B", "model.safetensors.index.json", "a..b", "con1", "console"):
        assert check_name("file", name) == name
    for worker in ("mac-01", "studio-1-a1b2c3", "con-1", "nul0"):
        assert check_worker_id(worker) == worker


# -- run manifest and heartbeats --------------------------------------------------------------------


@hostile
def test_run_manifest_refuses_them(name: str) -> None:
    good = json.loads(RunManifest(run=RUN, model="tiny", task="gsm8k").to_bytes())
    for field in ("run", "task", "task_split"):
        with pytest.raises(ValueError) as info:
            RunManifest.from_bytes(json.dumps({**good, field: name}).encode())
        assert type(info.value) is ValueError


@hostile
def test_heartbeat_refuses_them_as_worker_id(name: str) -> None:
    doc = json.loads(Heartbeat(worker_id="mac-01", name="studio", status="generating").to_bytes())
    with pytest.raises(ValueError) as info:
        Heartbeat.from_bytes(json.dumps({**doc, "worker_id": name}).encode())
    assert type(info.value) is ValueError
    with pytest.raises(ValueError, match="under worker"):
        Heartbeat.from_bytes(json.dumps(doc).encode(), worker="mac-02")


def test_heartbeat_free_text_is_made_safe_to_print() -> None:
    beat = Heartbeat(worker_id="mac-01", name="a\u202eb", status="x\x1b[2J", last_error="line\nnext" + "e" * 5000)
    back = Heartbeat.from_bytes(beat.to_bytes(), worker="mac-01")
    assert back.name.isprintable() and back.status.isprintable() and back.last_error.isprintable()
    assert len(back.last_error) <= 2000 and back.last_error.startswith("line\ufffdnext")


@pytest.mark.parametrize(
    "doc",
    [
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "worker_id": "b", "name": "x", "status": "s"}',
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "name": "x", "status": "s", "tokens_per_s": NaN}',
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "name": "x", "status": "s", "errors": true}',
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "name": "x", "status": "s", "errors": -1}',
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "name": "x", "status": 5}',
        b'{"format": "stoa.heartbeat/1", "worker_id": "a", "status": "s"}',
        b"[" * 100_000,
    ],
    ids=["duplicate-key", "nan", "bool-count", "negative-count", "int-status", "no-name", "deep"],
)
def test_heartbeat_refuses_malformed_documents(doc: bytes) -> None:
    with pytest.raises(ValueError) as info:
        Heartbeat.from_bytes(doc)
    assert type(info.value) is ValueError


# -- weight-plane documents -------------------------------------------------------------------------


def _index_and_bytes() -> tuple[Any, int]:
    base = {"w": np.zeros(8, dtype=np.uint16)}
    new = {"w": np.arange(8, dtype=np.uint16)}
    index, body = encode_delta(diff(base, new), shapes_of(new), base=base, mode="abs")
    return index, len(body)


INDEX, BODY_BYTES = _index_and_bytes()


def anchor_ref(version: int = 0) -> Ref:
    return Ref(version=version, manifest=LAYOUT.anchor_manifest(version, ATTEMPT), state_digest=DIGEST)


def version_manifest(version: int = 1) -> VersionManifest:
    step = PatchRef(
        kind="step", key=LAYOUT.patch(version, ATTEMPT, "step", version - 1), bytes=BODY_BYTES,
        count=INDEX.count, base_min=version - 1, base_max=version - 1, base_digest=DIGEST, index=INDEX,
    )
    return VersionManifest(
        run=RUN, version=version, attempt=ATTEMPT, state_digest=DIGEST,
        parent=Ref(version=version - 1, manifest=LAYOUT.version_manifest(version - 1, ATTEMPT), state_digest=DIGEST),
        anchor=anchor_ref(0), anchor_bytes=100, since_anchor_bytes=10, patches=(step,), elements=8, created_at=1.0,
    )


def anchor_file(name: str, version: int = 0) -> AnchorFile:
    return AnchorFile(name=name, key=LAYOUT.anchor_file(version, ATTEMPT, name), bytes=2, xxh3=DIGEST)


def anchor_manifest(extras: tuple[AnchorFile, ...] = ()) -> AnchorManifest:
    return AnchorManifest(
        run=RUN, version=0, attempt=ATTEMPT, state_digest=DIGEST,
        weights=(anchor_file("model.safetensors"),), extras=extras or (anchor_file("config.json"),), created_at=1.0,
    )


def pointer() -> Pointer:
    return Pointer(
        run=RUN, version=1, state_digest=DIGEST, manifest=LAYOUT.version_manifest(1, ATTEMPT), anchor=anchor_ref(0),
        updated_at=1.0,
    )


def edit(doc: bytes, path: str, value: Any) -> bytes:
    """`doc` (JSON) with the field at dotted `path` (list indices as numbers) set to `value`."""
    tree = json.loads(doc)
    *parents, last = path.split(".")
    node = tree
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[int(last) if isinstance(node, list) else last] = value
    return json.dumps(tree).encode()


def manifest_error(parse: Any, data: bytes) -> ManifestError:
    with pytest.raises(ManifestError) as info:
        parse(data)
    return info.value


def test_the_valid_documents_parse() -> None:
    v = version_manifest()
    assert VersionManifest.from_bytes(v.to_bytes(), "v", key=LAYOUT.version_manifest(1, ATTEMPT)) == v
    a = anchor_manifest()
    assert AnchorManifest.from_bytes(a.to_bytes(), "a", key=LAYOUT.anchor_manifest(0, ATTEMPT)) == a
    assert Pointer.from_bytes(pointer().to_bytes(), run=RUN) == pointer()


@hostile
def test_pointer_refuses_them(name: str) -> None:
    data = pointer().to_bytes()
    for path, value in [
        ("run", name),
        ("manifest", name),
        ("manifest", f"{LAYOUT.versions_prefix}{name}.json"),
        ("manifest", f"runs/{RUN}/versions/{name}/../000000000001-{ATTEMPT}.json"),
        ("anchor.manifest", f"{LAYOUT.anchors_prefix}{name}/manifest.json"),
        ("anchor.manifest", name),
    ]:
        manifest_error(Pointer.from_bytes, edit(data, path, value))


@hostile
def test_version_manifest_refuses_them(name: str) -> None:
    data = version_manifest().to_bytes()
    for path, value in [
        ("run", name),
        ("attempt", name),
        ("patches.0.key", name),
        ("patches.0.key", f"{LAYOUT.patches_prefix}000000000001-{ATTEMPT}/{name}"),
        ("patches.0.key", f"{LAYOUT.patches_prefix}{name}/step-000000000000.pulse"),
        ("parent.manifest", f"{LAYOUT.versions_prefix}{name}.json"),
        ("anchor.manifest", f"{LAYOUT.anchors_prefix}000000000000-{ATTEMPT}/{name}"),
    ]:
        manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(data, path, value))


@hostile
def test_anchor_manifest_refuses_them_as_file_names(name: str) -> None:
    data = anchor_manifest().to_bytes()
    prefix = LAYOUT.anchor_prefix(0, ATTEMPT)
    for path, value in [
        ("extras.0.name", name),
        ("weights.0.name", name),
        ("run", name),
        ("attempt", name),
        ("extras.0.key", prefix + name),
    ]:
        manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), edit(data, path, value))
    # Name and key agreeing does not help: the name itself is refused.
    both = edit(edit(data, "extras.0.name", name), "extras.0.key", prefix + name)
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), both)


OTHER_RUN_KEYS = [
    ("other-run", "runs/other/versions/000000000001-0badcafe.json"),
    ("no-run", "versions/000000000001-0badcafe.json"),
    ("arbitrary", "runs/run-1/trainer/consumer.json"),
    ("rollout", "runs/run-1/rollouts/1700000000000-mac-0000000001.rec"),
    ("wrong-version", "runs/run-1/versions/000000000007-0badcafe.json"),
    ("dotdot-run", "runs/run-1/../other/versions/000000000001-0badcafe.json"),
]


@pytest.mark.parametrize("key", [k for _, k in OTHER_RUN_KEYS], ids=[i for i, _ in OTHER_RUN_KEYS])
def test_documents_name_only_keys_of_their_own_run(key: str) -> None:
    manifest_error(Pointer.from_bytes, edit(pointer().to_bytes(), "manifest", key))
    v = version_manifest(2).to_bytes()
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "parent.manifest", key))
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "patches.0.key", key))
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "anchor.manifest", key))
    a = anchor_manifest().to_bytes()
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), edit(a, "extras.0.key", key))


def test_documents_must_belong_where_they_were_read() -> None:
    v = version_manifest(1).to_bytes()
    for key in (
        "runs/other/versions/000000000001-0badcafe.json",
        LAYOUT.version_manifest(2, ATTEMPT),
        LAYOUT.version_manifest(1, "12345678"),
    ):
        manifest_error(lambda d, k=key: VersionManifest.from_bytes(d, k, key=k), v)
    a = anchor_manifest().to_bytes()
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a", key=LAYOUT.anchor_manifest(3, ATTEMPT)), a)
    other = RunLayout("other")
    moved = edit(edit(pointer().to_bytes(), "run", "other"), "manifest", other.version_manifest(1, ATTEMPT))
    moved = edit(moved, "anchor.manifest", other.anchor_manifest(0, ATTEMPT))
    assert Pointer.from_bytes(moved).run == "other"
    manifest_error(lambda d: Pointer.from_bytes(d, run=RUN), moved)


def test_chains_cannot_loop_or_fork() -> None:
    v = version_manifest(3).to_bytes()
    own = LAYOUT.version_manifest(3, ATTEMPT)
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(edit(v, "parent.manifest", own), "parent.version", 3))
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "parent.version", 1))
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "patches.0.base_min", 1))
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), edit(v, "version", 10**12))
    two = json.loads(v)
    two["patches"].append(two["patches"][0])
    manifest_error(lambda d: VersionManifest.from_bytes(d, "v"), json.dumps(two).encode())


@pytest.mark.parametrize(
    "doc",
    [
        b'{"format": "stoa.pointer/1", "run": "a", "run": "b"}',
        b'{"format": "stoa.pointer/1", "updated_at": NaN}',
        b"[" * 100_000,
        b"\xff\xfe",
    ],
    ids=["duplicate-key", "nan", "deep", "not-utf8"],
)
def test_malformed_documents_are_manifest_errors(doc: bytes) -> None:
    for parse in (Pointer.from_bytes, lambda d: VersionManifest.from_bytes(d, "v"), lambda d: AnchorManifest.from_bytes(d, "a")):
        manifest_error(parse, doc)


def test_anchor_file_names_are_unique_and_in_their_place() -> None:
    a = anchor_manifest((anchor_file("config.json"), anchor_file("Config.json")))
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), a.to_bytes())
    a = anchor_manifest((anchor_file("manifest.json"),))
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), a.to_bytes())
    a = dataclasses.replace(anchor_manifest(), weights=(anchor_file("config.json"),))
    manifest_error(lambda d: AnchorManifest.from_bytes(d, "a"), a.to_bytes())
    a = anchor_manifest((anchor_file(INDEX_NAME), anchor_file("tokenizer.json")))
    assert AnchorManifest.from_bytes(a.to_bytes(), "a") == a


# -- writing files: download_extras against a real store ------------------------------------------


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} | {
        str(p.relative_to(root)) for p in root.rglob(".*")
    }


@hostile
async def test_download_extras_writes_nothing_outside_its_folder(name: str, store: Store, tmp_path: Path) -> None:
    """A manifest built in memory (so the parser's check is bypassed) naming a hostile extra
    file: the write site refuses it before fetching anything, and no file appears anywhere."""
    data = b"{}"
    key = LAYOUT.anchor_file(0, ATTEMPT, "config.json")
    await store.put(key, data)
    hostile_file = AnchorFile(name=name, key=key, bytes=len(data), xxh3=xxhash.xxh3_128_hexdigest(data))
    good = AnchorFile(name="config.json", key=key, bytes=len(data), xxh3=xxhash.xxh3_128_hexdigest(data))
    manifest = dataclasses.replace(anchor_manifest(), extras=(good, hostile_file))
    work = tmp_path / "work"
    folder = work / "a" / "b" / "extras"
    folder.mkdir(parents=True)
    before = _tree(tmp_path)
    with pytest.raises(ManifestError, match="extra file"):
        await download_extras(store, manifest, folder)
    assert _tree(tmp_path) == before  # not even the good file: names are checked before any write


async def test_download_extras_replaces_a_symlink_instead_of_following_it(store: Store, tmp_path: Path) -> None:
    data = b'{"vocab_size": 7}'
    key = LAYOUT.anchor_file(0, ATTEMPT, "config.json")
    await store.put(key, data)
    extra = AnchorFile(name="config.json", key=key, bytes=len(data), xxh3=xxhash.xxh3_128_hexdigest(data))
    manifest = dataclasses.replace(anchor_manifest(), extras=(extra,))
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"untouched")
    folder = tmp_path / "extras"
    folder.mkdir()
    (folder / "config.json").symlink_to(outside)
    paths = await download_extras(store, manifest, folder)
    assert paths == [folder.resolve() / "config.json"]
    assert outside.read_bytes() == b"untouched"
    assert not (folder / "config.json").is_symlink() and (folder / "config.json").read_bytes() == data


@hostile
def test_hf_index_refuses_them_as_shard_names(name: str, tmp_path: Path) -> None:
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ValueError, match=r"plain file name|must be strings"):
        load_hf_state(tmp_path)


# -- records ------------------------------------------------------------------------------------------


NOW = 1_700_000_000.0
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8)
LIMITS = RecordLimits(vocab_size=100)


def group(**kw: Any) -> RolloutGroup:
    fields: dict[str, Any] = dict(
        kind="train", run=RUN, task_id="gsm8k", prompt_index=0, prompt_tokens=[1, 2],
        samples=[Sample(response_tokens=[3, 4], logprobs=[-0.5, -0.5], finish_reason="stop", reward=1.0)] * 2,
        weight_version=1, state_digest=DIGEST, sampling=SAMPLING, worker_id="mac-01", seq=1,
        started_at=NOW - 2, finished_at=NOW - 1,
    )
    return RolloutGroup(**{**fields, **kw})


def record_with(field: str, name: str) -> tuple[bytes, str]:
    """A record whose `field` is `name`, and the reason it must be refused with. A name that is
    not valid UTF-8 (a lone surrogate) cannot be encoded: its raw bytes are put in the payload."""
    try:
        return encode_group(group(**{field: name})), "identifier"
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogatepass")
        placeholder = "x" * len(raw)
        payload = encode_payload(group(**{field: placeholder}))
        return frame_payload(payload.replace(placeholder.encode(), raw, 1)), "msgpack"


@hostile
def test_records_refuse_them_as_names(name: str) -> None:
    assert load_record(encode_group(group()), LIMITS, now=NOW) == group()
    for field in ("run", "task_id", "worker_id"):
        data, reason = record_with(field, name)
        with pytest.raises(RecordRejected) as info:
            load_record(data, LIMITS, now=NOW)
        assert info.value.reason == reason, (field, info.value)


def test_corpus_is_reusable() -> None:
    """The corpus is plain data another tool (a security report) can import and iterate."""
    assert all(isinstance(label, str) and label.isascii() and isinstance(n, str) for label, n in HOSTILE_NAMES)
    assert os.sep in "".join(NAMES) and "\x00" in "".join(NAMES)
