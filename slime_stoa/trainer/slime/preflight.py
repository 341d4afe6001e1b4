"""Preflight: check a slime launch against its stoa run before a GPU is touched.

`stoa preflight --store URL --run RUN [slime flags...]` (see `cli/preflight_cmd.py`) reads the
bucket, the slime flags it cares about and the `--custom-config-path` YAML, and reports one
`Finding` per check: `ok`, `warn` (works, but probably not what you want) or `fix` (the run
would fail or train on the wrong data; the message says exactly what to change).

Everything here is a small function. The bucket is read once (`inspect_store`, async) into a
`StoreFacts`; every other check is a pure function of the parsed flags, the YAML, the facts and
the run manifest:

    flags, unknown = parse_slime_args(argv)           # slime's own parser where slime imports; tolerant
    config = load_custom_config(flags.custom_config_path)
    args = effective_args(flags, config)              # the YAML overrides flags, as in slime
    facts = asyncio.run(inspect_store(url, run))
    findings = [*check_store(facts), *check_flags(args, facts.manifest, config, facts.run_keys), ...]

The flag rules follow slime's `slime/utils/arguments.py` (`slime_validate_args`) and its DP
schedule (`slime/utils/dp_schedule.py`): a training step takes `--global-batch-size` samples,
`--num-steps-per-rollout k` means `global_batch_size = rollout_batch_size *
n_samples_per_prompt // k`, and samples that do not fill a whole step are dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import importlib.util
import math
import shlex
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeGuard

from slime_stoa.protocol.hf.architectures import unsupported_model
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_manifest import RunManifest, RunNotFound, read_run_manifest
from slime_stoa.protocol.run_trust import RunTrust, Untrusted, load_rotations
from slime_stoa.protocol.shell import run_create_command, shell_command, task_prepare_command
from slime_stoa.protocol.signing import PublicKey
from slime_stoa.protocol.store import StoreError, open_store, parse_store_url

from .findings import FIX, OK, STATUSES, WARN, Finding, fix, ok, warn
from .preflight_slime_api import SLIME_COMMIT, check_hook, check_slime_api

Config = Mapping[str, Any] | None  # the custom-config YAML, if read


STOA_ROLLOUT_FUNCTION = "slime_stoa.generate_rollout"
STOA_LOSS_FUNCTION = "slime_stoa.dppo_loss"
STOA_DATA_SOURCE = "slime_stoa.StoaDataSource"
SLIME_DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"
SLIME_DEFAULT_DATA_SOURCE = "slime.rollout.data_source.RolloutDataSourceWithBuffer"
NEW_RUN = "NEW_RUN"  # the placeholder of a run name to pick, in the commands preflight prints


# -- slime flags ----------------------------------------------------------------------------------
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


#: The slime flags preflight reads, as slime (and Megatron, for the flags slime takes from it)
#: declares them at `preflight_slime_api.SLIME_COMMIT`: where slime is importable its own parser
#: reads the launch flags and this copy only adds what that parser lacks (Megatron's flags when
#: Megatron does not import, and the flags of slime's pre-pass `_pre_parse_mode`, which has a
#: parser of its own); elsewhere this copy reads them, and preflight says so.
SLIME_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--rollout-num-gpus", {"type": int, "default": None}),
    ("--colocate", {"action": "store_true", "default": False}),
    ("--debug-train-only", {"action": "store_true", "default": False}),
    ("--debug-rollout-only", {"action": "store_true", "default": False}),
    ("--rollout-function-path", {"default": SLIME_DEFAULT_ROLLOUT_FUNCTION}),
    ("--data-source-path", {"default": SLIME_DEFAULT_DATA_SOURCE}),
    ("--rollout-temperature", {"type": float, "default": 1.0}),
    ("--rollout-top-p", {"type": float, "default": 1.0}),
    ("--rollout-max-response-len", {"type": int, "default": None}),
    ("--rollout-batch-size", {"type": int, "default": None}),
    ("--n-samples-per-prompt", {"type": int, "default": 1}),
    ("--global-batch-size", {"type": int, "default": None}),
    ("--num-steps-per-rollout", {"type": int, "default": None}),
    ("--num-rollout", {"type": int, "default": None}),
    ("--num-epoch", {"type": int, "default": None}),
    ("--loss-type", {"default": "policy_loss"}),
    ("--custom-loss-function-path", {"default": None}),
    ("--advantage-estimator", {"default": "grpo"}),
    ("--use-rollout-logprobs", {"action": "store_true", "default": False}),
    ("--calculate-per-token-loss", {"action": "store_true", "default": False}),
    ("--use-kl-loss", {"action": "store_true", "default": False}),
    ("--use-tis", {"action": "store_true", "default": False}),
    ("--use-opsm", {"action": "store_true", "default": False}),
    ("--custom-pg-loss-reducer-function-path", {"default": None}),
    ("--custom-config-path", {"default": None}),
    ("--eval-interval", {"type": int, "default": None}),
    ("--eval-prompt-data", {"nargs": "+", "default": None}),
    ("--prompt-data", {"default": None}),
    ("--disable-rollout-global-dataset", {"action": "store_false", "dest": "rollout_global_dataset"}),
    ("--eval-config", {"default": None}),
    ("--n-samples-per-eval-prompt", {"type": int, "default": 1}),
    ("--eval-temperature", {"type": float, "default": None}),
    ("--eval-top-p", {"type": float, "default": None}),
    ("--eval-top-k", {"type": int, "default": None}),
    ("--eval-max-response-len", {"type": int, "default": None}),
    ("--eval-min-new-tokens", {"type": int, "default": None}),
    ("--rollout-top-k", {"type": int, "default": -1}),
    ("--get-mismatch-metrics", {"action": "store_true", "default": False}),
    ("--pipeline-model-parallel-size", {"type": int, "default": 1}),
    ("--untie-embeddings-and-output-weights", {"action": "store_true", "default": False}),
    ("--hf-checkpoint", {"default": None}),
    ("--save", {"default": None}),
    ("--load", {"default": None}),
)


@dataclass(frozen=True)
class SlimeFlagParser:
    """The parser of the launch flags, and whose it is: `unavailable` says why slime's own
    parser is not used ("" when it is)."""

    parser: argparse.ArgumentParser
    unavailable: str = ""


def slime_own_parser() -> argparse.ArgumentParser:
    """slime's own parser of its launch flags: Megatron's arguments (where Megatron imports) with
    slime's added by `slime.utils.arguments.get_slime_extra_args_provider`, as slime's
    `parse_args` builds it (sglang's flags, parsed apart by slime, are left to the unknown ones).
    ImportError (or whatever importing slime raises) where slime is not importable."""
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser(prog="slime", add_help=False, allow_abbrev=False)
    try:
        from megatron.training.arguments import add_megatron_arguments
    except Exception:  # no Megatron here (or one without it): stoa's copy adds the Megatron flags it reads
        pass
    else:
        parser = add_megatron_arguments(parser) or parser
    return get_slime_extra_args_provider()(parser) or parser


def slime_flag_parser() -> SlimeFlagParser:
    """slime's own parser where slime imports (completed from `SLIME_FLAGS` with the flags it does
    not declare), else a parser of `SLIME_FLAGS` alone, saying why."""
    try:
        parser, unavailable = slime_own_parser(), ""
    except Exception as exc:  # slime is not importable here (or its import fails): say why
        parser = argparse.ArgumentParser(prog="slime", add_help=False, allow_abbrev=False)
        unavailable = " ".join(f"{type(exc).__name__}: {exc}".split())
    declared = parser._option_string_actions
    for option, kwargs in SLIME_FLAGS:
        if option not in declared:
            parser.add_argument(option, **kwargs)
    return SlimeFlagParser(parser, unavailable)


def parse_slime_args(
    argv: Sequence[str], flag_parser: SlimeFlagParser | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """(the parsed flags, every other token). Unknown flags are tolerated; a bare `--` is dropped.
    ValueError for a known flag with a bad value (e.g. `--rollout-batch-size x`)."""
    tokens = [t for t in argv if t != "--"]
    parser = (flag_parser or slime_flag_parser()).parser

    def error(message: str) -> NoReturn:  # argparse would exit; raise instead
        raise ValueError(f"slime flags: {message}")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_known_args(tokens)


def check_flag_parser(flag_parser: SlimeFlagParser) -> Finding:
    """One line: the flags were read by slime's own parser, or why not (slime not importable)."""
    check = "slime-flags"
    if not flag_parser.unavailable:
        return ok(check, "the slime flags parse with slime's own parser")
    return ok(
        check,
        f"slime is not importable here ({flag_parser.unavailable}): the flags were read as slime "
        f"{SLIME_COMMIT[:12]} declares them; run preflight where slime imports to check them with slime's own parser",
    )


