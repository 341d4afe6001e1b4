"""macd.curriculum (which prompts a worker draws, which groups it keeps) and its run manifest fields."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from macd.curriculum import PromptPicker, all_correct, has_signal
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.tasks import TaskItem

ITEMS = [TaskItem(index=i, prompt=f"q{i}", label=str(i)) for i in range(6)]


def test_signal_and_correctness() -> None:
    assert has_signal([0.0, 1.0, 0.0]) and not has_signal([1.0, 1.0]) and not has_signal([0.25] * 4)
    assert all_correct([1.0, 1.0]) and not all_correct([1.0, 0.5]) and not all_correct([])


def test_every_prompt_once_per_pass() -> None:
    picker = PromptPicker(ITEMS, random.Random(0))
    first, second = [picker.draw() for _ in ITEMS], [picker.draw() for _ in ITEMS]
    assert sorted(i.index for i in first) == sorted(i.index for i in second) == list(range(6))
    assert first != second  # a new order every pass


def test_a_prompt_solved_n_times_in_a_row_is_skipped() -> None:
    picker = PromptPicker(ITEMS, random.Random(1), skip_solved_after=2)
    a, b = ITEMS[0], ITEMS[1]
    picker.record(a, [1.0, 1.0])
    picker.record(a, [1.0, 0.0])  # the streak starts over
    picker.record(a, [1.0, 1.0])
    assert picker.solved == 0
    picker.record(a, [1.0, 1.0])
    picker.record(b, [1.0, 1.0])
    picker.record(b, [1.0, 1.0])
    assert picker.solved == 2
    drawn = Counter(picker.draw().index for _ in range(40))
    assert set(drawn) == {2, 3, 4, 5} and set(drawn.values()) == {10}


def test_when_every_prompt_is_solved_all_are_drawn_again() -> None:
    picker = PromptPicker(ITEMS, random.Random(2), skip_solved_after=1)
    for item in ITEMS:
        picker.record(item, [1.0, 1.0, 1.0])
    assert picker.solved == len(ITEMS)
    assert {picker.draw().index for _ in range(12)} == set(range(6))


def test_without_the_option_nothing_is_skipped() -> None:
    picker = PromptPicker(ITEMS, random.Random(3))
    for _ in range(5):
        picker.record(ITEMS[0], [1.0, 1.0])
    assert picker.solved == 0 and {picker.draw().index for _ in range(6)} == set(range(6))
    with pytest.raises(ValueError):
        PromptPicker([], random.Random(0))
    with pytest.raises(ValueError):
        PromptPicker(ITEMS, random.Random(0), skip_solved_after=-1)


def test_run_manifest_fields_round_trip_and_old_manifests_read_as_off() -> None:
    m = RunManifest(run="r", model="m", task="gsm8k", dynamic_sampling=True, skip_solved_after=3)
    back = RunManifest.from_bytes(m.to_bytes())
    assert (back.dynamic_sampling, back.skip_solved_after) == (True, 3)
    doc = json.loads(m.to_bytes())
    del doc["dynamic_sampling"], doc["skip_solved_after"]  # written before the fields existed
    old = RunManifest.from_bytes(json.dumps(doc).encode())
    assert (old.dynamic_sampling, old.skip_solved_after) == (False, 0)
    for bad in ({"dynamic_sampling": 1}, {"skip_solved_after": -1}, {"skip_solved_after": True}):
        with pytest.raises(ValueError):
            RunManifest.from_bytes(json.dumps({**doc, **bad}).encode())


def test_stoa_run_create_sets_them(tmp_path, capsys: pytest.CaptureFixture) -> None:
    from slime_stoa.cli import main

    url = f"file://{tmp_path}"
    base = ["run", "create", "--store", url, "--model", "tiny", "--task", "synthetic"]
    assert main([*base, "--run", "on", "--dynamic-sampling", "--skip-solved-after", "2"]) == 0
    assert main([*base, "--run", "off"]) == 0
    capsys.readouterr()
    shown = {}
    for run in ("on", "off"):
        assert main(["run", "show", "--store", url, "--run", run]) == 0
        shown[run] = RunManifest.from_bytes(capsys.readouterr().out.encode())
    assert (shown["on"].dynamic_sampling, shown["on"].skip_solved_after) == (True, 2)
    assert (shown["off"].dynamic_sampling, shown["off"].skip_solved_after) == (False, 0)
    assert main([*base, "--run", "bad", "--skip-solved-after", "-1"]) == 1
    assert "skip_solved_after" in capsys.readouterr().err
