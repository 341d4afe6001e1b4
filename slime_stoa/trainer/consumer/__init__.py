"""The trainer's side of the rollout plane: turn the records workers upload into training batches.

    async with open_store(url) as store:
        consumer = await RolloutConsumer.open(store, ConsumerConfig(store_url=url, run="demo"))
        batch = await consumer.next_batch(64, trainer_version=version)
        for group in batch.groups:
            fields = sample_fields(group)      # one dict per sample, slime's Sample field names
        await consumer.save_state()

Modules, one concept each. Rules and codecs, no store calls: `config` (ConsumerConfig, ResolvedConfig),
`state` (the JSON state), `groups` (the shapes a record takes: Admitted, the Pool it waits in,
ConsumedGroup, Batch, sample field dicts), `admission` (judging one record), `policy`
(staleness, reuse, admission order, dynamic sampling), `quarantine` and `canary` (honest
workers), `metrics` (counters, batch and episode metrics). With IO: `persistence` and `heads`
(state in the bucket), `run_context` (manifest, task, tokenizer), `pause` (waiting for a repair),
`counting` (a request-counting store, for benchmarks and tests). The parts of a
`RolloutConsumer` (`consumer`), each owning its state: `shared` (store, config, the state and its
counters, store calls through outages), `discovery` (listing from a cursor), `downloads` (the
queue and the GETs), `intake` (a downloaded record's fate), `versions` (the published weight
versions), `trust` (worker keys, quarantine, canaries), `held` (records waiting for an object a
bucket writer deleted), `wait` (the loop that fills the pool, and the timeout message). The
judging primitives shared with the evaluation are `slime_stoa.judging`. Free of slime and torch.

How a record flows (one record, signed run: listed, downloaded, admitted, used, state saved;
each step enters another module):

    consumer.next_batch -> wait.Filler.ready/fill -> versions.refresh (the pointer)
    -> shared.patiently -> discovery.Discovery.tail -> held.admits -> trust.admits
    -> downloads.Downloads.launch -> held.hold_before_download -> trust.refuse_before_download
    -> intake.Intake.take -> trust.know_signer -> admission.open_record, admission.admit
    -> trust.refuses -> versions.verdict -> groups.Pool.add
    consumer._take -> groups.Pool.take -> versions.lag -> groups.ConsumedGroup.of -> metrics
    consumer.save_state -> groups.Pool.ledger -> state.snapshot -> persistence.SavedState.write -> heads

25 steps across 15 modules, 10 entries into a module already visited, none back into `consumer`
before the batch. (Before the parts were merged: 26 steps across 16 modules, 10 re-entries, two
of them back into `consumer`, whose callbacks judged held records; 25 modules, now 22.)
"""

from slime_stoa.judging.scoring import Decode, Rescorer, load_tokenizer, tokenizer_decode

from .admission import ALL_REASONS, CONSUMER_REASONS, judge_record
from .config import ADMISSION_ORDERS, ConsumerConfig, ResolvedConfig, limits_for_run
from .consumer import RolloutConsumer
from .groups import Admitted, Batch, ConsumedGroup, sample_fields, sample_status
from .persistence import StateConflict, read_state, state_key, write_state
from .run_context import RunContext, open_run_context
from .state import ConsumerState
from .wait import ConsumerTimeout

__all__ = [
    "ADMISSION_ORDERS",
    "ALL_REASONS",
    "CONSUMER_REASONS",
    "Admitted",
    "Batch",
    "ConsumedGroup",
    "ConsumerConfig",
    "ConsumerState",
    "ConsumerTimeout",
    "Decode",
    "Rescorer",
    "ResolvedConfig",
    "RolloutConsumer",
    "RunContext",
    "StateConflict",
    "judge_record",
    "limits_for_run",
    "load_tokenizer",
    "open_run_context",
    "read_state",
    "sample_fields",
    "sample_status",
    "state_key",
    "tokenizer_decode",
    "write_state",
]
