"""stoa's plugin against slime's own contracts and real interfaces (slime at SLIME_COMMIT), with
the stand-ins of tests/slime_standins.py:

- slime's plugin contract tests (tests/plugin_contracts/test_plugin_rollout_contracts.py and
  test_plugin_path_loading_contracts.py) call the rollout and eval function with `args=None`
  and check the signature and the output types; the data source is built as `cls(args)` and
  asked for `get_samples(1)`; the custom loss is called as `fn(args, batch, logits,
  sum_of_sample_mean)` (slime/backends/megatron_utils/loss.py);
- `--get-mismatch-metrics` is refused;
- the eval datasets resolve per dataset as slime/utils/eval_config.py resolves them;
- eval samples carry their prompt as `group_index`;
- a tied-embedding model at pipeline parallelism > 1 publishes the HF folder's names.
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from slime_stoa.protocol.hf.safetensors_io import write_safetensors
from slime_stoa.trainer.slime import eval_rollout, hf_names
from slime_stoa.trainer.slime.data_source import StoaDataSource
from slime_stoa.trainer.slime.rollout import generate_rollout
from tests import slime_standins
from tests.slime_standins import Sample

# slime's sglang_rollout.generate_rollout, the signature the contract compares with.
SLIME_DEFAULT_PARAMS = (("args", inspect.Parameter.empty), ("rollout_id", inspect.Parameter.empty),
                        ("data_source", inspect.Parameter.empty), ("evaluation", False))


@pytest.fixture
def slime(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, module in slime_standins.modules().items():
        monkeypatch.setitem(sys.modules, name, module)


# -- slime's plugin contract (tests/plugin_contracts) ------------------------------------------------
def make_sample(index: int, reward: float = 1.0) -> Sample:
    tokens = [1000 + index, 2000 + index]
    return Sample(index=index, prompt=f"prompt-{index}", response=f"response-{index}", tokens=tokens,
                  response_length=len(tokens), reward=reward, status=Sample.Status.COMPLETED, metadata={})


class ContractDataSource:
    def __init__(self, n_samples_per_prompt: int = 2):
        self.n_samples_per_prompt = n_samples_per_prompt
        self.next_index = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = []
        for _ in range(num_samples):
            groups.append([make_sample(self.next_index + i, reward=0.0) for i in range(self.n_samples_per_prompt)])
            self.next_index += self.n_samples_per_prompt
        return groups


class ContractEvalDataSource:
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return [[Sample(index=index, prompt=f"prompt-{index}")] for index in range(num_samples)]


def call_rollout_fn(fn: Any, *args: Any, evaluation: bool) -> Any:
    """slime's `call_rollout_fn` (slime/rollout/base_types.py)."""
    return fn(*args, evaluation=evaluation)


def assert_sample_contract(sample: Any) -> None:
    assert isinstance(sample, Sample)
    assert isinstance(sample.tokens, list) and all(isinstance(t, int) for t in sample.tokens)
    assert isinstance(sample.response, str)
    assert isinstance(sample.response_length, int)
    assert sample.reward is not None
    assert isinstance(sample.status, Sample.Status)


def test_the_rollout_function_has_slimes_default_signature() -> None:
    for fn in (generate_rollout, __import__("slime_stoa").generate_rollout):
        params = inspect.signature(fn).parameters
        assert tuple((n, p.default) for n, p in params.items()) == SLIME_DEFAULT_PARAMS
        assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def test_the_rollout_contract_with_args_none(slime: None) -> None:
    """`assert_rollout_function_matches_default_contract`: train then eval, args=None, rollout 2."""
    source = ContractDataSource()
    train = call_rollout_fn(generate_rollout, None, 2, source, evaluation=False)
    assert train.samples and all(len(group) == 2 for group in train.samples)
    for group in train.samples:
        for sample in group:
            assert_sample_contract(sample)
    out = call_rollout_fn(generate_rollout, None, 2, source, evaluation=True)
    assert out.data
    for entry in out.data.values():
        assert set(entry) >= {"rewards", "truncated", "samples"}
        assert len(entry["rewards"]) == len(entry["truncated"]) == len(entry["samples"])
        for sample in entry["samples"]:
            assert_sample_contract(sample)


