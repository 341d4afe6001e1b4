"""`stoa rollouts show` / `stats` on a run's bucket (a local folder) made here: the run manifest,
task and published weights, records written by the real encoder (single-turn and a tool
episode), a hostile record, a stray key and the trainer's saved state with a quarantined worker."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from slime_stoa.cli import main
from slime_stoa.cli.rollouts_show import reward_condition
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import RolloutGroup, Sample
from slime_stoa.protocol.store import open_store
from slime_stoa.trainer.consumer.persistence import write_state
from slime_stoa.trainer.consumer.quarantine import WorkerRecord
from slime_stoa.trainer.consumer.state import ConsumerState
from tests.test_consumer import ITEMS, RUN, Tiny, make_group, setup_run, tiny, upload  # noqa: F401  (tiny: fixture)


def tool_group(tiny: Tiny, seq: int) -> RolloutGroup:  # noqa: F811
    """A tool group: each sample searches once (model, observation, model) then answers."""
    base = make_group(tiny, worker="w-tool", seq=seq, prompt_index=1, weight_version=1)
    item = ITEMS[1]
    samples = []
    for i in range(len(base.samples)):
        call, obs, answer = tiny.encode("search x"), tiny.encode(" seen"), tiny.encode(item.label if i % 2 == 0 else "zz")
        tokens = call + obs + answer + [tiny.eos]
        mask = [1] * len(call) + [0] * len(obs) + [1] * (len(answer) + 1)
        lp = [0.0 if m == 0 else -0.25 - 0.01 * i for m in mask]
        samples.append(Sample(response_tokens=tokens, logprobs=lp, finish_reason="stop", reward=0.0, mask=mask, turns=2, tool_calls=1))
    return msgspec.structs.replace(base, samples=tuple(samples))


@pytest.fixture
def bucket(tmp_path: Path, tiny: Tiny) -> str:  # noqa: F811
    url = f"file://{tmp_path}"

    async def build() -> None:
        async with open_store(url) as store:
            await setup_run(store, tiny, published=1)
            t = int(time.time() * 1000) - 10_000
            await upload(store, make_group(tiny, worker="w-a", seq=0, weight_version=0), t)
            await upload(store, make_group(tiny, worker="w-a", seq=1, weight_version=1, prompt_index=2), t + 1)
            liar = make_group(tiny, worker="w-b", seq=0, weight_version=1, worker_rewards=[1.0, 1.0, 1.0, 1.0])
            liar_key = await upload(store, liar, t + 2)
            await upload(store, tool_group(tiny, seq=0), t + 3)
            forged = make_group(tiny, worker="w-c", seq=0, weight_version=1, state_digest="ab" * 32)
            await upload(store, forged, t + 4)
            layout = RunLayout(RUN)
            await store.put(layout.rollout("w-d", t + 5, 0), b"\x89STOARG\x01 not a record")
            await store.put(layout.rollouts_prefix() + "stray.txt", b"hello")
            name = liar_key[len(layout.rollouts_prefix()):]
            state = ConsumerState(
                run=RUN, cursor=name, seen={name}, ledger={name: 1},
                quarantine={"w-b": WorkerRecord(samples=8, reason="reward disagreements 0.50 over 0.20", since_ms=t)},
            )
            await write_state(store, state, None)

    asyncio.run(build())
    return url


def run_cli(*argv: str) -> int:
    return main(list(argv))


def test_show_marks_tool_turns_rewards_refusals_and_the_trainer_state(
    bucket: str, tiny: Tiny, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    base = ["rollouts", "show", "--store", bucket, "--run", RUN, "--tokenizer", str(tiny.folder)]
    assert run_cli(*base, "--limit", "20") == 0
    out, err = capsys.readouterr()
    blocks = {b.split()[0]: b for b in out.split("== ")[1:]}
    assert len(blocks) == 6  # newest first; the stray key is reported, not shown
    assert "stray.txt: not a record key name" in err
    names = [b.split()[0] for b in out.split("== ")[1:]]
    assert names == sorted(names, reverse=True)
    (tool,) = [b for b in blocks.values() if "worker w-tool" in b]
    assert "[model]\n      search x" in tool and "[tool]\n       seen" in tool
    assert "plane bf16" in tool and "2 turns, 1 tool calls" in tool
    assert "reward 0, stop" in tool  # the synthetic task matches the whole continuation exactly
    assert "logprob mean -0.250 min -0.250" in tool  # over the model's tokens only (tool tokens are 0.0)
    (liar,) = [b for b in blocks.values() if "worker w-b" in b]
    assert "reward 0 (worker said 1)" in liar
    assert "quarantined (reward disagreements 0.50 over 0.20)" in liar and "admitted, used 1 time(s)" in liar
    assert f"prompt:\n    {ITEMS[0].prompt}" in liar and f"label: {ITEMS[0].label}" in liar
    (forged,) = [b for b in blocks.values() if "worker w-c" in b]
    assert "REFUSED (digest)" in forged and "reward refused" in forged
    (garbage,) = [b for b in blocks.values() if "worker w-d" in b]
    assert "REFUSED (" in garbage and "prompt:" not in garbage
    (older_a,) = [b for b in blocks.values() if "worker w-a seq 1" in b]  # before the trainer's cursor
    assert "trainer: listed by the trainer and no longer pooled" in older_a and "REFUSED" not in older_a
    assert "trainer: not yet listed by the trainer" in tool  # after it


def test_show_filters(bucket: str, tiny: Tiny, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    base = ["rollouts", "show", "--store", bucket, "--run", RUN, "--tokenizer", str(tiny.folder), "--limit", "20"]

    def shown(*extra: str) -> list[str]:
        assert run_cli(*base, *extra) == 0
        out = capsys.readouterr().out
        return [line.split()[3] for line in out.splitlines() if line.startswith("== ")]

    assert shown("--worker", "w-a") == ["w-a", "w-a"]
    assert shown("--version", "0") == ["w-a"]
    assert sorted(shown("--version", "1")) == ["w-a", "w-b", "w-c", "w-tool"]
    assert shown("--task", "nope") == []
    assert sorted(shown("--reward", ">0.5")) == ["w-a", "w-a", "w-b"]  # the trainer's rewards; refused: none
    assert sorted(shown("--reward", "0")) == ["w-a", "w-a", "w-b", "w-tool"]
    assert shown("--limit", "1") == ["w-d"]  # the newest
    assert run_cli(*base, "--reward", "big") == 1
    assert "--reward takes a number" in capsys.readouterr().err


def test_stats_per_version(bucket: str, tiny: Tiny, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    out_json = tmp_path / "stats.json"
    args = ["rollouts", "stats", "--store", bucket, "--run", RUN, "--tokenizer", str(tiny.folder), "--json", str(out_json)]
    assert run_cli(*args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["version", "records", "refused", "samples", "reward", "len", "mean", "len", "median", "len", "max", "search"]
    assert "1 record(s) did not decode" in out
    doc = json.loads(out_json.read_text())
    v0, v1 = doc["versions"]
    assert (v0["version"], v0["records"], v0["refused"], v0["samples"], v0["reward_mean"], v0["search_rate"]) == (0, 1, 0, 4, 0.5, 0.0)
    # v1: w-a (2 of 4 right), the liar (re-scored: 2 of 4), the tool episodes (0 of 4, all searched),
    # w-c refused (its samples count nowhere)
    assert (v1["records"], v1["refused"], v1["samples"]) == (4, 1, 12)
    assert v1["reward_mean"] == pytest.approx(4 / 12) and v1["search_rate"] == pytest.approx(4 / 12)
    lengths = [len(tiny.encode(t)) + 1 for t in (ITEMS[2].label, "x")] * 2 + [len(tiny.encode(t)) + 1 for t in (ITEMS[0].label, "x")] * 2
    tool_lengths = [len(tiny.encode("search x")) + len(tiny.encode(t)) + 1 for t in (ITEMS[1].label, "zz")] * 2
    assert v1["length_max"] == max(lengths + tool_lengths)
    assert v1["length_mean"] == pytest.approx(np.mean(lengths + tool_lengths))


def test_reward_condition() -> None:
    assert reward_condition("1")(1.0) and not reward_condition("1")(0.0)
    assert reward_condition(">0.5")(0.75) and not reward_condition(">0.5")(0.5)
    assert reward_condition("<= 0.2")(0.2) and reward_condition("!=0")(1.0) and not reward_condition("!=0")(0.0)
    for bad in ("", ">", "x", "1 2"):
        with pytest.raises(ValueError):
            reward_condition(bad)


def test_bad_invocations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}"
    assert run_cli("rollouts", "stats", "--store", url, "--run", "missing") == 1
    assert capsys.readouterr().err.startswith("error: ")
