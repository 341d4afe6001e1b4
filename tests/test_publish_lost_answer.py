"""A publish whose pointer write landed but whose answer was lost (an outage right then), as the
chaos suite produced it: retrying it is neither a conflict nor a second version."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest

from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.pulse.history import read_pointer
from slime_stoa.protocol.pulse.publisher import PublishConflict, Publisher, PublisherConfig, PublishError
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store, StoreUnavailable
from slime_stoa.trainer.consumer.counting import CountingStore

RUN = "lost-answer"
CONFIG = PublisherConfig(catchup=False, retain_anchors=0)


class PointerAnswerLost(CountingStore):
    """While `lose` is set, a pointer write lands but its caller sees `StoreUnavailable`; while
    `drop` is set, it fails the same way without landing."""

    lose = False
    drop = False

    async def put(self, key: str, data: Any, *, if_match: str | None = None) -> str:
        if self.drop and key == RunLayout(RUN).pointer:
            self.drop = False
            raise StoreUnavailable("could not reach the endpoint (injected)")
        etag = await super().put(key, data, if_match=if_match)
        if self.lose and key == RunLayout(RUN).pointer:
            self.lose = False
            raise StoreUnavailable("connection dropped before the answer (injected)")
        return etag


def states(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    base = {"a": rng.integers(0, 1 << 15, (16, 16), dtype=np.uint16), "b": rng.integers(0, 1 << 15, 64, dtype=np.uint16)}
    out = []
    for i in range(n):
        step = {k: v.copy() for k, v in base.items()}
        step["a"].reshape(-1)[i] ^= 1
        out.append(step)
    return out


async def assert_synced_to(store: Store, state: dict[str, np.ndarray]) -> None:
    sub = Subscriber(store, RUN)
    await sub.sync()
    assert sub.state is not None
    assert all(np.array_equal(sub.state[k], state[k]) for k in state)


async def failed_second_publish(
    store: Store, fault: Literal["lose", "drop"]
) -> tuple[Publisher, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A publisher through `PointerAnswerLost` that published v0, then failed to publish the
    next state with `fault` on its pointer write; (the publisher, that state, a newer one)."""
    lossy = PointerAnswerLost(store)
    pub = Publisher(lossy, RUN, CONFIG)
    s0, s1, s2 = states(3)
    await pub.publish(s0)
    setattr(lossy, fault, True)
    with pytest.raises(PublishError):
        await pub.publish(s1)
    return pub, s1, s2


async def test_a_retried_publish_whose_pointer_write_landed_is_that_version(store: Store) -> None:
    pub, s1, s2 = await failed_second_publish(store, "lose")
    assert (await read_pointer(store, RUN)).version == 1  # it landed; the publisher was not told
    again = await pub.publish(s1)  # the caller retries the same publish
    assert again.version == 1 and pub.version == 1 and (await read_pointer(store, RUN)).version == 1
    assert (await pub.publish(s2)).version == 2
    await assert_synced_to(store, s2)


async def test_after_a_lost_answer_a_newer_state_is_the_next_version(store: Store) -> None:
    pub, _, s2 = await failed_second_publish(store, "lose")
    assert (await pub.publish(s2)).version == 2  # v1 (landed) adopted, s2 published on top of it
    await assert_synced_to(store, s2)


async def test_a_pointer_write_that_never_landed_and_a_real_conflict(store: Store) -> None:
    pub, s1, s2 = await failed_second_publish(store, "drop")
    assert (await read_pointer(store, RUN)).version == 0
    assert (await pub.publish(s1)).version == 1  # published as usual
    other = Publisher(store, RUN, CONFIG)
    await other.open()
    await other.publish(s2)  # another trainer moved the pointer: still a conflict
    with pytest.raises(PublishConflict):
        await pub.publish(s2)