def test_the_eval_function_path_contract_with_args_none(slime: None) -> None:
    """`check_eval_function_path`: `call_rollout_fn(fn, None, 5, ContractEvalDataSource(), evaluation=True)`."""
    out = call_rollout_fn(generate_rollout, None, 5, ContractEvalDataSource(), evaluation=True)
    assert out.data and isinstance(out.data, dict)


def test_the_data_source_path_contract(slime: None) -> None:
    """`check_data_source_path`: `cls.__init__(self, args, ...)`, `cls(make_args()).get_samples(1)` is a list."""
    assert tuple(inspect.signature(StoaDataSource.__init__).parameters)[:2] == ("self", "args")

    class Args:
        rollout_global_dataset = False
        buffer_filter_path = None
        n_samples_per_prompt = 2
        custom_rm_path = None
        group_rm = False
        rm_type = None
        reward_key = None

    groups = StoaDataSource(Args()).get_samples(1)
    assert isinstance(groups, list) and [len(g) for g in groups] == [2]
    assert isinstance(StoaDataSource(None).get_samples(1), list)
    for method, params in (("add_samples", ("self", "samples")), ("save", ("self", "rollout_id")),
                           ("load", ("self", "rollout_id"))):
        assert tuple(inspect.signature(getattr(StoaDataSource, method)).parameters) == params


def test_the_loss_has_slimes_custom_loss_signature() -> None:
    from slime_stoa import dppo_loss

    assert tuple(inspect.signature(dppo_loss).parameters) == ("args", "batch", "logits", "sum_of_sample_mean")


# -- refused flags ------------------------------------------------------------------------------------
def test_get_mismatch_metrics_fails_the_first_call(slime: None) -> None:
    args = types.SimpleNamespace(get_mismatch_metrics=True, stoa_bucket="file:///nowhere", stoa_run="r")
    for evaluation in (False, True):
        with pytest.raises(ValueError, match="--get-mismatch-metrics is not supported") as info:
            generate_rollout(args, 0, ContractDataSource(), evaluation=evaluation)
        assert "\n" not in str(info.value)