def read_args_file(path: str | Path) -> list[str]:
    """Slime flags from a file: shell words (quotes allowed), `#` comments, any line breaks
    (a backslash at the end of a line continues it, as in a shell script)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the slime args file {path}: {exc}") from None
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ValueError(f"slime args file {path}: {exc}") from None


def load_custom_config(path: str | Path) -> dict[str, Any]:
    """The `--custom-config-path` YAML as slime reads it (`yaml.safe_load`; empty file = {})."""
    try:
        import yaml
    except ImportError:
        raise ValueError("reading the custom-config YAML needs PyYAML: pip install pyyaml") from None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the --custom-config-path file {path}: {exc}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"--custom-config-path file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"--custom-config-path file {path} must be a mapping of setting names to values")
    return data


def effective_args(flags: argparse.Namespace, config: Mapping[str, Any]) -> argparse.Namespace:
    """slime's view: the flags, then every YAML key set as an attribute (the YAML wins)."""
    return argparse.Namespace(**{**vars(flags), **config})


def _shown(value: Any) -> str:
    """A setting's value in a message ("unset" for None)."""
    return "unset" if value is None else repr(value)


def _src(config: Config, name: str) -> str:
    """How to name a setting in a message: the YAML key if the YAML sets it, else the flag."""
    return f"the custom-config key {name}" if config and name in config else _flag(name)


# -- importable functions ---------------------------------------------------------------------------
def load_function(path: str) -> Callable[..., Any]:
    """Import `pkg.mod.fn` as slime's `load_function` does: split at the last dot, import the
    module, take the attribute. ValueError saying what failed."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ValueError(f"{path!r} is not a dotted path like pkg.module.function")
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import error, or anything the module raises while loading
        raise ValueError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


def _same_function(path: str, reference: str) -> bool:
    """Whether `path` names the same object as `reference` (both importable)."""
    try:
        return load_function(path) is load_function(reference)
    except ValueError:
        return False


# -- flag checks (pure) -----------------------------------------------------------------------------
def check_rollout_gpus(args: argparse.Namespace) -> list[Finding]:
    """No SGLang engines (`--rollout-num-gpus 0`), not colocated, no debug-only mode."""
    out: list[Finding] = []
    n = getattr(args, "rollout_num_gpus", None)
    if n == 0:
        out.append(ok("rollout-num-gpus", "--rollout-num-gpus 0: no SGLang engines, rollouts come from the bucket"))
    else:
        out.append(
            fix(
                "rollout-num-gpus",
                f"--rollout-num-gpus is {_shown(n)}: add --rollout-num-gpus 0 "
                "(the Macs generate; slime must start no SGLang engines)",
            )
        )
    if getattr(args, "colocate", False):
        out.append(fix("colocate", "--colocate is set: remove it (there is no inference engine to share GPUs with)"))
    for name in ("debug_train_only", "debug_rollout_only"):
        if getattr(args, name, False):
            out.append(
                fix(
                    name.replace("_", "-"),
                    f"{_flag(name)} is set: remove it (slime then skips update_weights, so no weights are published)",
                )
            )
    return out


def check_temperature(args: argparse.Namespace, manifest: RunManifest, config: Config = None) -> Finding:
    """The trainer recomputes log-probs at `--rollout-temperature`: it must be the workers'."""
    t = getattr(args, "rollout_temperature", 1.0)
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isclose(t, manifest.temperature, rel_tol=1e-9):
        return ok("rollout-temperature", f"--rollout-temperature {t:g} equals run {manifest.run}'s temperature")
    return fix(
        "rollout-temperature",
        f"{_src(config, 'rollout_temperature')} is {t!r} but run {manifest.run!r} samples at temperature "
        f"{manifest.temperature:g}: set --rollout-temperature {manifest.temperature:g}",
    )


