"""The run layout owns every key."""

from __future__ import annotations

import pytest

from slime_stoa.protocol.layout import RolloutKey, RunLayout


def test_keys_are_under_the_run() -> None:
    lay = RunLayout("demo")
    assert lay.run_manifest == "runs/demo/run.json"
    assert lay.pointer == "runs/demo/current.json"
    assert lay.anchor_manifest(3, "0badcafe") == "runs/demo/anchors/000000000003-0badcafe/manifest.json"
    assert lay.version_manifest(12, "0badcafe") == "runs/demo/versions/000000000012-0badcafe.json"
    assert (
        lay.patch(12, "0badcafe", "step", 11)
        == "runs/demo/patches/000000000012-0badcafe/step-000000000011.pulse"
    )
    assert lay.heartbeat("mac-01") == "runs/demo/workers/mac-01.json"
    assert lay.task_file("gsm8k", "train.jsonl.zst") == "runs/demo/tasks/gsm8k/train.jsonl.zst"
    assert lay.task_manifest("gsm8k") == "runs/demo/tasks/gsm8k/task.json"
    assert lay.task_manifest("search") != lay.task_index_file("search", "manifest.json")
    with pytest.raises(ValueError, match="task name"):
        lay.task_manifest("../x")


def test_version_keys_sort_numerically_and_parse_back() -> None:
    lay = RunLayout("r")
    keys = [lay.version_manifest(v, "00000001") for v in (9, 10, 100, 1)]
    assert sorted(keys) == [lay.version_manifest(v, "00000001") for v in (1, 9, 10, 100)]
    assert [lay.weight_object_version(k) for k in keys] == [(v, "00000001") for v in (9, 10, 100, 1)]
    assert lay.version_manifest(9, "abcdef01").startswith(lay.version_manifests_prefix(9))
    assert lay.weight_object_version(lay.anchor_file(7, "abcdef01", "model.safetensors")) == (7, "abcdef01")
    assert lay.weight_object_version(lay.patch(7, "abcdef01", "catchup", 2)) == (7, "abcdef01")
    assert lay.weight_object_version("runs/r/versions/junk.json") is None
    assert lay.weight_object_version(lay.heartbeat("w")) is None
    with pytest.raises(ValueError, match="attempt"):
        lay.version_manifest(1, "XYZ")


def test_rollout_keys_sort_by_time_and_parse_back() -> None:
    lay = RunLayout("r")
    a = lay.rollout("mac-b", 1_700_000_000_000, 5)
    b = lay.rollout("mac-a", 1_700_000_000_001, 0)
    c = lay.rollout("mac-b", 1_700_000_000_002, 6)
    assert sorted([c, b, a]) == [a, b, c]
    assert lay.parse_rollout(a) == RolloutKey("train", 1_700_000_000_000, "mac-b", 5)
    assert lay.rollout_after(1_700_000_000_001) < b
    assert lay.parse_rollout(lay.rollout("w-1", 5, 1, kind="eval")) == RolloutKey("eval", 5, "w-1", 1)
    assert lay.parse_rollout("runs/r/rollouts/garbage.rec") is None
    assert lay.parse_rollout("runs/other/rollouts/1700000000000-w-0000000001.rec") is None


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "x" * 65, ".hidden", "sp ace"])
def test_bad_run_names(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        RunLayout(bad)


@pytest.mark.parametrize("bad", ["", "UPPER", "a_b", "-lead", "a" * 49])
def test_bad_worker_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid worker id"):
        RunLayout("r").heartbeat(bad)


def test_patches_go_forward() -> None:
    with pytest.raises(ValueError, match="forward"):
        RunLayout("r").patch(3, "00000000", "step", 3)
