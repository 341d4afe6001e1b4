"""A restarted publisher rebuilds its catch-up union from the last patches (step patches carry
base-relative codes), so resuming costs no extra anchor."""

from __future__ import annotations

import numpy as np

from slime_stoa.protocol.pulse.history import find_manifest
from slime_stoa.protocol.pulse.publisher import Publisher, PublisherConfig
from slime_stoa.protocol.pulse.subscriber import Subscriber
from slime_stoa.protocol.store import Store
from tests.test_pulse_sync import assert_same, random_state, step_state

RUN = "resume"


async def test_resume_after_a_relative_step_patch_keeps_the_catchup_chain(store: Store) -> None:
    rng = np.random.default_rng(21)
    config = PublisherConfig(anchor_every=100, anchor_fraction=1e9)
    states = [random_state(rng)]
    states.append(step_state(states[-1], rng))
    first = Publisher(store, RUN, config)
    for s in states:
        await first.publish(s)  # v1 has only a rel step patch from the anchor v0
    lagging = Subscriber(store, RUN)
    await lagging.sync_to(await find_manifest(store, RUN, 0))

    resumed = Publisher(store, RUN, config)
    assert await resumed.open() == 1
    states.append(step_state(states[-1], rng))
    result = await resumed.publish(states[2])
    assert result.version == 2 and not result.anchored and result.catchup_bytes > 0
    v2 = await find_manifest(store, RUN, 2)
    catchup = v2.patch("catchup")
    union = sum(
        int(np.count_nonzero((states[0][n] != states[1][n]) | (states[1][n] != states[2][n]))) for n in states[0]
    )
    assert catchup is not None and catchup.covers(0) and catchup.count == union  # v1's changes are in it

    await lagging.sync()
    assert lagging.version == 2
    assert_same(lagging.state, states[2])
