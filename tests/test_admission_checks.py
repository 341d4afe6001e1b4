"""Admission checks beyond the validator: published weights, replays, finish reasons with the tokenizer."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import numpy as np
import pytest

from slime_stoa.judging.scoring import Rescorer
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import published_digests
from slime_stoa.protocol.pulse.publisher import Publisher
from slime_stoa.protocol.records import RolloutGroup, Sample, SamplingParams, encode_group
from slime_stoa.protocol.store import Store
from slime_stoa.protocol.validate import RecordLimits, RecordRejected
from slime_stoa.tasks import make_task
from slime_stoa.tasks.synthetic import generate_items
from slime_stoa.trainer.consumer.admission import (
    ALL_REASONS,
    CONSUMER_REASONS,
    UnpublishedVersion,
    check_published,
    judge_record,
)
from slime_stoa.trainer.consumer.state import ConsumerState, ReplayLedger, content_digest

RUN = "run-1"
LAYOUT = RunLayout(RUN)
ITEMS = generate_items(4, seed=1)
TASK = make_task("synthetic", ITEMS)
EOS = 10  # token ids 0-9 decode to digits, 10 is the end of sequence, 11+ to letters
MAX_TOKENS = 6
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, stop=("z",))
LIMITS = RecordLimits(vocab_size=64, expected_run=RUN, expected_sampling=SAMPLING)
DIGESTS = {1: "ab" * 16, 2: "cd" * 16}
NOW = 1_700_000_000.0


def decode(tokens: Any) -> str:
    return "".join(str(t) if t < 10 else "<eos>" if t == EOS else chr(ord("a") + t - 11) for t in tokens)


RESCORER = Rescorer(task=TASK, decode=decode, eos_ids=frozenset({EOS}))


def sample(tokens: list[int], finish: str = "stop", logprob: float = -0.5) -> Sample:
    return Sample(response_tokens=tokens, logprobs=[logprob] * len(tokens), finish_reason=finish, reward=0.0)


def group(**kw: Any) -> RolloutGroup:
    label = int(ITEMS[0].label)
    fields: dict[str, Any] = dict(
        kind="train", run=RUN, task_id=TASK.name, prompt_index=0, prompt_tokens=[1, 2, 3],
        samples=[sample([label, EOS]), sample([(label + 1) % 10, EOS], logprob=-0.25)],
        weight_version=1, state_digest=DIGESTS[1], sampling=SAMPLING, worker_id="mac-01", seq=1,
        started_at=NOW - 2, finished_at=NOW - 1,
    )
    return RolloutGroup(**{**fields, **kw})


def judge(g: RolloutGroup, *, ts: int = 1_700_000_000_000, worker: str | None = None, seq: int | None = None,
          data: bytes | None = None, **kw: Any) -> Any:
    key = LAYOUT.rollout(worker or g.worker_id, ts, g.seq if seq is None else seq)
    parsed = LAYOUT.parse_rollout(key)
    assert parsed is not None
    name = key[len(LAYOUT.rollouts_prefix()) :]
    return judge_record(name, encode_group(g) if data is None else data, key=parsed, limits=LIMITS,
                        rescorer=RESCORER, reward_tolerance=1e-6, now=NOW, **kw)


def reason(fn: Any) -> str:
    with pytest.raises(RecordRejected) as info:
        fn()
    assert info.value.reason in ALL_REASONS
    return info.value.reason


# -- published weights ---------------------------------------------------------------------------


def test_records_must_claim_published_weights() -> None:
    assert {"version", "digest", "duplicate"} <= CONSUMER_REASONS
    check_published(group(), DIGESTS)
    assert reason(lambda: check_published(group(weight_version=3, state_digest="ef" * 16), DIGESTS)) == "version"
    assert reason(lambda: check_published(group(state_digest=DIGESTS[2]), DIGESTS)) == "digest"
    with pytest.raises(UnpublishedVersion) as info:  # it names the version the record claims
        check_published(group(weight_version=3, state_digest="ef" * 16), DIGESTS)
    assert (info.value.reason, info.value.version) == ("version", 3)
    assert judge(group(), published=DIGESTS).group == group()
    assert reason(lambda: judge(group(weight_version=5), published=DIGESTS)) == "version"
    assert reason(lambda: judge(group(state_digest="ef" * 16), published=DIGESTS)) == "digest"
    assert judge(group(state_digest="ef" * 16)).group.weight_version == 1  # None: not checked


# -- replays ----------------------------------------------------------------------------------------


def test_replays_under_another_key_or_sequence_number_are_duplicates() -> None:
    ledger = ReplayLedger()
    first = group()
    judge(first, replay=ledger)
    assert len(ledger) == 1
    # the very same bytes under another key (another timestamp): same worker and seq
    assert reason(lambda: judge(first, ts=1_700_000_000_500, replay=ledger)) == "duplicate"
    # re-encoded with another sequence number, worker, timestamps: same content
    again = msgspec.structs.replace(first, seq=2, worker_id="mac-02", started_at=NOW - 5, finished_at=NOW - 4)
    assert reason(lambda: judge(again, replay=ledger)) == "duplicate"
    # shuffled samples, relabelled to newer weights, other worker rewards
    shuffled = msgspec.structs.replace(
        first, seq=3, weight_version=2, state_digest=DIGESTS[2],
        samples=tuple(msgspec.structs.replace(s, reward=9.0) for s in reversed(first.samples)),
    )
    assert content_digest(shuffled) == content_digest(first)
    assert reason(lambda: judge(shuffled, replay=ledger, published=DIGESTS)) == "duplicate"
    # same worker and seq, new content, another key: still a replay of the pair
    other = group(samples=[sample([3, EOS]), sample([4, EOS])])
    assert reason(lambda: judge(other, ts=1_700_000_000_900, replay=ledger)) == "duplicate"
    # judged again under its own key (a restored reuse-ledger entry): admitted
    assert judge(first, replay=ledger).group == first
    # genuinely new records: admitted
    judge(msgspec.structs.replace(other, seq=7), replay=ledger)
    judge(group(seq=8, prompt_index=1), replay=ledger)
    assert len(ledger) == 3
    # a rejected record is not remembered
    assert reason(lambda: judge(group(seq=9, samples=[sample([5, 6], finish="length")] * 2), replay=ledger))
    assert len(ledger) == 3


def test_content_digest_covers_what_is_learned() -> None:
    base = content_digest(group())
    assert content_digest(group(prompt_index=1)) != base
    assert content_digest(group(prompt_tokens=[1, 2, 4])) != base
    assert content_digest(group(task_id="other")) != base
    assert content_digest(group(samples=[sample([1, EOS]), sample([2, EOS], logprob=-0.2500001)])) != base
    logprob_bits = group(samples=[sample([int(ITEMS[0].label), EOS]), sample([(int(ITEMS[0].label) + 1) % 10, EOS], logprob=-0.0)])
    assert content_digest(logprob_bits) != base


def test_the_ledger_is_bounded_and_forgets_the_oldest() -> None:
    ledger = ReplayLedger(capacity=3)
    groups = [group(seq=i, prompt_index=i % 4, samples=[sample([i % 10, EOS]), sample([11 + i, EOS])]) for i in range(5)]
    for i, g in enumerate(groups):
        ledger.add(g, f"name-{i}")
    assert len(ledger) == 3
    assert ledger.problem(msgspec.structs.replace(groups[0], seq=100), "x") is None  # forgotten
    assert ledger.problem(msgspec.structs.replace(groups[4], seq=100), "x") is not None
    with pytest.raises(ValueError):
        ReplayLedger(capacity=0)


def test_the_ledger_is_saved_with_the_consumer_state() -> None:
    state = ConsumerState(run=RUN)
    for i in range(4):
        state.replay.add(group(seq=i, samples=[sample([i, EOS]), sample([i + 1, EOS])]), f"n{i}")
    doc = json.loads(json.dumps(state.to_json()))
    back = ConsumerState.from_json(doc)
    assert back == state and len(back.replay) == 4
    assert back.replay.problem(group(seq=0, worker_id="mac-09", samples=[sample([0, EOS]), sample([1, EOS])]), "z")
    # a state saved before the ledger existed: same format, empty ledger
    old = {k: v for k, v in doc.items() if k != "replay"}
    assert len(ConsumerState.from_json(old).replay) == 0
    assert len(ReplayLedger.from_json(doc["replay"], capacity=2)) == 2  # the newest entries
    for bad in (5, "not base64!", "AAAA"):
        with pytest.raises(ValueError):
            ConsumerState.from_json({**doc, "replay": bad})


# -- finish reasons, with the tokenizer ---------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, finish, ok",
    [
        ([1, 2, 3, 4, 5, EOS], "stop", True),  # EOS at the limit
        ([1, 2, 3, 4, 5, 36], "stop", True),  # the stop string "z" completed at the limit
        ([1, 2, 3, 4, 5, 6], "stop", False),  # at the limit with neither: it was cut, not stopped
        ([1, 2, 3, 4, 5, 6], "length", True),
        ([1, 2, 3, 4, 5, EOS], "length", False),  # drew EOS at the limit: the worker says "stop"
        ([1, 2, 36, 4, 5, 6], "length", False),  # holds the stop string: it would have stopped there
        ([1, 2], "stop", True),  # below the limit: stopped, however
    ],
)
def test_finish_reasons_must_match_the_tokens(tokens: list[int], finish: str, ok: bool) -> None:
    g = group(samples=[sample(tokens, finish), sample([1, EOS])])
    if ok:
        assert judge(g).group == g
    else:
        assert reason(lambda: judge(g)) == "finish_mismatch"
    unknown = dataclasses.replace(RESCORER, eos_ids=frozenset())
    assert unknown.finish_problem(g.samples[0].response_tokens, finish, "", g) is None  # EOS ids unknown: skipped


# -- what the trainer published -----------------------------------------------------------------


async def test_published_digests_follow_the_committed_chain(store: Store) -> None:
    assert await published_digests(store, RUN, depth=4) == {}
    pub = Publisher(store, RUN)
    rng = np.random.default_rng(0)
    state = {"w": rng.integers(0, 1 << 16, size=(16, 8), dtype=np.uint16)}
    digests = {}
    for v in range(4):
        state = {"w": state["w"].copy()}
        state["w"][v] ^= 1
        await pub.publish(state)
        digests[v] = pub.state_digest
    assert await published_digests(store, RUN, depth=2) == {3: digests[3], 2: digests[2]}
    published = await published_digests(store, RUN, depth=10)
    assert published == digests
    check_published(group(weight_version=2, state_digest=digests[2]), published)
    assert reason(lambda: check_published(group(weight_version=2, state_digest=digests[1]), published)) == "digest"