def check_top_p(args: argparse.Namespace, config: Config = None) -> Finding:
    """Workers sample the full distribution (top_p = 1); slime must not truncate it."""
    p = getattr(args, "rollout_top_p", 1.0)
    if p == 1.0:
        return ok("rollout-top-p", "--rollout-top-p is 1.0 (full distribution, as the workers sample)")
    return fix(
        "rollout-top-p",
        f"{_src(config, 'rollout_top_p')} is {p!r}: set --rollout-top-p 1.0 (stoa workers sample with top_p = 1, "
        "and the trainer must compute log-probs over the full distribution)",
    )


def check_group_size(args: argparse.Namespace, manifest: RunManifest, config: Config = None) -> Finding:
    """`--n-samples-per-prompt` is the run's group size (GRPO groups stay whole)."""
    n = getattr(args, "n_samples_per_prompt", 1)
    if n == manifest.group_size:
        return ok("n-samples-per-prompt", f"--n-samples-per-prompt {n} equals run {manifest.run}'s group size")
    return fix(
        "n-samples-per-prompt",
        f"{_src(config, 'n_samples_per_prompt')} is {n!r} but run {manifest.run!r} has groups of "
        f"{manifest.group_size}: set --n-samples-per-prompt {manifest.group_size}",
    )


def check_max_response_len(args: argparse.Namespace, manifest: RunManifest, config: Config = None) -> Finding:
    """`--rollout-max-response-len` covers the longest response a worker may send."""
    n = getattr(args, "rollout_max_response_len", None)
    if isinstance(n, int) and n >= manifest.max_tokens:
        return ok("rollout-max-response-len", f"--rollout-max-response-len {n} >= run max_tokens {manifest.max_tokens}")
    got = _shown(n)
    return fix(
        "rollout-max-response-len",
        f"{_src(config, 'rollout_max_response_len')} is {got} but run {manifest.run!r} allows responses of "
        f"{manifest.max_tokens} tokens: set --rollout-max-response-len {manifest.max_tokens}",
    )


def _positive_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_batch_sizes(args: argparse.Namespace) -> Finding:
    """`--rollout-batch-size` x `--n-samples-per-prompt` against `--global-batch-size` /
    `--num-steps-per-rollout`, with slime's rules at HEAD."""
    rbs = getattr(args, "rollout_batch_size", None)
    n = getattr(args, "n_samples_per_prompt", 1)
    gbs = getattr(args, "global_batch_size", None)
    k = getattr(args, "num_steps_per_rollout", None)
    check = "global-batch-size"
    if not _positive_int(rbs):
        return fix(
            "rollout-batch-size", f"--rollout-batch-size is {_shown(rbs)}: set it to the prompt groups per rollout"
        )
    if not _positive_int(n):
        return fix("n-samples-per-prompt", f"--n-samples-per-prompt is {n!r}: set it to the run's group size")
    total = rbs * n
    per_rollout = f"the {total} samples of a rollout (rollout-batch-size {rbs} x n-samples-per-prompt {n})"
    if k is not None:
        if not _positive_int(k):
            return fix(check, f"--num-steps-per-rollout is {k!r}: set it to an integer >= 1")
        if total % k:
            return fix(check, f"--num-steps-per-rollout {k} does not divide {per_rollout}: pick a divisor of {total}")
        if gbs is not None and gbs != total // k:
            return fix(
                check,
                f"--global-batch-size {gbs} contradicts --num-steps-per-rollout {k} ({total} // {k} = {total // k}; "
                f"slime asserts they agree): drop --global-batch-size or set it to {total // k}",
            )
        gbs = total // k
    if gbs is None:
        return fix(
            check,
            "neither --global-batch-size nor --num-steps-per-rollout is set (Megatron's default, micro-batch x DP, "
            f"would take many optimizer steps per rollout): add --global-batch-size {total} (one step per rollout)",
        )
    if not _positive_int(gbs):
        return fix(check, f"--global-batch-size is {gbs!r}: set it to an integer >= 1, e.g. {total}")
    if gbs > total:
        return fix(
            check,
            f"--global-batch-size {gbs} exceeds {per_rollout} and slime fails at the first step: "
            f"set --global-batch-size {total}",
        )
    if total % gbs:
        return fix(
            check,
            f"--global-batch-size {gbs} does not divide {per_rollout}: slime would drop the last {total % gbs} "
            f"samples of every rollout; set --global-batch-size {total} or another divisor of {total}",
        )
    return ok(check, f"{total} samples per rollout = {total // gbs} optimizer step(s) of {gbs}")


def check_schedule(args: argparse.Namespace) -> list[Finding]:
    """`--num-rollout` set; evaluation only with `--eval-prompt-data` splits; no prompt data; the global dataset (and so the
    consumer's cursor in slime's checkpoints) kept on; checkpoints saved."""
    out: list[Finding] = []
    num_rollout = getattr(args, "num_rollout", None)
    if _positive_int(num_rollout):
        out.append(ok("num-rollout", f"--num-rollout {num_rollout}"))
    else:
        out.append(
            fix(
                "num-rollout",
                f"--num-rollout is {_shown(num_rollout)}: set it (e.g. --num-rollout 500); "
                "--num-epoch needs --prompt-data, which stoa does not use",
            )
        )
    if getattr(args, "eval_interval", None) is not None:
        out.append(check_eval(args))
    if getattr(args, "prompt_data", None):
        out.append(warn("prompt-data", "--prompt-data is set but ignored (prompts come from the bucket): remove it"))
    if not getattr(args, "rollout_global_dataset", True):
        out.append(
            warn(
                "rollout-global-dataset",
                "--disable-rollout-global-dataset is set: slime then never saves its data source, so the consumer's "
                "cursor is not in the checkpoints (it resumes from the bucket copy, if any); remove the flag",
            )
        )
    if not getattr(args, "save", None):
        out.append(warn("save", "--save is not set: no checkpoints, so a restart starts over from the initial weights"
                        + ("" if getattr(args, "stoa_keep_dir", None) else
                           ", and the trainer keeps no copies of what it signed (set stoa_keep_dir)")))
    return out


