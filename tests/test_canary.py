"""Canaries: the secret subset, the strict checks, and the consumer refusing and quarantining a
worker that fails one, on both store backends."""

from __future__ import annotations

import base64
import math
import os
from pathlib import Path

import msgspec
import pytest

from slime_stoa.protocol.records import RolloutGroup
from slime_stoa.protocol.signing import KeyFileError
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.consumer.canary import (
    LOGPROB_SLACK_NATS,
    SECRET_BYTES,
    CanaryConfig,
    answer_parses,
    canary_problem,
    is_canary,
    load_or_create_secret,
    new_secret,
)
from slime_stoa.trainer.consumer.persistence import state_key
from slime_stoa.trainer.consumer.quarantine import QuarantineConfig
from tests.test_consumer import ITEMS, RUN, Tiny, make_group, now_ms, open_consumer, setup_run, tiny, upload  # noqa: F401


def with_logprobs(group: RolloutGroup, value: float) -> RolloutGroup:
    samples = tuple(msgspec.structs.replace(s, logprobs=[value] * len(s.response_tokens)) for s in group.samples)
    return msgspec.structs.replace(group, samples=samples)


def trainer_view(group: RolloutGroup, tiny: Tiny) -> tuple[list[float], list[str]]:  # noqa: F811
    """The trainer's rewards and texts of a group made by `make_group` (answers then EOS)."""
    label = ITEMS[group.prompt_index].label
    texts = [tiny.decode(list(s.response_tokens)[:-1]) for s in group.samples]
    return [float(t == label) for t in texts], texts


# -- the subset -----------------------------------------------------------------------------------
def test_the_subset_is_keyed_stable_and_of_the_asked_share() -> None:
    a, b = new_secret(), new_secret()
    picks_a = [is_canary(a, "synthetic", i, 0.1) for i in range(20_000)]
    assert picks_a == [is_canary(a, "synthetic", i, 0.1) for i in range(20_000)]  # stable
    assert abs(sum(picks_a) / 20_000 - 0.1) < 0.01  # the asked share (binomial sd ~0.002)
    picks_b = [is_canary(b, "synthetic", i, 0.1) for i in range(20_000)]
    overlap = sum(x and y for x, y in zip(picks_a, picks_b, strict=True))
    assert overlap < 0.02 * 20_000  # another secret, another subset (~1% overlap by chance)
    assert [is_canary(a, "gsm8k", i, 0.1) for i in range(20_000)] != picks_a  # keyed by task too
    assert not any(is_canary(a, "synthetic", i, 0.0) for i in range(100))
    assert all(is_canary(a, "synthetic", i, 1.0) for i in range(100))


def test_secret_file_is_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "trainer" / "canary.key"
    secret = load_or_create_secret(path)
    assert len(secret) == SECRET_BYTES and (path.stat().st_mode & 0o777) == 0o600
    assert load_or_create_secret(path) == secret
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError):
        load_or_create_secret(path)
    short = tmp_path / "short.key"
    short.write_bytes(b"abc")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match="canary secret"):
        load_or_create_secret(short)


# -- the strict checks ----------------------------------------------------------------------------
def test_strict_checks(tiny: Tiny) -> None:  # noqa: F811
    cfg = CanaryConfig(rate=1.0)
    honest = make_group(tiny, worker="mac-a", seq=1, prompt_index=3)
    rewards, texts = trainer_view(honest, tiny)
    assert canary_problem(honest, rewards=rewards, texts=texts, vocab_size=tiny.vocab, config=cfg) is None

    # A reward off by 1e-9: within the normal tolerance (1e-6), not on a canary.
    off = msgspec.structs.replace(honest, samples=(msgspec.structs.replace(honest.samples[0], reward=rewards[0] - 1e-9),
                                               *honest.samples[1:]))
    assert "worker reward" in canary_problem(off, rewards=rewards, texts=texts, vocab_size=tiny.vocab, config=cfg)

    # A positive logprob the validator lets through (float32 slack 1e-4) is refused here.
    assert "> 0" in canary_problem(with_logprobs(honest, 5e-5), rewards=rewards, texts=texts,
                                   vocab_size=tiny.vocab, config=cfg)
    assert canary_problem(with_logprobs(honest, 0.0), rewards=rewards, texts=texts, vocab_size=tiny.vocab,
                          config=cfg) is None  # a certain model: plausible

    # The band: down to -(ln V + slack) per token, not below.
    floor = -(math.log(tiny.vocab) + LOGPROB_SLACK_NATS)
    assert canary_problem(with_logprobs(honest, floor + 0.01), rewards=rewards, texts=texts, vocab_size=tiny.vocab,
                          config=cfg) is None
    problem = canary_problem(with_logprobs(honest, floor - 0.01), rewards=rewards, texts=texts,
                             vocab_size=tiny.vocab, config=cfg)
    assert problem is not None and "less likely than uniform" in problem

    # Format: off by default; asked for, half the answers must parse as one digit.
    garbled = make_group(tiny, worker="mac-a", seq=2, prompt_index=3, answers=["x", "y", ITEMS[3].label, "z"])
    g_rewards, g_texts = trainer_view(garbled, tiny)
    assert canary_problem(garbled, rewards=g_rewards, texts=g_texts, vocab_size=tiny.vocab, config=cfg) is None
    strict = CanaryConfig(rate=1.0, min_format_rate=0.5)
    assert "parse" in canary_problem(garbled, rewards=g_rewards, texts=g_texts, vocab_size=tiny.vocab, config=strict)
    assert canary_problem(honest, rewards=rewards, texts=texts, vocab_size=tiny.vocab, config=strict) is None


