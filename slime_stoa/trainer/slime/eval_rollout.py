"""slime's eval path for stoa: `generate_rollout(..., evaluation=True)` asks the fleet for an eval.

With `--eval-interval` (and `slime_stoa.generate_rollout` as the eval function too, slime's
default) an eval call asks the fleet for an eval of the pointer's version
(`slime_stoa.protocol.eval_request`) for each of slime's eval datasets: `args.eval_datasets`
as slime resolved them from `--eval-config` or `--eval-prompt-data NAME SPLIT ...` (here a
dataset's path is a split of the run's task in the bucket, e.g. `--eval-prompt-data gsm8k-test
test`). Each dataset has its own settings, resolved as slime resolves them
(slime/utils/eval_config.py: the dataset entry, then `eval.defaults`, then the flags):
`n_samples_per_eval_prompt` (`--n-samples-per-eval-prompt`, then `--n-samples-per-prompt`),
`temperature` (`--eval-temperature`, then `--rollout-temperature`; None: the run manifest's),
`max_response_len` (`--eval-max-response-len`, then `--rollout-max-response-len`; None: the
manifest's). A temperature <= 0 (greedy), a top_p other than 1, a top_k or a min_new_tokens
fail the call: the fleet samples the full distribution. Reward, generation and stop settings of a
dataset are not used (a warning names them). `stoa_eval_prompts: N` evaluates the split's first
N prompts (default: all).

It writes each request (signed with `stoa_run_key` on a signed run), waits
(`stoa_wait_timeout_s`, `stoa_poll_interval_s`) until every prompt has k samples from workers
holding that version, re-scores them with the split's labels and returns
`RolloutFnEvalOutput(data={NAME: {"rewards", "truncated", "samples"}}, metrics)`, the samples
built like training samples, k per prompt in prompt order, each carrying its prompt's index as
`group_index` (slime's `zero_std/*` eval metrics group by it) and its position as `index`.
metrics: `eval/stoa_<NAME>_pass@1`, `..._pass@k`, `..._n_prompts`, `..._rejects`.

The eval uses the rollout function's per-process consumer session (its store and event loop).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_stoa.evaluation.collect import EvalCollector, open_eval_context, read_split
from slime_stoa.evaluation.fleet import await_answers, post_request, version_result
from slime_stoa.evaluation.passk import DEFAULT_PASS_THRESHOLD
from slime_stoa.protocol.eval_request import EvalRequest
from slime_stoa.protocol.layout import check_name
from slime_stoa.protocol.run_manifest import read_run_manifest
from slime_stoa.protocol.run_trust import first_run_key
from slime_stoa.trainer.consumer import ConsumedGroup, sample_fields

from .settings import StoaSettings, settings_from_args
from .settings_parsers import as_int

log = logging.getLogger(__name__)


# slime's per-dataset fallbacks to its flags (slime/utils/eval_config.py, DATASET_RUNTIME_SPECS):
# the first flag that is not None wins.
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "min_new_tokens": ("eval_min_new_tokens",),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
}
# EvalDatasetConfig fields (with no default from slime's flags) the fleet does not use: rewards
# come from the run's task, generation from the workers.
_IGNORED = (
    "rm_type", "custom_rm_path", "repetition_penalty", "custom_generate_function_path", "app_service",
    "message_processor", "reward_model", "remote_environment", "metadata_overrides",
)


@dataclass(frozen=True)
class EvalDataset:
    """One eval dataset as the fleet evaluates it: slime's `EvalDatasetConfig` resolved."""

    name: str
    split: str
    """A split of the run's task in the bucket (the dataset's `path`)."""
    k: int
    """Samples per prompt (`n_samples_per_eval_prompt`)."""
    temperature: float | None
    """None: the run manifest's."""
    max_tokens: int | None
    """None: the run manifest's."""
    ignored: tuple[str, ...] = ()
    """Settings of the dataset that the fleet does not use (warned about)."""


