"""scripts/easy_sums.py: the one-step sums the real model's learning run trains on, in GSM8K's
layout, with a held-out split no training problem repeats."""

from __future__ import annotations

from pathlib import Path

from slime_stoa.tasks.gsm8k import GSM8K, load_gsm8k_jsonl
from tests.scripts_loader import load_script

easy_sums = load_script("easy_sums")


def test_the_splits_load_as_gsm8k_and_share_no_problem(tmp_path: Path) -> None:
    assert easy_sums.main([str(tmp_path / "d")]) == 0
    train = load_gsm8k_jsonl(tmp_path / "d" / "train.jsonl")
    test = load_gsm8k_jsonl(tmp_path / "d" / "test.jsonl")
    assert (len(train), len(test)) == (284, 256)
    assert not {item.prompt for item in train} & {item.prompt for item in test}
    task = GSM8K(test)
    for item in test:  # each label is the sum its question asks for, and the reference answer scores 1
        a, b = (int(x) for x in item.prompt.removeprefix("What is ").removesuffix("?").split(" + "))
        assert item.label == str(a + b) and task.reward(f"{a} + {b} = {a + b}", item.label) == 1.0
    assert easy_sums.sums() == easy_sums.sums()  # a fixed seed: the same data on every machine
