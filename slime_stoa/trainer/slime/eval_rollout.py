"""slime's eval path for stoa: `generate_rollout(..., evaluation=True)` asks the fleet for an eval.

With `--eval-interval` (and `slime_stoa.generate_rollout` as the eval function too, slime's
default) an eval call asks the fleet for an eval of the pointer's version
(`slime_stoa.protocol.eval_request`): for each dataset of `--eval-prompt-data NAME SPLIT ...`
(slime's name/path pairs; here the "path" is a split of the run's task in the bucket, e.g.
`--eval-prompt-data gsm8k-test test`) it writes the request (signed with `stoa_run_key` on a
signed run), waits (`stoa_wait_timeout_s`, `stoa_poll_interval_s`) until every prompt has
`--n-samples-per-eval-prompt` (default 1) samples from workers holding that version, re-scores
them with the split's labels and returns `RolloutFnEvalOutput(data={NAME: {"rewards",
"truncated", "samples"}}, metrics)`, the samples built like training samples, k per prompt in
prompt order. Sampling: `--eval-max-response-len` and `--eval-temperature` when set, else the
run manifest's. `stoa_eval_prompts: N` evaluates the split's first N prompts (default: all).
metrics: `eval/stoa_<NAME>_pass@1`, `..._pass@k`, `..._n_prompts`, `..._rejects`.

The eval uses the rollout function's per-process consumer session (its store and event loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from slime_stoa.evaluation.collect import EvalCollector, open_eval_context, read_split
from slime_stoa.evaluation.fleet import await_answers, post_request, version_result
from slime_stoa.evaluation.passk import DEFAULT_PASS_THRESHOLD
from slime_stoa.protocol.eval_request import EvalRequest
from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.trainer.consumer import ConsumedGroup, sample_fields

from .settings import StoaSettings, as_float, as_int, settings_from_args

log = logging.getLogger(__name__)


def eval_datasets_from_args(args: Any) -> list[tuple[str, str]]:
    """(name, task split) pairs of `--eval-prompt-data NAME SPLIT ...`; ValueError when unusable."""
    pairs = getattr(args, "eval_prompt_data", None)
    if not pairs or isinstance(pairs, str) or len(pairs) % 2:
        raise ValueError(
            "an eval needs --eval-prompt-data NAME SPLIT [NAME SPLIT ...] (each SPLIT a split of the run's task "
            f"in the bucket, e.g. `gsm8k-test test`), got {pairs!r}"
        )
    out = [(str(pairs[i]), str(pairs[i + 1])) for i in range(0, len(pairs), 2)]
    for _name, split in out:
        check_name("task split", split)
    return out


def _slime_flag(args: Any, name: str, parse: Any) -> Any:
    value = getattr(args, name, None)
    return None if value is None else parse(name, value)


async def _evaluate(
    session: Any, settings: StoaSettings, args: Any, datasets: list[tuple[str, str]]
) -> tuple[int, dict[str, Any]]:
    """(version, {name: (collector, result)}) of one eval of the pointer's version."""
    assert session.store is not None
    store, config = session.store, session.config
    version = await session._read_version()
    if version is None:
        raise ValueError(f"run {config.run!r} has published no weights yet: nothing to evaluate")
    manifest = await read_run_manifest(store, config.run, pinned=config.run_key)
    k = _slime_flag(args, "n_samples_per_eval_prompt", as_int) or 1
    max_tokens = _slime_flag(args, "eval_max_response_len", as_int) or manifest.max_tokens
    temperature = _slime_flag(args, "eval_temperature", as_float) or manifest.temperature
    limit, key = settings.eval_prompts, settings.run_key
    out: dict[str, Any] = {}
    for name, split in datasets:
        task = await read_split(store, manifest, split)
        n = len(task) if limit is None else min(limit, len(task))
        wanted = EvalRequest(
            run=config.run, version=version, split=split, k=k, prompts=tuple(range(n)),
            max_tokens=max_tokens, temperature=temperature,
        )
        posted = await post_request(store, wanted, signing_key=key)
        ctx = await open_eval_context(
            store, posted, tokenizer_dir=settings.tokenizer_dir, verify_prompts=config.verify_prompts,
            run_key=manifest.run_key,
        )
        collector = EvalCollector(store, ctx, posted)
        log.info("stoa: eval %s: v%d, split %s, %d prompts x %d samples: waiting for the fleet", name, version, split, n, k)
        await await_answers(collector, signing_key=key, timeout_s=config.wait_timeout_s, poll_s=config.poll_interval_s)
        out[name] = (collector, version_result(collector, DEFAULT_PASS_THRESHOLD))
    return version, out


def eval_output(args: Any, rollout_id: Any, session_for: Callable[[StoaSettings], Any]) -> Any:
    """slime's `RolloutFnEvalOutput` of one eval of the pointer's version (module doc), on the
    consumer session `session_for(settings)` opens."""
    from slime.rollout.base_types import RolloutFnEvalOutput
    from slime.utils.types import Sample

    settings = settings_from_args(args)
    datasets = eval_datasets_from_args(args)  # checked before anything is opened
    session = session_for(settings)
    version, results = session.call(_evaluate(session, settings, args, datasets))
    data: dict[str, dict[str, list[Any]]] = {}
    metrics: dict[str, float] = {"eval/stoa_trainer_version": float(version)}
    for name, (collector, result) in results.items():
        samples = []
        for p in collector.request.prompts:
            for g in collector.kept(p):
                consumed = ConsumedGroup(
                    key=g.key, group=g.group, prompt=g.prompt, label=g.label, texts=g.texts, rewards=g.rewards,
                    version_lag=0, use=1,
                )
                samples += [Sample(**{**f, "status": Sample.Status(f["status"])}) for f in sample_fields(consumed)]
        data[name] = {
            "rewards": [float(r) for p in result.prompts for r in p.rewards],
            "truncated": [bool(t) for p in result.prompts for t in p.truncated],
            "samples": samples,
        }
        row = result.row()
        prefix = f"eval/stoa_{name}_"
        metrics.update({
            prefix + "pass@1": row["pass@1"], prefix + "pass@k": row["pass@k"],
            prefix + "n_prompts": float(row["n_prompts"]), prefix + "rejects": float(sum(collector.rejects.values())),
        })
        log.info("stoa: eval %s at rollout %s: v%d pass@1 %.3f pass@%d %.3f over %d prompts",
                 name, rollout_id, version, row["pass@1"], row["k"], row["pass@k"], row["n_prompts"])
    return RolloutFnEvalOutput(data=data, metrics=metrics)