def _pick(args: Any, attrs: tuple[str, ...]) -> Any:
    for attr in attrs:
        value = getattr(args, attr, None)
        if value is not None:
            return value
    return None


def _number(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}")
    return float(value)


def resolve_dataset(get: Callable[[str], Any]) -> EvalDataset:
    """An `EvalDataset` from the fields of a resolved slime dataset config (`get(field)`, None
    when unset); ValueError for a setting the fleet cannot honour."""
    name, split = get("name"), get("path")
    where = f"eval dataset {name!r}"
    if not isinstance(name, str) or not name:
        raise ValueError(f"an eval dataset needs a name, got {name!r}")
    if not isinstance(split, str) or not split:
        raise ValueError(f"{where}: its path must be a split of the run's task in the bucket, got {split!r}")
    check_name("task split", split)
    raw_k = get("n_samples_per_eval_prompt")
    k = 1 if raw_k is None else as_int(f"{where}: n_samples_per_eval_prompt", raw_k)
    if k < 1:
        raise ValueError(f"{where}: n_samples_per_eval_prompt must be >= 1, got {raw_k!r}")
    temperature = get("temperature")
    if temperature is not None:
        temperature = _number(where, "temperature", temperature)
        if temperature <= 0:
            raise ValueError(
                f"{where}: temperature {temperature:g} (--eval-temperature or the dataset's temperature): stoa's "
                "fleet evaluates by sampling and has no greedy decoding; set a temperature > 0"
            )
    top_p = get("top_p")
    if top_p is not None and _number(where, "top_p", top_p) != 1.0:
        raise ValueError(f"{where}: top_p {top_p!r}: stoa's workers sample the full distribution; set it to 1.0")
    top_k = get("top_k")
    if top_k is not None and top_k != -1:
        raise ValueError(f"{where}: top_k {top_k!r}: stoa's workers sample without top-k; leave it unset (-1)")
    min_new = get("min_new_tokens")
    if min_new not in (None, 0):
        raise ValueError(f"{where}: min_new_tokens {min_new!r}: stoa's workers have no minimum length; unset it")
    max_len = get("max_response_len")
    max_tokens = None if max_len is None else as_int(f"{where}: max_response_len", max_len)
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"{where}: max_response_len must be >= 1, got {max_len!r}")
    ignored = tuple(f for f in ("stop", "stop_token_ids", *_IGNORED) if get(f) not in (None, {}, []))
    return EvalDataset(name=name, split=split, k=k, temperature=temperature, max_tokens=max_tokens, ignored=ignored)


def _from_config(entry: Any) -> EvalDataset:
    """A dataset of slime's `args.eval_datasets` (an `EvalDatasetConfig`, fallbacks applied)."""
    if isinstance(entry, Mapping):
        return resolve_dataset(entry.get)
    return resolve_dataset(lambda f: getattr(entry, f, None))


def _with_fallbacks(args: Any, entry: Mapping[str, Any], defaults: Mapping[str, Any]) -> EvalDataset:
    """A dataset entry resolved as slime's `build_eval_dataset_configs` does: the entry, then
    the `defaults`, then slime's flags."""
    merged = {**defaults, **entry}
    for field_name, attrs in _FALLBACKS.items():
        if field_name not in merged:
            merged[field_name] = _pick(args, attrs)
    return resolve_dataset(merged.get)