def check_eval(args: argparse.Namespace) -> Finding:
    """The eval datasets (`--eval-config`, else `--eval-prompt-data`) resolve as slime resolves
    them, each with settings the fleet can honour."""
    from .eval_rollout import eval_datasets_from_args

    try:
        datasets = eval_datasets_from_args(args)
    except ValueError as exc:
        return fix("eval-interval", f"--eval-interval is set but {exc}; or remove --eval-interval")

    def shown(d: Any) -> str:
        temperature = "the run's temperature" if d.temperature is None else f"temperature {d.temperature:g}"
        tokens = "the run's max_tokens" if d.max_tokens is None else f"max {d.max_tokens} tokens"
        return f"{d.name} (split {d.split}, {d.k} per prompt, {temperature}, {tokens})"

    names = ", ".join(shown(d) for d in datasets)
    return ok("eval-interval", f"eval every {args.eval_interval} rollouts on {names}, answered by the fleet")


def check_mismatch_metrics(args: argparse.Namespace) -> Finding | None:
    """`--get-mismatch-metrics` is refused: slime would recompute log-probs for metrics stoa's
    loss never computes (the rollout function fails on it)."""
    if not getattr(args, "get_mismatch_metrics", False):
        return None
    return fix(
        "get-mismatch-metrics",
        "--get-mismatch-metrics is set: remove it (slime would recompute the old log-probs, one more forward pass "
        "per rollout, for metrics slime_stoa.dppo_loss never computes; the rollout function refuses it; "
        "train/train_rollout_logprob_abs_diff and train/ppo_kl measure the trainer-worker mismatch)",
    )


def check_hf_names(args: argparse.Namespace, facts: StoreFacts) -> list[Finding]:
    """The published tensor names will be the HF folder's (`--hf-checkpoint`) and the run's
    anchor has them. Seen here: the folder's config and tensor names, the anchor's tensor names,
    the tying flags. Not seen before training: the names slime's converter emits for this model
    family (the first `update_weights` gathers them); a family the converter does not know fails there."""
    from .hf_names import TIED_HEAD, config_ties, folder_tensor_names, head_plan, read_config

    hf = getattr(args, "hf_checkpoint", None)
    check = "hf-names"
    if not hf:
        return []
    folder = Path(str(hf)).expanduser()
    if not folder.is_dir():
        return [warn(check, f"--hf-checkpoint {hf} is not a local folder here: the published tensor names were not "
                            "checked against it")]
    config, names = read_config(folder), folder_tensor_names(folder)
    if config is not None and (why := unsupported_model(folder)):
        return [fix("model-family", f"--hf-checkpoint {why}: workers cannot run it; point --hf-checkpoint at a "
                                    "model of a supported family")]
    if config is None or names is None:
        return [warn(check, f"--hf-checkpoint {hf} has no readable config.json or safetensors weights here: the "
                            "published tensor names were not checked against it")]
    untied = bool(getattr(args, "untie_embeddings_and_output_weights", False))
    plan = head_plan(folder, untied=untied, hf_config=None)
    if plan.error is not None:
        return [fix("untie-embeddings", plan.error)]
    out: list[Finding] = []
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    tied = config_ties(config)
    head = (
        f"tied output head ({TIED_HEAD} not published: at --pipeline-model-parallel-size {pp} the last stage's copy "
        "is left out)" if plan.drop and pp > 1 else
        "tied output head (no lm_head)" if plan.drop else
        f"tied output head stored as {TIED_HEAD} (published as a copy of the embedding)" if tied else
        "untied output head"
    )
    anchor = facts.anchor_tensors
    if anchor is None:
        out.append(ok(check, f"--hf-checkpoint {hf}: {len(names)} tensors, {head}; the anchor's tensor names were "
                             "not read, the converter's are seen only at the first update_weights"))
        return out
    missing, extra = sorted(names - set(anchor)), sorted(set(anchor) - names)
    if missing or extra:
        def few(xs: list[str]) -> str:
            return ", ".join(xs[:5]) + (f" (+{len(xs) - 5} more)" if len(xs) > 5 else "")

        parts = ([f"lacks {few(missing)}"] if missing else []) + ([f"has {few(extra)} too"] if extra else [])
        # The run has weights, so its anchor stays: a new run is seeded from that folder.
        task = facts.manifest.task if facts.manifest is not None else "TASK"
        create = run_create_command(facts.url, NEW_RUN, model=str(hf), task=task)
        publish = shell_command("stoa", "weights", "publish-anchor", str(hf), "--store", facts.url, "--run", NEW_RUN)
        out.append(fix(
            check,
            f"the run's anchor v{facts.anchor_version} {' and '.join(parts)} compared with --hf-checkpoint {hf}, "
            "whose names the trainer publishes: the first update_weights would be refused. Seed a new run from "
            f"that folder (`{create}`, then `{publish}`, and stoa_run: {NEW_RUN} in the YAML) or point "
            "--hf-checkpoint at the anchor's model",
        ))
        return out
    out.append(ok(check, f"the anchor v{facts.anchor_version} has the {len(names)} tensor names of --hf-checkpoint "
                         f"{hf} ({head}); the converter's names are seen only at the first update_weights"))
    return out