def test_answer_formats() -> None:
    assert answer_parses("synthetic", " 7<|im_end|>") is True
    assert answer_parses("synthetic", "seven") is False and answer_parses("synthetic", "77") is False
    assert answer_parses("gsm8k", "so the answer is #### 42") is True
    assert answer_parses("gsm8k", "no idea") is False
    assert answer_parses("some-other-task", "anything") is None  # not checked
    for bad in (dict(rate=1.5), dict(min_format_rate=-0.1), dict(max_logprob_gap=0.0), dict(rate=float("nan"))):
        with pytest.raises(ValueError):
            CanaryConfig(**bad)  # type: ignore[arg-type]


# -- the consumer, end to end -----------------------------------------------------------------------
async def test_a_failed_canary_is_refused_and_quarantines(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    await setup_run(store, tiny)
    base = now_ms() - 10_000
    await upload(store, make_group(tiny, worker="mac-h", seq=0, prompt_index=0), base)
    forged = with_logprobs(make_group(tiny, worker="mac-f", seq=0, prompt_index=1), -50.0)  # the validator admits -50
    await upload(store, forged, base + 1)
    await upload(store, make_group(tiny, worker="mac-f", seq=1, prompt_index=2), base + 2)
    await upload(store, make_group(tiny, worker="mac-h", seq=1, prompt_index=3), base + 3)
    consumer = await open_consumer(store, tiny, store_url, canary=CanaryConfig(rate=1.0), quarantine=QuarantineConfig(canary_strikes=1),
                                   download_concurrency=1)
    batch = await consumer.next_batch(2, trainer_version=0)
    assert [g.worker for g in batch.groups] == ["mac-h", "mac-h"]  # honest canaries pass and are used
    assert consumer.quarantined == {"mac-f": "canary"}
    c = consumer.counters
    assert c["rejected/canary_failed"] == 1 and c["worker/mac-f/canary_failed"] == 1
    assert c["rejected/quarantined"] == 1  # its next record
    assert batch.metrics["rollout/stoa_canary_failed"] == 1.0
    assert batch.metrics["rollout/stoa_rejected/canary_failed"] == 1.0
    assert batch.metrics["worker/mac-f/quarantined"] == 1.0
    # The bucket's copy of the state carries no secret (every worker can read it).
    await consumer.save_state()
    raw = await store.get_bytes(state_key(RUN))
    secret = consumer._trust.canary_secret
    assert secret.hex().encode() not in raw and base64.b64encode(secret) not in raw
    await consumer.close()


async def test_only_the_secret_subset_is_judged_strictly(
    store: Store, store_url: str, tiny: Tiny, tmp_path: Path  # noqa: F811
) -> None:
    await setup_run(store, tiny)
    key_file = tmp_path / "canary.key"
    consumer = await open_consumer(store, tiny, store_url, canary=CanaryConfig(rate=0.5, key_file=key_file),
                                   quarantine=QuarantineConfig(canary_strikes=1), download_concurrency=1)
    canaries = [i for i in range(len(ITEMS)) if consumer.is_canary(i)]
    plain = [i for i in range(len(ITEMS)) if not consumer.is_canary(i)]
    assert canaries and plain  # 32 prompts at 50%
    reopened = await open_consumer(store, tiny, store_url, canary=CanaryConfig(rate=0.5, key_file=key_file))
    assert [i for i in range(len(ITEMS)) if reopened.is_canary(i)] == canaries  # the same secret, the same subset
    await reopened.close()

    base = now_ms() - 10_000
    # Logprobs below the band, on a prompt that is not a canary: only the canaries' checks see it.
    await upload(store, with_logprobs(make_group(tiny, worker="mac-f", seq=0, prompt_index=plain[0]), -50.0), base)
    await upload(store, make_group(tiny, worker="mac-h", seq=0, prompt_index=plain[1]), base + 1)
    batch = await consumer.next_batch(2, trainer_version=0)
    assert sorted(g.worker for g in batch.groups) == ["mac-f", "mac-h"]
    assert consumer.quarantined == {}
    await upload(store, with_logprobs(make_group(tiny, worker="mac-f", seq=1, prompt_index=canaries[0]), -50.0), base + 2)
    await upload(store, make_group(tiny, worker="mac-h", seq=1, prompt_index=canaries[1]), base + 3)
    batch = await consumer.next_batch(1, trainer_version=0)
    assert [g.worker for g in batch.groups] == ["mac-h"]
    assert consumer.quarantined == {"mac-f": "canary"}
    await consumer.close()


async def test_a_canary_gap_measured_by_the_learner_is_a_strike(store: Store, store_url: str, tiny: Tiny) -> None:  # noqa: F811
    await setup_run(store, tiny)
    consumer = await open_consumer(store, tiny, store_url, canary=CanaryConfig(rate=0.5, max_logprob_gap=0.1),
                                   quarantine=QuarantineConfig(canary_strikes=2))
    canaries = [i for i in range(len(ITEMS)) if consumer.is_canary(i)]
    plain = [i for i in range(len(ITEMS)) if not consumer.is_canary(i)]
    assert consumer.observe_logprob_gap("mac-f", 0.3, 8, prompt_index=plain[0]) == []  # not a canary: evidence only
    assert consumer.observe_logprob_gap("mac-f", 0.1, 8, prompt_index=canaries[0]) == []  # at the limit: passes
    assert consumer.observe_logprob_gap("mac-f", 0.3, 8, prompt_index=canaries[0]) == []  # strike 1 of 2
    assert consumer.observe_logprob_gap("mac-f", 0.3, 8, prompt_index=canaries[1]) == ["mac-f"]
    assert consumer.quarantined == {"mac-f": "canary"}
    assert consumer.counters["canary_gap_failures"] == 2
    await consumer.close()