def read_eval_config(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(datasets, defaults) of an `--eval-config` file, read as slime's `_resolve_eval_datasets`
    reads it (a mapping; `eval` or the root holds `defaults` and `datasets`, a list of entries
    with a name or a mapping name -> entry). ValueError when unusable."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read --eval-config {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--eval-config {path} must contain a mapping at the root")
    section = doc.get("eval", doc)
    if not isinstance(section, dict):
        raise ValueError(f"--eval-config {path} must define an `eval` mapping or be a mapping itself")
    defaults = section.get("defaults") or {}
    raw = section.get("datasets")
    if isinstance(raw, dict):
        datasets = [{"name": name, **dict(cfg or {})} for name, cfg in raw.items()]
    elif isinstance(raw, list) and all(isinstance(d, dict) and "name" in d for d in raw):
        datasets = [dict(d) for d in raw]
    else:
        raise ValueError(f"--eval-config {path}: eval.datasets must be a list of entries with a name, or a mapping")
    if not datasets or not isinstance(defaults, dict):
        raise ValueError(f"--eval-config {path} defines no datasets under eval.datasets")
    return datasets, defaults


def eval_datasets_from_args(args: Any) -> list[EvalDataset]:
    """The eval datasets of slime's args, each with its own settings: slime's resolved
    `args.eval_datasets` when set (from `--eval-config` or `--eval-prompt-data`), else the same
    resolution here (`--eval-config`, else `--eval-prompt-data NAME SPLIT ...` with slime's flag
    fallbacks). ValueError when unusable or asking what the fleet cannot do."""
    resolved = getattr(args, "eval_datasets", None)
    if resolved:
        return [_from_config(entry) for entry in resolved]
    config = getattr(args, "eval_config", None)
    if config:
        datasets, defaults = read_eval_config(config)
        return [_with_fallbacks(args, entry, defaults) for entry in datasets]
    pairs = getattr(args, "eval_prompt_data", None)
    if not pairs or isinstance(pairs, str) or len(pairs) % 2:
        raise ValueError(
            "an eval needs --eval-config or --eval-prompt-data NAME SPLIT [NAME SPLIT ...] (each SPLIT a split of "
            f"the run's task in the bucket, e.g. `gsm8k-test test`), got {pairs!r}"
        )
    return [
        _with_fallbacks(args, {"name": str(pairs[i]), "path": str(pairs[i + 1])}, {}) for i in range(0, len(pairs), 2)
    ]


async def _evaluate(
    session: Any, settings: StoaSettings, datasets: list[EvalDataset]
) -> tuple[int, dict[str, Any]]:
    """(version, {name: (collector, result)}) of one eval of the pointer's version."""
    assert session.store is not None
    store, config = session.store, session.config
    version = await session._read_version()
    if version is None:
        raise ValueError(f"run {config.run!r} has published no weights yet: nothing to evaluate")
    manifest = await read_run_manifest(store, config.run, pinned=await first_run_key(store, config.run, config.run_key))
    limit, key = settings.eval_prompts, settings.run_key
    out: dict[str, Any] = {}
    for dataset in datasets:
        name, split, k = dataset.name, dataset.split, dataset.k
        if dataset.ignored:
            session.warn_once(
                f"eval-ignored-{name}", "stoa: eval dataset %s: %s not used (the fleet samples with the run's task, "
                "its split's labels and the run manifest's stop strings)", name, ", ".join(dataset.ignored),
            )
        max_tokens = manifest.max_tokens if dataset.max_tokens is None else dataset.max_tokens
        temperature = manifest.temperature if dataset.temperature is None else dataset.temperature
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
    version, results = session.call(_evaluate(session, settings, datasets))
    data: dict[str, dict[str, list[Any]]] = {}
    metrics: dict[str, float] = {"eval/stoa_trainer_version": float(version)}
    for name, (collector, result) in results.items():
        samples: list[Any] = []
        for p in collector.request.prompts:  # group_index: the prompt (slime's zero_std/* groups by it)
            for g in collector.kept(p):
                consumed = ConsumedGroup(
                    key=g.key, group=g.group, prompt=g.prompt, label=g.label, texts=g.texts, rewards=g.rewards,
                    version_lag=0, use=1,
                )
                indices = list(range(len(samples), len(samples) + len(g.group.samples)))
                fields = sample_fields(consumed, group_index=p, indices=indices)
                samples += [Sample(**{**f, "status": Sample.Status(f["status"])}) for f in fields]
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