def check_rollout_function(args: argparse.Namespace, config: Config = None) -> Finding:
    """`--rollout-function-path` importable here, and not slime's SGLang default."""
    path = getattr(args, "rollout_function_path", SLIME_DEFAULT_ROLLOUT_FUNCTION)
    check = "rollout-function-path"
    if path == SLIME_DEFAULT_ROLLOUT_FUNCTION:
        message = "--rollout-function-path is slime's SGLang default: "
        message += f"add --rollout-function-path {STOA_ROLLOUT_FUNCTION}"
        return fix(check, message)
    try:
        load_function(path)
    except ValueError as exc:
        instead = "" if path == STOA_ROLLOUT_FUNCTION else f", or use --rollout-function-path {STOA_ROLLOUT_FUNCTION}"
        return fix(
            check,
            f"{_src(config, 'rollout_function_path')} {path!r} does not import here ({exc}): install stoa in this "
            f"environment (pip install -e <stoa checkout>){instead}",
        )
    return ok(check, f"--rollout-function-path {path} imports")


def check_data_source(args: argparse.Namespace, config: Config = None) -> Finding:
    """`--data-source-path` is stoa's: the consumer state is then saved after every batch."""
    path = getattr(args, "data_source_path", SLIME_DEFAULT_DATA_SOURCE)
    check = "data-source-path"
    advice = (
        f"add --data-source-path {STOA_DATA_SOURCE} (the consumer state is then saved next to the checkpoint after "
        "every batch, so a killed trainer resumes with no group used twice and none skipped)"
    )
    if path == SLIME_DEFAULT_DATA_SOURCE:
        return warn(
            check,
            "--data-source-path is slime's default: the consumer state is kept only in its checkpoints' metadata "
            f"(a restart consumes again the groups of the rollouts after the last checkpoint); {advice}",
        )
    if _same_function(path, "slime_stoa.trainer.slime.data_source.StoaDataSource"):
        return ok(check, f"--data-source-path {path}: the consumer state is saved after every batch")
    try:
        load_function(path)
    except ValueError as exc:
        return fix(check, f"{_src(config, 'data_source_path')} {path!r} does not import here ({exc}): {advice}")
    return warn(check, f"--data-source-path {path} is not stoa's: {advice}")


def check_loss(args: argparse.Namespace, config: Config = None) -> list[Finding]:
    """`--loss-type custom_loss` with an importable `--custom-loss-function-path`; estimator and
    log-prob flags that suit it."""
    out: list[Finding] = []
    loss_type = getattr(args, "loss_type", "policy_loss")
    if loss_type == "custom_loss":
        out.append(ok("loss-type", "--loss-type custom_loss"))
    else:
        out.append(fix("loss-type", f"{_src(config, 'loss_type')} is {loss_type!r}: set --loss-type custom_loss"))
    path = getattr(args, "custom_loss_function_path", None)
    check = "custom-loss-function-path"
    if not path:
        message = f"--custom-loss-function-path is not set: add --custom-loss-function-path {STOA_LOSS_FUNCTION}"
        out.append(fix(check, message))
    else:
        try:
            load_function(path)
            out.append(ok(check, f"--custom-loss-function-path {path} imports"))
        except ValueError as exc:
            instead = "" if path == STOA_LOSS_FUNCTION else f", or use --custom-loss-function-path {STOA_LOSS_FUNCTION}"
            out.append(
                fix(
                    check,
                    f"--custom-loss-function-path {path!r} does not import here ({exc}): install stoa's trainer extras "
                    f"(pip install -e '<stoa checkout>[trainer]'){instead}",
                )
            )
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator == "grpo":
        out.append(ok("advantage-estimator", "--advantage-estimator grpo"))
    elif estimator == "ppo":
        out.append(
            fix(
                "advantage-estimator",
                "--advantage-estimator ppo trains a critic, whose path never publishes weights: "
                "use --advantage-estimator grpo",
            )
        )
    else:
        out.append(
            warn(
                "advantage-estimator",
                f"--advantage-estimator {estimator}: stoa's groups are built for grpo; use --advantage-estimator grpo "
                "unless you mean it",
            )
        )
    if not getattr(args, "use_rollout_logprobs", False):
        out.append(
            warn(
                "use-rollout-logprobs",
                "--use-rollout-logprobs is not set: slime recomputes old log-probs the DPPO loss never reads "
                "(an extra forward pass per rollout); add --use-rollout-logprobs",
            )
        )
    return out


def check_custom_config(
    args: argparse.Namespace,
    config: Config,
    *,
    store_url: str,
    run: str,
    config_error: str | None = None,
) -> list[Finding]:
    """The YAML exists and names this bucket and run, with publishing on; no unknown stoa_* or
    dppo_* keys (a typo would be ignored silently)."""
    path = getattr(args, "custom_config_path", None)
    if not path:
        return [
            fix(
                "custom-config",
                "--custom-config-path is not set: write a YAML with stoa_publish: true, stoa_bucket and stoa_run "
                "(see docs/slime.md) and pass --custom-config-path FILE",
            )
        ]
    if config is None:
        return [fix("custom-config", config_error or f"cannot read {path}")]
    out: list[Finding] = []
    bucket = config.get("stoa_bucket")
    if bucket is None:
        out.append(fix("stoa-bucket", f"{path} has no stoa_bucket: add `stoa_bucket: {store_url}`"))
    elif not same_store(bucket, store_url):
        message = f"{path} has stoa_bucket {bucket!r}, not {store_url!r}: set `stoa_bucket: {store_url}`"
        out.append(fix("stoa-bucket", message))
    else:
        out.append(ok("stoa-bucket", f"stoa_bucket is {store_url}"))
    got_run = config.get("stoa_run")
    if got_run != run:
        out.append(fix("stoa-run", f"{path} has stoa_run {got_run!r}, not {run!r}: set `stoa_run: {run}`"))
    else:
        out.append(ok("stoa-run", f"stoa_run is {run}"))
    publish = config.get("stoa_publish")
    if publish is True:
        out.append(ok("stoa-publish", "stoa_publish: true (the patched update_weights publishes to the bucket)"))
    else:
        found = "has no stoa_publish" if "stoa_publish" not in config else f"has stoa_publish {publish!r}"
        out.append(
            fix(
                "stoa-publish",
                f"{path} {found}: set `stoa_publish: true` (a YAML boolean), or slime publishes nothing "
                "(and the rollout function stops at its second rollout: the weight pointer does not move)",
            )
        )
    known = known_settings()
    unknown = sorted(k for k in config if k.startswith(("stoa_", "dppo_")) and k not in known)
    if unknown:
        out.append(
            fix(
                "custom-config-keys",
                f"{path} has unknown settings (a typo is ignored silently): "
                + "; ".join(_did_you_mean(k, known) for k in unknown)
                + ". Fix or remove them (docs/slime.md lists the settings)",
            )
        )
    return out


