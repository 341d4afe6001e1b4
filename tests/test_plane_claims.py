"""The plane a worker may claim is the run's, not the record's: a quantized plane widens every
logprob-gap limit of the quarantine, so a record claiming int8 on a run that neither serves nor
publishes it (made-up logprobs 0.9 nats per token off, under int8's 0.5 allowance) is refused
(`rejected/plane`) instead of widening the bound; on a run that serves or publishes int8 the
claim is honoured. On the real store, through the consumer and the learner's gap feed."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.store import Store
from slime_stoa.trainer.consumer import ConsumerTimeout, limits_for_run
from tests.test_consumer import RUN, Tiny, make_group, now_ms, tiny
from tests.test_signed_records import SignedRun, open_signed_consumer, put, setup_signed_run, signed

__all__ = ["tiny"]  # the session fixture

#: A made-up worker's mean gap: over the bf16 limit (0.5), under int8's (0.5 + 0.5 allowance).
MADE_UP_GAP = 0.9
#: Tokens fed: past `min_gap_tokens`, so the gap is judged.
TOKENS = 10_000


def test_the_planes_a_record_may_claim_are_the_ones_the_run_serves_or_publishes() -> None:
    def allowed(**kw: Any) -> frozenset[str]:
        manifest = RunManifest(run=RUN, model="m", task="synthetic", **kw)
        return limits_for_run(manifest, vocab_size=1000).allowed_planes

    assert allowed() == {"bf16"}  # int8 is not a given: the run must serve or publish it
    assert allowed(plane="int8") == {"bf16", "int8"}  # served: workers quantize the bf16 weights
    assert allowed(planes=("int8",)) == {"bf16", "int8"}  # published beside bf16
    assert allowed(planes=("int4",)) == {"bf16", "int4"}
    assert allowed(plane="int4", planes=("int4", "int8")) == {"bf16", "int4", "int8"}


async def upload_claims(store: Store, tiny: Tiny, run: SignedRun, planes: tuple[str, ...]) -> None:
    base = now_ms() - 20_000
    for seq, plane in enumerate(planes):
        group = msgspec.structs.replace(make_group(tiny, worker="mac-a", seq=seq, prompt_index=seq), plane=plane)
        await put(store, signed(group, run.workers["mac-a"]), "mac-a", seq, base + seq)


async def test_an_int8_claim_on_a_run_that_does_not_publish_it_is_refused_and_widens_nothing(
    store: Store, store_url: str, tiny: Tiny
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",))  # a bf16 run publishing no quantized plane
    await upload_claims(store, tiny, run, ("int8", "bf16", "int8"))
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    try:
        got = await c.next_batch(1, trainer_version=0)
        assert [g.group.plane for g in got.groups] == ["bf16"]  # the honest record is used
        with pytest.raises(ConsumerTimeout):
            await c.next_batch(1, trainer_version=0)
        assert c.counters["rejected/plane"] == 2 and c.counters.get("admitted", 0) == 1
        # A gap fed for the claimed plane is judged on bf16: the made-up logprobs are quarantined.
        assert c.observe_logprob_gap("mac-a", MADE_UP_GAP, TOKENS, plane="int8") == ["mac-a"]
        assert c.counters["gap_plane_not_offered"] == 1 and c.quarantined == {"mac-a": "logprob_gap"}
    finally:
        await c.close()


@pytest.mark.parametrize("served", [dict(plane="int8"), dict(planes=("int8",))], ids=["served", "published"])
async def test_an_int8_claim_on_a_run_that_serves_or_publishes_it_is_honoured(
    store: Store, store_url: str, tiny: Tiny, served: dict[str, Any]
) -> None:
    run = await setup_signed_run(store, tiny, workers=("mac-a",), **served)
    await upload_claims(store, tiny, run, ("int8", "bf16"))
    c = await open_signed_consumer(store, tiny, store_url, run, state_key=run.run_key, wait_timeout_s=1.0)
    try:
        got = await c.next_batch(2, trainer_version=0)
        assert sorted(g.group.plane for g in got.groups) == ["bf16", "int8"]
        assert not any(name.startswith("rejected/") for name in c.counters)
        # The same gap, on a plane the run offers: within int8's allowance, nobody quarantined.
        assert c.observe_logprob_gap("mac-a", MADE_UP_GAP, TOKENS, plane="int8") == []
        assert c.counters.get("gap_plane_not_offered", 0) == 0 and c.quarantined == {}
    finally:
        await c.close()
