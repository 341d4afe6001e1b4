"""The trainer's side of the rollout plane: turn the records workers upload into training batches.

    async with open_store(url) as store:
        consumer = await RolloutConsumer.open(store, ConsumerConfig(store_url=url, run="demo"))
        batch = await consumer.next_batch(64, trainer_version=version)
        for group in batch.groups:
            fields = sample_fields(group)      # one dict per sample, slime's Sample field names
        await consumer.save_state()

Modules, one concept each: `config` (ConsumerConfig), `state` (the JSON state), `discovery`
(listing from a cursor), `policy` (staleness, reuse, admission order, dynamic sampling),
`scoring` (re-computed rewards), `admission` (judging one record), `metrics`, `persistence`
(state in the bucket), `workers` (who was last seen), `run_context` (manifest, task, tokenizer),
`consumer` (RolloutConsumer), `samples` (sample field dicts). Free of slime and torch.
"""

from .admission import ALL_REASONS, CONSUMER_REASONS, Admitted, judge_record
from .config import ADMISSION_ORDERS, ConsumerConfig, limits_for_run
from .consumer import Batch, ConsumedGroup, ConsumerTimeout, RolloutConsumer
from .persistence import StateConflict, read_state, state_key, write_state
from .run_context import RunContext, open_run_context
from .samples import sample_fields, sample_status
from .scoring import Decode, Rescorer, load_tokenizer, tokenizer_decode
from .state import ConsumerState

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
