"""The mlx-lm API macd's generation relies on, checked by name: an mlx-lm release that renames or
drops any of it fails here, loudly, instead of deep inside a worker's first cohort."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model, load_tokenizer

# What macd/generate.py passes or reads (keep in step with it).
USED = {
    BatchGenerator.__init__: {"model", "max_tokens", "stop_tokens", "sampler", "completion_batch_size", "prefill_batch_size"},
    BatchGenerator.insert: {"prompts", "caches"},
    BatchGenerator.remove: {"uids"},
    mlx_lm.load: {"path_or_hf_repo", "lazy"},
    make_prompt_cache: {"model"},
    load_model: {"model_path", "lazy", "strict"},
    load_tokenizer: {"model_path", "eos_token_ids"},
}
RESPONSE_FIELDS = {"uid", "token", "logprobs", "finish_reason"}


@pytest.mark.parametrize("fn", list(USED), ids=lambda fn: fn.__qualname__)
def test_the_parameters_macd_passes_exist(fn) -> None:
    params = set(inspect.signature(fn).parameters)
    missing = USED[fn] - params
    assert not missing, (
        f"mlx-lm {mlx_lm.__version__}: {fn.__qualname__} lost {sorted(missing)}; macd/generate.py "
        f"needs them (supported mlx-lm: pyproject's pin)"
    )


def test_a_generator_step_yields_responses_with_what_macd_reads(tmp_path: Path) -> None:
    """One real step on a tiny random model: the responses carry uid, token, logprobs (a vector
    over the vocabulary) and finish_reason, and a sequence can be removed mid-flight."""
    pytest.importorskip("tokenizers")
    from slime_stoa.quickstart.tiny_model import build_tiny_model

    model, tokenizer = mlx_lm.load(str(build_tiny_model(tmp_path / "tiny")))
    assert isinstance(tokenizer, TokenizerWrapper) and tokenizer.eos_token_ids
    gen = BatchGenerator(model, max_tokens=4, stop_tokens=[[e] for e in tokenizer.eos_token_ids],
                         completion_batch_size=2, prefill_batch_size=2)
    try:
        uids = gen.insert([[1, 2, 3], [4, 5]])
        responses = gen.next_generated()
        assert {r.uid for r in responses} == set(uids)
        for r in responses:
            missing = RESPONSE_FIELDS - set(dir(r))
            assert not missing, f"mlx-lm {mlx_lm.__version__}: a step's response lacks {sorted(missing)}"
            assert r.logprobs.shape[-1] >= r.token
        gen.remove([uids[0]])
        assert {r.uid for r in gen.next_generated()} <= {uids[1]}
    finally:
        gen.close()
