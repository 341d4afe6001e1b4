"""Stand-ins for the slime modules stoa's rollout function imports (slime is not installed in
the tests), and a child process that drives the real rollout function the way slime's train.py
does (for kill-and-restart tests).

slime's names: `slime.utils.types.Sample` (a dataclass with defaults, `Sample.Status`) and
`slime.rollout.base_types.RolloutFnTrainOutput(samples, metrics=None)` and
`RolloutFnEvalOutput(data, metrics=None)`; slime calls
`generate_rollout(args, rollout_id, data_source, evaluation=False)` once per rollout with
`args.rollout_batch_size`, `args.n_samples_per_prompt`, `args.save`, `args.load`, ... and, at
start-up, `data_source.load(start_rollout_id - 1)`.

    python -m tests.slime_standins CONFIG.json

runs rollouts `start_rollout_id .. num_rollout - 1` with `StoaDataSource` and prints one JSON
line per rollout (`{"rollout": id, "keys": [...], "group_index": [...], "index": [...]}`) after
the rollout function returned it; the consumer's log goes to stderr.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
import types
from collections.abc import MutableMapping
from typing import Any


@dataclasses.dataclass
class Sample:
    """slime's `Sample` (slime/utils/types.py at SLIME_COMMIT): the same field names, order and
    defaults, so constructing one with a field slime does not have fails here as it would there
    (tests/test_slime_standins.py compares the two whenever slime is importable). Field types are
    loosened where slime's name torch."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict = dataclasses.field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0
    spec_info: Any = None
    prefix_cache_info: Any = None


#: The slime commit whose `Sample` and rollout output types the stand-ins copy.
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def rollout_fn_train_output(samples: list[list[Any]], metrics: dict | None = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(samples=samples, metrics=metrics)


def rollout_fn_eval_output(data: dict[str, dict[str, Any]], metrics: dict | None = None) -> types.SimpleNamespace:
    """slime's `RolloutFnEvalOutput(data, metrics=None)`: `data` is {dataset name: {"rewards",
    "truncated", "samples"}}."""
    return types.SimpleNamespace(data=data, metrics=metrics)


def modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by name (put them in `sys.modules`, e.g. with monkeypatch.setitem)."""
    out = {name: types.ModuleType(name) for name in ("slime", "slime.utils", "slime.rollout")}
    types_mod = types.ModuleType("slime.utils.types")
    types_mod.Sample = Sample  # type: ignore[attr-defined]
    base_mod = types.ModuleType("slime.rollout.base_types")
    base_mod.RolloutFnTrainOutput = rollout_fn_train_output  # type: ignore[attr-defined]
    base_mod.RolloutFnEvalOutput = rollout_fn_eval_output  # type: ignore[attr-defined]
    out["slime.utils.types"] = types_mod
    out["slime.rollout.base_types"] = base_mod
    return out


def install(target: MutableMapping[str, Any] | None = None) -> None:
    (sys.modules if target is None else target).update(modules())


def main(argv: list[str]) -> int:
    install()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    with open(argv[0], encoding="utf-8") as f:
        config = json.load(f)
    from slime_stoa import StoaDataSource, generate_rollout

    args = types.SimpleNamespace(**config["args"])
    source = StoaDataSource(args)
    start = config["start_rollout_id"]
    source.load(start - 1)  # slime: rollout_manager.load(start_rollout_id - 1)
    for rollout_id in range(start, config["num_rollout"]):
        out = generate_rollout(args, rollout_id, source, evaluation=False)
        line = {
            "rollout": rollout_id,
            "keys": [group[0].metadata["stoa_key"] for group in out.samples],
            "group_index": [group[0].group_index for group in out.samples],
            "index": [s.index for group in out.samples for s in group],
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
