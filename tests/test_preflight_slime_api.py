"""preflight's slime-name check (`preflight_slime_api`) against stand-ins of slime: the stand-ins
of tests/slime_standins.py plus modules with the signatures slime has at SLIME_COMMIT for the rest
of the table; then a slime without `slime.utils.accelerator` and one whose weight iterator takes no
`transform_ue8m0` (both as slime v0.3.1), each one FIX line naming the commit."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from slime_stoa.trainer.slime import preflight
from slime_stoa.trainer.slime.preflight_slime_api import (
    HOOK_MARKER,
    SLIME_COMMIT,
    SLIME_NAMES,
    check_hook,
    check_slime_api,
    row_problem,
)
from tests import slime_standins

ROOT = Path(__file__).resolve().parents[1]
ITERATOR = "slime.backends.megatron_utils.update_weight.hf_weight_iterator_direct"


def module(name: str, **attrs: Any) -> types.ModuleType:
    out = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(out, key, value)
    return out


def iterator_classes(*, ue8m0: bool) -> type:
    """slime's HfWeightIteratorDirect over its base (the base's __init__ names the parameters; the
    subclass passes *args, **kwargs on), with or without `transform_ue8m0`."""
    if ue8m0:
        class Base:
            def __init__(self, args, model, model_name, quantization_config, transform_ue8m0=True):
                self.args = args
    else:
        class Base:  # type: ignore[no-redef]
            def __init__(self, args, model, model_name, quantization_config):
                self.args = args

    class HfWeightIteratorDirect(Base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

        def get_hf_weight_chunks(self, megatron_local_weights, progress_desc="Update weights",
                                 should_convert_chunk=None, param_info_buckets=None):
            return iter(())

        def _convert_to_hf_named_tensors(self, megatron_full_params, param_infos):
            return []

    return HfWeightIteratorDirect


def standins(*, accelerator: bool = True, ue8m0: bool = True) -> dict[str, types.ModuleType]:
    """The slime modules stoa uses, with slime's signatures at SLIME_COMMIT (or one of the two
    v0.3.1 differences)."""
    def nothing() -> None:
        return None

    def get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, sample_denoms=None,
                               calculate_per_token_loss=False):
        return None

    def slice_log_prob_with_cp(log_prob, total_length, response_length):
        return log_prob

    def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                                  with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None):
        return {}

    def get_rollout_top_p_logprob_kwargs(args, batch):
        return {}

    out = dict(slime_standins.modules())
    for name in ("slime.backends", "slime.backends.megatron_utils", "slime.backends.megatron_utils.update_weight"):
        out[name] = module(name)
    if accelerator:
        out["slime.utils.accelerator"] = module("slime.utils.accelerator", empty_cache=nothing)
    out["slime.utils.distributed_utils"] = module("slime.utils.distributed_utils", get_gloo_group=nothing)
    out["slime.utils.reloadable_process_group"] = module(
        "slime.utils.reloadable_process_group", reload_process_groups=nothing, destroy_process_groups=nothing
    )
    out[ITERATOR] = module(ITERATOR, HfWeightIteratorDirect=iterator_classes(ue8m0=ue8m0))
    out["slime.backends.megatron_utils.cp_utils"] = module(
        "slime.backends.megatron_utils.cp_utils", get_sum_of_sample_mean=get_sum_of_sample_mean,
        slice_log_prob_with_cp=slice_log_prob_with_cp,
    )
    out["slime.backends.megatron_utils.loss"] = module(
        "slime.backends.megatron_utils.loss", get_log_probs_and_entropy=get_log_probs_and_entropy,
        get_rollout_top_p_logprob_kwargs=get_rollout_top_p_logprob_kwargs,
    )
    out["slime.backends.megatron_utils.hf_to_megatron"] = module("slime.backends.megatron_utils.hf_to_megatron", _LOADERS={})

    class TensorBackuper:
        def get(self, tag: str) -> dict:
            return {}

    def get_slime_extra_args_provider(add_custom_arguments=None):
        return None

    def convert_to_hf(args, model_name, name, param, quantization_config=None, transform_ue8m0=True):
        return []

    out["slime.utils.tensor_backper"] = module("slime.utils.tensor_backper", TensorBackuper=TensorBackuper)
    out["slime.utils.arguments"] = module(
        "slime.utils.arguments", get_slime_extra_args_provider=get_slime_extra_args_provider
    )
    out["slime.backends.megatron_utils.megatron_to_hf"] = module(
        "slime.backends.megatron_utils.megatron_to_hf", convert_to_hf=convert_to_hf
    )
    return out


def install(monkeypatch: pytest.MonkeyPatch, modules: dict[str, types.ModuleType]) -> None:
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_the_tested_slime_passes_every_row(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, standins())
    assert [row_problem(row) for row in SLIME_NAMES] == [None] * len(SLIME_NAMES)
    finding = check_slime_api()
    assert finding is not None and finding.status == preflight.OK and finding.check == "slime-api"


def test_a_slime_without_the_accelerator_module_is_one_fix_line_naming_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, standins(accelerator=False))
    finding = check_slime_api()
    assert finding is not None and finding.status == preflight.FIX
    assert "slime.utils.accelerator cannot be imported" in finding.message and SLIME_COMMIT in finding.message
    assert "\n" not in finding.message


def test_a_weight_iterator_without_transform_ue8m0_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, standins(ue8m0=False))
    finding = check_slime_api()
    assert finding is not None and finding.status == preflight.FIX
    assert "HfWeightIteratorDirect takes no transform_ue8m0" in finding.message and SLIME_COMMIT in finding.message


def test_both_differences_are_counted_and_a_renamed_parameter_or_missing_name_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    modules = standins(accelerator=False, ue8m0=False)
    modules["slime.backends.megatron_utils.cp_utils"].slice_log_prob_with_cp = lambda log_probs, total_length, response_length: 0
    del modules["slime.backends.megatron_utils.hf_to_megatron"]._LOADERS
    install(monkeypatch, modules)
    finding = check_slime_api()
    assert finding is not None and "(and 3 more)" in finding.message
    problems = [row_problem(row) for row in SLIME_NAMES]
    assert any(p and "slice_log_prob_with_cp takes no log_prob" in p for p in problems)
    assert any(p and "has no '_LOADERS'" in p for p in problems)


def test_no_slime_no_line_and_preflight_runs_the_check_where_slime_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {})
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not Path(p, "slime").is_dir()])
    assert check_slime_api() is None
    calls: list[str] = []

    def importer(name: str) -> types.ModuleType:
        calls.append(name)
        raise ImportError(f"No module named {name!r}")

    assert check_slime_api(importer) is None and calls == ["slime"]


def test_the_pinned_commit_is_the_stand_ins_and_the_docs() -> None:
    assert SLIME_COMMIT == slime_standins.SLIME_COMMIT
    docs = (ROOT / "docs" / "slime.md").read_text()
    assert SLIME_COMMIT in docs and "slime-api" in docs


# -- the hook: in the weight update the importable slime runs ------------------------------------------
ACTOR = """
from functools import wraps