# -- eval datasets ------------------------------------------------------------------------------------
def test_eval_datasets_resolve_as_slimes_eval_config(tmp_path: Path) -> None:
    args = types.SimpleNamespace(
        eval_prompt_data=["a", "test", "b", "dev"], n_samples_per_eval_prompt=None, n_samples_per_prompt=4,
        eval_temperature=None, rollout_temperature=0.8, rollout_max_response_len=300,
    )
    a, b = eval_rollout.eval_datasets_from_args(args)
    assert (a.name, a.split, a.k, a.temperature, a.max_tokens) == ("a", "test", 4, 0.8, 300)
    assert b.split == "dev"
    args.eval_max_response_len, args.n_samples_per_eval_prompt = 50, 2
    assert [(d.k, d.max_tokens) for d in eval_rollout.eval_datasets_from_args(args)] == [(2, 50), (2, 50)]
    # nothing set: the run manifest's temperature and length
    (c,) = eval_rollout.eval_datasets_from_args(types.SimpleNamespace(eval_prompt_data=["c", "test"]))
    assert (c.k, c.temperature, c.max_tokens) == (1, None, None)
    # --eval-temperature 0 is greedy, not "unset": refused, never the run's temperature
    args.eval_temperature = 0.0
    with pytest.raises(ValueError, match="temperature 0"):
        eval_rollout.eval_datasets_from_args(args)
    # --eval-config: the entry, then eval.defaults, then the flags
    path = tmp_path / "eval.yaml"
    path.write_text(json.dumps({"eval": {"defaults": {"temperature": 0.5, "rm_type": "math"}, "datasets": [
        {"name": "x", "path": "test", "n_samples_per_eval_prompt": 8, "max_response_len": 64},
        {"name": "y", "path": "dev", "temperature": 1.2},
    ]}}))
    args = types.SimpleNamespace(eval_config=str(path), eval_prompt_data=["ignored", "test"], rollout_temperature=1.0,
                                 n_samples_per_eval_prompt=1, eval_max_response_len=128)
    x, y = eval_rollout.eval_datasets_from_args(args)
    assert (x.name, x.k, x.temperature, x.max_tokens, x.ignored) == ("x", 8, 0.5, 64, ("rm_type",))
    assert (y.name, y.k, y.temperature, y.max_tokens) == ("y", 1, 1.2, 128)
    # slime's resolved args.eval_datasets win (EvalDatasetConfig objects)
    resolved = types.SimpleNamespace(name="z", path="test", n_samples_per_eval_prompt=3, temperature=0.9, top_p=1.0,
                                     top_k=-1, max_response_len=32, metadata_overrides={})
    (z,) = eval_rollout.eval_datasets_from_args(types.SimpleNamespace(eval_datasets=[resolved], eval_config=str(path)))
    assert (z.name, z.k, z.temperature, z.max_tokens, z.ignored) == ("z", 3, 0.9, 32, ())
    for bad, match in (({"top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k"), ({"min_new_tokens": 4}, "min_new_tokens"),
                       ({"path": "../x"}, "split"), ({"temperature": -1}, "temperature")):
        entry = types.SimpleNamespace(**{**vars(resolved), **bad})
        with pytest.raises(ValueError, match=match):
            eval_rollout.eval_datasets_from_args(types.SimpleNamespace(eval_datasets=[entry]))


def _kept_group(prompt: int, n: int, reward: float) -> Any:
    samples = [
        types.SimpleNamespace(response_tokens=np.array([5, 6]), mask=np.array([1, 1]), logprobs=np.array([-0.1, -0.2]),
                              finish_reason="stop", reward=reward, turns=1, tool_calls=0)
        for _ in range(n)
    ]
    group = types.SimpleNamespace(prompt_tokens=np.array([1, 2]), samples=samples, weight_version=3,
                                  worker_id="mac-1", task_id="synthetic", prompt_index=prompt)
    return types.SimpleNamespace(key=f"k{prompt}", group=group, prompt=f"p{prompt}", label="l", texts=["t"] * n,
                                 rewards=[reward] * n)


def test_eval_samples_carry_their_prompt_as_group_index(slime: None, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = (0, 1, 2)
    collector = types.SimpleNamespace(
        request=types.SimpleNamespace(prompts=prompts), kept=lambda p: [_kept_group(p, 2, float(p % 2))], rejects={},
    )
    result = types.SimpleNamespace(
        prompts=[types.SimpleNamespace(rewards=[float(p % 2)] * 2, truncated=[False] * 2) for p in prompts],
        row=lambda: {"pass@1": 1 / 3, "pass@k": 1 / 3, "n_prompts": 3, "k": 2},
    )

    async def evaluate(session: Any, settings: Any, datasets: Any) -> Any:
        return 3, {d.name: (collector, result) for d in datasets}

    class Session:
        def call(self, coro: Any) -> Any:
            import asyncio

            return asyncio.run(coro)

    monkeypatch.setattr(eval_rollout, "_evaluate", evaluate)
    args = types.SimpleNamespace(stoa_bucket="file:///nowhere", stoa_run="r", eval_prompt_data=["s", "test"])
    out = eval_rollout.eval_output(args, 7, lambda _settings: Session())
    samples = out.data["s"]["samples"]
    assert [s.group_index for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.index for s in samples] == [0, 1, 2, 3, 4, 5]
    assert [s.reward for s in samples] == out.data["s"]["rewards"]


# -- the tied output head -----------------------------------------------------------------------------
def hf_folder(root: Path, names: list[str], config: dict[str, Any]) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    write_safetensors(root / "model.safetensors", {n: np.zeros((4, 2), np.float32) for n in names})
    return root


def test_the_head_plan_follows_the_hf_folder(tmp_path: Path) -> None:
    tied = hf_folder(tmp_path / "tied", ["model.embed_tokens.weight"], {"tie_word_embeddings": True})
    assert hf_names.folder_tensor_names(tied) == {"model.embed_tokens.weight"}
    assert hf_names.head_plan(tied, untied=False) == hf_names.HeadPlan(drop=True)
    assert "remove --untie" in (hf_names.head_plan(tied, untied=True).error or "")
    stored = hf_folder(tmp_path / "stored", ["model.embed_tokens.weight", "lm_head.weight"], {})  # default: tied
    assert hf_names.head_plan(stored, untied=False) == hf_names.HeadPlan(copy=True)
    untied = hf_folder(tmp_path / "untied", ["model.embed_tokens.weight", "lm_head.weight"],
                       {"text_config": {"tie_word_embeddings": False}})
    assert hf_names.head_plan(untied, untied=True) == hf_names.HeadPlan()
    assert "add --untie" in (hf_names.head_plan(untied, untied=False).error or "")
    # no folder: slime's AutoConfig of it
    assert hf_names.head_plan(None, untied=False, hf_config=types.SimpleNamespace(tie_word_embeddings=True)).drop
    assert hf_names.head_plan(None, untied=False) == hf_names.HeadPlan()


def test_a_tied_model_at_pipeline_parallelism_publishes_the_hf_folders_names(tmp_path: Path) -> None:
    """The converter's chunks at PP > 1 (the last stage's output_layer.weight as lm_head.weight)
    become the folder's names; a head that drifted from the embedding is reported."""
    torch = pytest.importorskip("torch")
    from slime_stoa.trainer.slime import publish

    folder = hf_folder(tmp_path / "qwen", ["model.embed_tokens.weight", "model.norm.weight"],
                       {"tie_word_embeddings": True})
    embed = torch.randn(4, 2, dtype=torch.bfloat16)
    chunks = [[("model.embed_tokens.weight", embed)], [("lm_head.weight", embed.clone()), ("model.norm.weight", embed[0])]]

    class Iterator:
        def get_hf_weight_chunks(self, weights: Any, progress_desc: str = "", should_convert_chunk: Any = None) -> Any:
            yield from chunks

    modules = {name: types.ModuleType(name) for name in ("slime", "slime.utils", "slime.utils.accelerator")}
    modules["slime.utils"].accelerator = modules["slime.utils.accelerator"]  # type: ignore[attr-defined]
    modules["slime.utils.accelerator"].empty_cache = lambda: None  # type: ignore[attr-defined]
    actor = types.SimpleNamespace(_stoa_hf_iterator=Iterator(), weights_backuper=types.SimpleNamespace(get=lambda _: {}),
                                  hf_config=None)
    args = types.SimpleNamespace(hf_checkpoint=str(folder), untie_embeddings_and_output_weights=False)
    with pytest.MonkeyPatch.context() as mp:
        for name, module in modules.items():
            mp.setitem(sys.modules, name, module)
        state, error = publish.gather_state(actor, args, keep=True)
        assert error is None and set(state) == hf_names.folder_tensor_names(folder)
        chunks[1][0] = ("lm_head.weight", embed + 1)
        warnings: list[str] = []
        mp.setattr(publish.log, "warning", lambda msg, *a: warnings.append(msg % a))
        state, error = publish.gather_state(actor, args, keep=True)
        assert error is None and "lm_head.weight" not in state and "differs from" in warnings[0]
        args.untie_embeddings_and_output_weights = True
        actor._stoa_head_plan = None
        _, error = publish.gather_state(actor, args, keep=True)
        assert error is not None and "remove --untie-embeddings-and-output-weights" in str(error)
        # a tied folder that stores its head, at one stage: the head is the embedding's copy
        stored = hf_folder(tmp_path / "stored", ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"],
                           {"tie_word_embeddings": True})
        chunks[1].pop(0)
        args.hf_checkpoint, args.untie_embeddings_and_output_weights, actor._stoa_head_plan = str(stored), False, None
        state, error = publish.gather_state(actor, args, keep=True)
        assert error is None and set(state) == hf_names.folder_tensor_names(stored)
        assert np.array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
