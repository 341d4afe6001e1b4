"""Preflight's check of slime's own names: every slime module, function and class stoa's plugin
uses, with the parameters it passes, against the slime that is importable here.

stoa is tested against one slime commit (`SLIME_COMMIT`); slime's release tags lag behind it
(v0.3.1 has no ``slime.utils.accelerator`` and its weight iterator takes no ``transform_ue8m0``),
so a slime installed from a tag fails inside the first ``update_weights``, after the model is
loaded. `check_slime_api` finds that before launch: each row of `SLIME_NAMES` is imported and
its parameters read with ``inspect.signature``; the first row that does not hold is one FIX line
naming the commit to check out. Where slime is not importable (preflight run away from the
trainer's environment) nothing is checked and no line is printed.

`check_hook` reads the weight update slime will run, as Python imports it (the file the trainer's
workers load, which need not be the checkout `--slime-dir` names): stoa's patch marker must be in
``MegatronTrainRayActor.update_weights`` with no ``return`` at the top of that method before it
(an upstream early return would skip the hook while the patch's context lines still match).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .findings import Finding, fix, ok, warn

#: The slime commit stoa's plugin and patches are tested against (`git -C SLIME_DIR checkout` it).
SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
CHECK = "slime-api"
HOOK_CHECK = "slime-hook"
HOOK_MODULE = "slime.backends.megatron_utils.actor"
HOOK_METHOD = "MegatronTrainRayActor.update_weights"
#: The marker stoa's patch puts on the line of the hook (`patching`: "stoa-patch: <name>").
HOOK_MARKER = "stoa-patch: publish_weights"


@dataclass(frozen=True, slots=True)
class SlimeName:
    """A slime name stoa uses: `attribute` (dotted: ``Class.method``) of `module`, and the
    parameters stoa passes to it by name (positional arguments named as slime names them);
    `callable` False for data stoa reads or writes (a dict)."""

    module: str
    attribute: str
    params: tuple[str, ...] = ()
    callable: bool = True
    used_by: str = ""


_ITERATOR = "slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct"
#: Every slime name the plugin uses (module, name, the parameters stoa passes).
SLIME_NAMES: tuple[SlimeName, ...] = (
    SlimeName("slime.utils.accelerator", "empty_cache", (), used_by="publish.gather_state"),
    SlimeName("slime.utils.tensor_backper", "TensorBackuper.get", ("tag",),
              used_by="publish.gather_state (actor.weights_backuper)"),
    SlimeName("slime.utils.arguments", "get_slime_extra_args_provider", (), used_by="preflight.slime_own_parser"),
    SlimeName(
        "slime.backends.megatron_utils.megatron_to_hf", "convert_to_hf", ("args", "model_name", "name", "param"),
        used_by="checkpoint_to_hf (LFM2's names for slime's converter)",
    ),
    SlimeName("slime.utils.distributed_utils", "get_gloo_group", (), used_by="publish.publish_weights"),
    SlimeName("slime.utils.reloadable_process_group", "reload_process_groups", (), used_by="publish.gather_state"),
    SlimeName("slime.utils.reloadable_process_group", "destroy_process_groups", (), used_by="publish.gather_state"),
    SlimeName(
        _ITERATOR, "HfWeightIteratorDirect",
        ("args", "model", "model_name", "quantization_config", "transform_ue8m0"), used_by="publish.hf_weight_iterator",
    ),
    SlimeName(
        _ITERATOR, "HfWeightIteratorDirect.get_hf_weight_chunks",
        ("megatron_local_weights", "progress_desc", "should_convert_chunk"), used_by="publish.gather_state",
    ),
    SlimeName(
        _ITERATOR, "HfWeightIteratorDirect._convert_to_hf_named_tensors", ("megatron_full_params", "param_infos"),
        used_by="publish.hf_weight_iterator (replaced for LFM2)",
    ),
    SlimeName(
        "slime.backends.megatron_utils.cp_utils", "get_sum_of_sample_mean",
        ("total_lengths", "response_lengths", "loss_masks", "sample_denoms", "calculate_per_token_loss"),
        used_by="loss.dppo_loss",
    ),
    SlimeName(
        "slime.backends.megatron_utils.cp_utils", "slice_log_prob_with_cp",
        ("log_prob", "total_length", "response_length"), used_by="loss.dppo_loss",
    ),
    SlimeName(
        "slime.backends.megatron_utils.loss", "get_log_probs_and_entropy",
        ("logits", "args", "unconcat_tokens", "total_lengths", "response_lengths", "with_entropy",
         "top_p_token_ids", "top_p_token_offsets"),
        used_by="loss.dppo_loss",
    ),
    SlimeName(
        "slime.backends.megatron_utils.loss", "get_rollout_top_p_logprob_kwargs", ("args", "batch"),
        used_by="loss.dppo_loss",
    ),
    SlimeName("slime.backends.megatron_utils.hf_to_megatron", "_LOADERS", callable=False, used_by="lfm2.spec"),
    SlimeName("slime.rollout.base_types", "RolloutFnTrainOutput", ("samples", "metrics"), used_by="rollout"),
    SlimeName("slime.rollout.base_types", "RolloutFnEvalOutput", ("data", "metrics"), used_by="rollout, eval_rollout"),
    SlimeName("slime.utils.types", "Sample", ("group_index", "index", "status"), used_by="data_source, eval_rollout"),
    SlimeName("slime.utils.types", "Sample.Status", callable=False, used_by="rollout, eval_rollout"),
)


def _signature(obj: Any) -> inspect.Signature | None:
    """The parameters `obj` takes; for a class, those of the first ``__init__`` along its MRO
    that names its parameters (a subclass's ``__init__(*args, **kwargs)`` passes them on)."""
    if inspect.isclass(obj):
        for klass in obj.__mro__:
            init = vars(klass).get("__init__")
            if init is None or klass is object:
                continue
            try:
                sig = inspect.signature(init)
            except (TypeError, ValueError):
                return None
            named = [p for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            if named:
                return sig.replace(parameters=list(sig.parameters.values())[1:])
        return None
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


def row_problem(row: SlimeName, import_module: Callable[[str], ModuleType] = importlib.import_module) -> str | None:
    """What does not hold of one row (None: it holds)."""
    try:
        obj: Any = import_module(row.module)
    except ImportError as exc:
        return f"{row.module} cannot be imported ({exc})"
    where = row.module
    for part in row.attribute.split("."):
        if not hasattr(obj, part):
            return f"{where} has no {part!r}"
        obj, where = getattr(obj, part), f"{where}.{part}"
    if not row.callable:
        return None
    if not callable(obj):
        return f"{where} is not callable"
    sig = _signature(obj)
    if sig is None:
        return None  # a builtin without a readable signature: nothing more to compare
    keyword = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    named = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    lacking = [p for p in row.params if p not in named and not keyword]
    if lacking:
        return f"{where} takes no {', '.join(lacking)} (stoa's {row.used_by} passes it)"
    return None


def check_slime_api(import_module: Callable[[str], ModuleType] = importlib.import_module) -> Finding | None:
    """Every row of `SLIME_NAMES` against the importable slime; None when slime is not importable."""
    try:
        import_module("slime")
    except ImportError:
        return None
    problems = [p for row in SLIME_NAMES if (p := row_problem(row, import_module)) is not None]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return fix(
            CHECK,
            f"this slime is not the one stoa is tested with: {problems[0]}{more}; check out slime commit "
            f"{SLIME_COMMIT} (git -C SLIME_DIR checkout {SLIME_COMMIT}) and apply stoa's patches",
        )
    return ok(CHECK, f"the {len(SLIME_NAMES)} slime names stoa uses are there, with the parameters it passes")


def check_hook(import_module: Callable[[str], ModuleType] = importlib.import_module) -> Finding | None:
    """stoa's publish hook is in the weight update the importable slime runs (module doc); None
    where slime is not importable."""
    try:
        import_module("slime")
    except ImportError:
        return None
    apply = "apply stoa's patch to the slime Python imports (python scripts/apply_slime_patches.py SLIME_DIR)"
    try:
        method: Any = import_module(HOOK_MODULE)
        for part in HOOK_METHOD.split("."):
            method = getattr(method, part)
        source = textwrap.dedent(inspect.getsource(method))
        where = inspect.getsourcefile(method) or HOOK_MODULE
    except Exception as exc:  # a module that does not import here (no Ray, no GPU) says why
        return warn(HOOK_CHECK, f"{HOOK_MODULE}.{HOOK_METHOD} could not be read here ({type(exc).__name__}: {exc}): "
                                "the hook was not checked")
    lines = source.splitlines()
    marked = [i + 1 for i, line in enumerate(lines) if HOOK_MARKER in line]
    if not marked:
        return fix(HOOK_CHECK, f"{HOOK_METHOD} in {where} has no stoa hook ({HOOK_MARKER!r}): {apply}")
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else []
    early = [node.lineno for node in body if isinstance(node, ast.Return) and node.lineno < marked[0]]
    if early:
        return fix(HOOK_CHECK, f"{HOOK_METHOD} in {where} returns (line {early[0]} of the method) before stoa's hook: "
                               f"this slime is not the one stoa is tested with; check out slime commit {SLIME_COMMIT}")
    return ok(HOOK_CHECK, f"{HOOK_METHOD} in {where} reaches stoa's publish hook")