def _did_you_mean(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


def same_store(a: Any, b: str) -> bool:
    """Whether two store URLs name the same place (equal strings, or equal once parsed)."""
    if not isinstance(a, str):
        return False
    if a == b:
        return True
    try:
        la, lb = parse_store_url(a, {}), parse_store_url(b, {})
    except ValueError:
        return False
    return dataclasses.replace(la, url="") == dataclasses.replace(lb, url="")


def known_settings() -> frozenset[str]:
    """Every stoa_* and dppo_* key the plugin reads from slime's args (`StoaSettings.keys`)."""
    from .settings import StoaSettings

    return StoaSettings.keys()


def check_settings(args: argparse.Namespace) -> list[Finding]:
    """The stoa_* and dppo_* values parse: `StoaSettings` is built as the trainer's modules build
    it, its errors reported by the piece that reads the key. Every stoa piece builds the whole
    object, so while one is in use a bad key of a piece not in use fails it too, and is reported."""
    from .settings import StoaSettings, read_fields

    out: list[Finding] = []
    errors = StoaSettings.check(args)

    def problems(*parts: str) -> str:
        return "; ".join(str(e) for e in errors if e.part in parts)

    rollout_path = getattr(args, "rollout_function_path", SLIME_DEFAULT_ROLLOUT_FUNCTION)
    is_stoa_rollout = rollout_path != SLIME_DEFAULT_ROLLOUT_FUNCTION and _same_function(
        rollout_path, "slime_stoa.trainer.slime.rollout.generate_rollout"
    )
    if is_stoa_rollout:
        bad = problems("shared", "rollout")
        if bad:
            out.append(fix("rollout-settings", f"rollout function settings: {bad}"))
        else:
            out.append(ok("rollout-settings", "the rollout function's stoa_* settings parse"))
            if not read_fields(args, "check_publishing")["check_publishing"]:
                out.append(
                    warn(
                        "check-publishing",
                        "stoa_check_publishing is false: a trainer that stops publishing weights (patch not applied, "
                        "stoa_publish missing, publisher errors) goes unnoticed while the Macs sample old weights; "
                        "keep it only for slime's train_async.py or --update-weights-interval > 1",
                    )
                )
    publishing = getattr(args, "stoa_publish", None) is True
    if publishing:
        bad = problems("shared", "publisher")
        if bad:
            out.append(fix("publisher-settings", f"weight publishing settings: {bad}"))
        else:
            out.append(ok("publisher-settings", "the publisher's stoa_* settings parse"))
    elif is_stoa_rollout and problems("publisher"):
        out.append(fix("publisher-settings", f"weight publishing settings (read by the rollout function too): {problems('publisher')}"))
    if publishing and not is_stoa_rollout and problems("rollout"):
        out.append(fix("rollout-settings", f"rollout function settings (read by the publisher too): {problems('rollout')}"))
    loss_path = getattr(args, "custom_loss_function_path", None)
    is_stoa_loss = isinstance(loss_path, str) and bool(loss_path) and _same_function(loss_path, STOA_LOSS_FUNCTION)
    if getattr(args, "loss_type", None) == "custom_loss" and is_stoa_loss:
        from . import loss

        try:
            cfg = loss.config_from_args(args)
            out.append(ok("dppo-settings", f"DPPO loss settings parse (reduction {cfg.reduction})"))
        except (TypeError, ValueError) as exc:
            out.append(fix("dppo-settings", f"DPPO loss settings: {exc}"))
    elif problems("loss") and (is_stoa_rollout or getattr(args, "stoa_publish", None) is True):
        # the plugin reads every setting, so a bad dppo_* key fails the rollout function too
        out.append(fix("dppo-settings", f"DPPO loss settings: {problems('loss')}"))
    return out


def check_tokenizer(args: argparse.Namespace, facts: StoreFacts) -> Finding | None:
    """The rollout function can load the run's tokenizer (stoa_tokenizer_dir, else the anchor's)."""
    folder = getattr(args, "stoa_tokenizer_dir", None)
    if folder:
        if (Path(str(folder)).expanduser() / "tokenizer.json").is_file():
            return ok("tokenizer", f"stoa_tokenizer_dir {folder} has tokenizer.json")
        return fix("tokenizer", f"stoa_tokenizer_dir {folder} has no tokenizer.json: point it at the model's HF folder")
    if facts.pointer_version is None or facts.anchor_extras is None:
        return None  # reported by the pointer check
    if "tokenizer.json" in facts.anchor_extras:
        return ok("tokenizer", f"the run's anchor v{facts.anchor_version} ships tokenizer.json")
    return fix(
        "tokenizer",
        f"the run's anchor v{facts.anchor_version} has no tokenizer.json (the trainer decodes completions with it): "
        "set stoa_tokenizer_dir to the model's HF folder in the custom-config YAML",
    )


def check_run_key(args: argparse.Namespace, manifest: RunManifest, run_keys: Sequence[str] = ()) -> Finding:
    """A publishing trainer of a signed run holds its current run key: `stoa_run_key` names a 0600
    key file whose public half is the run manifest's `run_key`, or the newest key its rotations
    announce (`run_keys`: the run's keys, first to newest, as read from the bucket)."""
    from .settings import read_fields

    try:
        key = read_fields(args, "run_key")["run_key"]
    except ValueError as exc:
        return fix("run-key", str(exc))
    if manifest.run_key is None:
        if key is None:
            return ok("run-key", "the run is unsigned (no run_key): weights are published unsigned")
        return fix("run-key", f"stoa_run_key is set but run {manifest.run!r} is unsigned (no run_key in its manifest): "
                              "create a signed run (stoa run create with --key KEY_FILE), or drop stoa_run_key")
    if key is None:
        return fix("run-key", f"run {manifest.run!r} is signed (run_key {manifest.public_key.key_id}): "  # type: ignore[union-attr]
                              "set stoa_run_key to its key file, or workers refuse every version")
    keys = list(run_keys) or [manifest.run_key]
    held, path = key.public.to_text(), getattr(args, "stoa_run_key", "")
    if held == keys[-1]:
        rotated = f", rotation {len(keys) - 1}" if len(keys) > 1 else ""
        return ok("run-key", f"stoa_run_key is the run's key {key.key_id}{rotated} (mode 0600)")
    current = PublicKey.from_text(keys[-1]).key_id
    if held in keys:
        return fix("run-key", f"stoa_run_key {path} holds key {key.key_id}, which rotation {keys.index(held) + 1} "
                              f"replaced: the run's current key is {current}; use its key file")
    return fix("run-key", f"stoa_run_key {path} holds key {key.key_id}, the run's is {current}: use the run's key file")


def check_flags(
    args: argparse.Namespace, manifest: RunManifest | None, config: Config = None, run_keys: Sequence[str] = ()
) -> list[Finding]:
    """Every slime-flag check; those that need the run manifest only when it was read (`run_keys`:
    the run's keys, first to newest, when its rotations were read)."""
    out = check_rollout_gpus(args)
    if manifest is not None:
        out += [
            check_temperature(args, manifest, config),
            check_group_size(args, manifest, config),
            check_max_response_len(args, manifest, config),
        ]
        if getattr(args, "stoa_publish", None) is True:
            out.append(check_run_key(args, manifest, run_keys))
    out.append(check_top_p(args, config))
    out.append(check_batch_sizes(args))
    out += check_schedule(args)
    out.append(check_rollout_function(args, config))
    out.append(check_data_source(args, config))
    out += check_loss(args, config)
    mismatch = check_mismatch_metrics(args)
    if mismatch is not None:
        out.append(mismatch)
    return out


# -- the bucket -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreFacts:
    """What preflight read from the bucket (`inspect_store`)."""

    url: str
    run: str
    error: str | None = None  # the bucket could not be opened or read at all
    manifest: RunManifest | None = None
    manifest_error: str | None = None  # missing or invalid run manifest
    task_key: str | None = None  # where the run's task data should be
    task_present: bool = False
    pointer_version: int | None = None  # None: no published weights
    pointer_error: str | None = None
    anchor_version: int | None = None
    anchor_extras: tuple[str, ...] | None = None  # file names beside the anchor's weights
    anchor_tensors: tuple[str, ...] | None = None  # the anchor's tensor names (None: not read)
    run_keys: tuple[str, ...] = ()  # a signed run's keys, first to newest, as far as its rotations verify


async def inspect_store(url: str, run: str, *, environ: Mapping[str, str] | None = None) -> StoreFacts:
    """Read the run's manifest, task data key, pointer and anchor manifest; never raises for
    store trouble (it lands in the facts)."""
    from slime_stoa.protocol.pulse.history import NotPublished, read_anchor_manifest, read_pointer
    from slime_stoa.protocol.pulse.manifests import ManifestError

    layout = RunLayout(run)
    try:
        store = open_store(url, environ=environ)
    except (StoreError, ValueError) as exc:
        return StoreFacts(url, run, error=str(exc))
    async with store:
        try:
            manifest = await read_run_manifest(store, run)
        except RunNotFound:
            return StoreFacts(url, run, manifest_error=f"{layout.run_manifest} does not exist")
        except StoreError as exc:
            return StoreFacts(url, run, error=str(exc))
        except ValueError as exc:
            return StoreFacts(url, run, manifest_error=str(exc))
        facts: dict[str, Any] = {"manifest": manifest, "run_keys": await run_keys(store, run, manifest)}
        try:
            task_key = layout.task_data(manifest.task, manifest.task_split)
            facts["task_key"] = task_key
            facts["task_present"] = await store.exists(task_key)
            try:
                pointer = await read_pointer(store, run)
            except NotPublished:
                return StoreFacts(url, run, **facts)
            facts["pointer_version"] = pointer.version
            facts["anchor_version"] = pointer.anchor.version
            anchor = await read_anchor_manifest(store, pointer.anchor.manifest)
            facts["anchor_extras"] = tuple(f.name for f in anchor.extras)
            facts["anchor_tensors"] = await anchor_tensor_names(store, anchor.weights)
        except (StoreError, ManifestError, ValueError) as exc:
            facts["pointer_error"] = str(exc)
        return StoreFacts(url, run, **facts)


async def run_keys(store: Any, run: str, manifest: RunManifest) -> tuple[str, ...]:
    """The run's keys, first to newest: the manifest's `run_key` and each rotation after it that
    verifies (() for an unsigned run)."""
    if manifest.run_key is None:
        return ()
    trust = RunTrust.from_text(run, manifest.run_key)
    with contextlib.suppress(Untrusted, StoreError):  # the keys learned so far stand
        await load_rotations(store, trust)
    return tuple(k.to_text() for k in trust.keys)


async def anchor_tensor_names(store: Any, weights: Sequence[Any]) -> tuple[str, ...] | None:
    """The tensor names in the safetensors headers of an anchor's weight files (two ranged reads
    each); None when one cannot be read."""
    from slime_stoa.protocol.hf.safetensors_io import MAX_HEADER_BYTES, parse_header

    names: list[str] = []
    try:
        for f in weights:
            if not f.name.endswith(".safetensors"):
                continue
            head = await store.get(f.key, offset=0, length=8)
            (n,) = struct.unpack("<Q", head.data[:8])
            if n > MAX_HEADER_BYTES:
                return None
            body = await store.get(f.key, offset=8, length=n)
            names += [t.name for t in parse_header(head.data[:8] + body.data, f.bytes).tensors]
    except (StoreError, ValueError, struct.error, AttributeError):
        return None
    return tuple(sorted(names))


def check_store(facts: StoreFacts) -> list[Finding]:
    """Bucket reachable, run manifest, task data, published weights."""
    url, run = facts.url, facts.run
    if facts.error is not None:
        return [fix("bucket", f"cannot read {url}: {facts.error}")]
    out = [ok("bucket", f"{url} is reachable")]
    if facts.manifest is None:
        out.append(
            fix(
                "run-manifest",
                f"run {run!r} has no usable manifest ({facts.manifest_error}): create it with "
                f"`{run_create_command(url, run)}`",
            )
        )
        return out
    m = facts.manifest
    out.append(
        ok(
            "run-manifest",
            f"run {run}: task {m.task}, group size {m.group_size}, temperature {m.temperature:g}, "
            f"max_tokens {m.max_tokens}",
        )
    )
    if facts.task_present:
        out.append(ok("task-data", f"{facts.task_key} exists"))
    else:
        out.append(
            fix(
                "task-data",
                f"{facts.task_key} is missing: run `{task_prepare_command(m.task, m.task_split, url, run)}`",
            )
        )
    if facts.pointer_error is not None:
        out.append(
            fix(
                "weights",
                f"the run's published weights cannot be read ({facts.pointer_error}): check with "
                f"`{shell_command('stoa', 'weights', 'verify', '--store', url, '--run', run)}`",
            )
        )
    elif facts.pointer_version is None:
        signed = ("--key", "RUN_KEY_FILE") if m.run_key is not None else ()  # refused unsigned on a signed run
        publish = shell_command("stoa", "weights", "publish-anchor", "HF_DIR", "--store", url, "--run", run, *signed)
        out.append(
            fix(
                "weights",
                f"run {run!r} has no published weights: seed it with `{publish}` (HF_DIR: the model slime starts from"
                + (", RUN_KEY_FILE: the run's key file)" if signed else ")"),
            )
        )
    else:
        out.append(ok("weights", f"weights published: v{facts.pointer_version} (anchor v{facts.anchor_version})"))
    return out


# -- the slime checkout -----------------------------------------------------------------------------
def check_patch(slime_dir: str | Path | None) -> Finding:
    """stoa's slime patches are applied in the checkout at `slime_dir`."""
    check = "slime-patch"
    if not slime_dir:
        return warn(check, "no --slime-dir given: the slime patch was not checked (pass --slime-dir or set SLIME_DIR)")
    root = Path(slime_dir)
    if not root.is_dir():
        return fix(check, f"slime checkout {root} is not a folder: pass the root of the slime checkout as --slime-dir")
    from . import patching as aps

    try:
        paths = sorted(aps.PATCH_DIR.glob(aps.PATCH_GLOB))
        if not paths:
            return fix(check, f"no patches found in {aps.PATCH_DIR}")
        statuses = [(p, aps.patch_status(root, p)) for p in aps.load_patches(paths)]
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        return fix(check, str(exc))
    apply_cmd = shell_command("python", "scripts/apply_slime_patches.py", root)
    bad = [f"{p.name}: {s.message}" for p, s in statuses if s.state == aps.NOT_APPLICABLE]
    if bad:
        return fix(check, "a stoa patch does not fit this slime checkout: " + " ".join(bad))
    pending = [p.name for p, s in statuses if s.state == aps.NOT_APPLIED]
    if pending:
        return fix(check, f"{', '.join(pending)} not applied to {root}: run `{apply_cmd}` (from the stoa checkout)")
    return ok(check, f"stoa's slime patches are applied in {root}")


# -- everything -------------------------------------------------------------------------------------
def run_checks(
    store_url: str,
    run: str,
    slime_argv: Sequence[str],
    *,
    slime_dir: str | Path | None = None,
    facts: StoreFacts,
) -> list[Finding]:
    """Every check, given what was read from the bucket (`inspect_store`)."""
    flag_parser = slime_flag_parser()
    try:
        flags, _unknown = parse_slime_args(slime_argv, flag_parser)
    except ValueError as exc:
        return [*check_store(facts), fix("slime-flags", str(exc))]
    config: dict[str, Any] | None = None
    config_error = None
    if flags.custom_config_path:
        try:
            config = load_custom_config(flags.custom_config_path)
        except ValueError as exc:
            config_error = str(exc)
    args = effective_args(flags, config or {})
    out = [*check_store(facts), check_flag_parser(flag_parser), *check_flags(args, facts.manifest, config, facts.run_keys)]
    out += check_custom_config(args, config, store_url=store_url, run=run, config_error=config_error)
    out += check_settings(args)
    tokenizer = check_tokenizer(args, facts)
    if tokenizer is not None:
        out.append(tokenizer)
    out += check_hf_names(args, facts)
    out.append(check_patch(slime_dir))

    for found in (check_slime_api(), check_hook()):  # None where slime is not importable
        if found is not None:
            out.append(found)
    return out


def failed(findings: Iterable[Finding]) -> bool:
    return any(f.failed for f in findings)


def format_findings(findings: Sequence[Finding]) -> str:
    """One line per finding (`ok`, `warn`, `FIX`) and a summary line."""
    labels = {OK: "ok  ", WARN: "warn", FIX: "FIX "}
    width = max((len(f.check) for f in findings), default=0)
    lines = [f"{labels[f.status]}  {f.check:<{width}}  {f.message}" for f in findings]
    counts = {s: sum(f.status == s for f in findings) for s in STATUSES}
    verdict = "ready to launch" if not counts[FIX] else "fix the FIX lines, then run preflight again"
    lines.append(f"{len(findings)} checks: {counts[OK]} ok, {counts[WARN]} warnings, {counts[FIX]} to fix; {verdict}")
    return "\n".join(lines)