def timer(func):  # as slime.observability.timer decorates update_weights
    @wraps(func)
    def wrapper(*args, **kwargs):
        return func(*args, **kwargs)

    return wrapper


class MegatronTrainRayActor:
    @timer
    def update_weights(self):
        rollout_engines = []
{early}        if not rollout_engines:
{hook}            return
"""
HOOK_LINES = """            if getattr(self.args, "stoa_publish", False):  # {marker} v2
                from slime_stoa import publish_weights

                publish_weights(self, self.args)
                return
"""


def actor_module(tmp_path: Path, *, hook: bool = True, early: bool = False) -> types.ModuleType:
    """slime's actor module as a real file (its source is what the check reads)."""
    path = tmp_path / "actor.py"
    path.write_text(ACTOR.format(early="        return\n" if early else "",
                                 hook=HOOK_LINES.format(marker=HOOK_MARKER) if hook else ""))
    spec = importlib.util.spec_from_file_location("slime.backends.megatron_utils.actor", path)
    assert spec is not None and spec.loader is not None
    out = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(out)
    return out


def test_the_hook_is_checked_in_the_weight_update_python_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modules = standins()
    for case, kw in (("patched", {}), ("unpatched", {"hook": False}), ("early", {"early": True})):
        (tmp_path / case).mkdir()
        modules["slime.backends.megatron_utils.actor"] = actor_module(tmp_path / case, **kw)
        install(monkeypatch, modules)
        found = check_hook()
        assert found is not None and found.check == "slime-hook" and "\n" not in found.message
        if case == "patched":
            assert found.status == preflight.OK and str(tmp_path / case / "actor.py") in found.message
        elif case == "unpatched":
            assert found.status == preflight.FIX and f"has no stoa hook ({HOOK_MARKER!r})" in found.message
            assert "apply_slime_patches.py" in found.message
        else:
            assert found.status == preflight.FIX and "returns (line 4 of the method) before stoa's hook" in found.message
            assert SLIME_COMMIT in found.message


def test_the_patch_file_carries_the_hooks_marker() -> None:
    from slime_stoa.trainer.slime import patching

    patches = patching.load_patches(sorted(patching.PATCH_DIR.glob(patching.PATCH_GLOB)))
    assert [p.marker for p in patches] == [HOOK_MARKER]


def test_an_actor_that_does_not_import_is_a_warning_and_no_slime_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = standins()
    install(monkeypatch, modules)  # no actor module among them: importing it fails
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not Path(p, "slime").is_dir()])
    found = check_hook()
    assert found is not None and found.status == preflight.WARN and "the hook was not checked" in found.message
    install(monkeypatch, {})
    assert check_hook() is None
