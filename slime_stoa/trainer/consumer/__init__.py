"""The trainer's side of the rollout plane: turn the records workers upload into training batches.

    async with open_store(url) as store:
        consumer = await RolloutConsumer.open(store, ConsumerConfig(store_url=url, run="demo"))
        batch = await consumer.next_batch(64, trainer_version=version)
        for group in batch.groups:
            fields = sample_fields(group)      # one dict per sample, slime's Sample field names
        await consumer.save_state()

Modules, one concept each: `config` (ConsumerConfig, ResolvedConfig), `state` (the JSON state),
`groups` (the shapes a record takes: Admitted, ConsumedGroup, Batch, sample field dicts),
`admission` (judging one record), `policy` (staleness, reuse, admission order, dynamic
sampling), `quarantine` and `canary` (honest workers), `metrics`, `persistence` (state in the
bucket), `workers` (who was last seen), `run_context` (manifest, task, tokenizer). The parts of
a `RolloutConsumer` (`consumer`): `discovery` (listing from a cursor), `downloads`, `intake`
(a downloaded record's fate), `versions` (the published weight versions), `trust` (worker keys,
quarantine, canaries), `pool`, `wait` (the loop that fills the pool), `shared` (what they
share). The judging primitives shared with the evaluation are `slime_stoa.judging`. Free of
slime and torch.
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
