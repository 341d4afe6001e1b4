"""A model folder's config.json as mlx-lm reads it: transformers 5's rope keys spelled the old way.

transformers 5 writes a model's rotary settings as one ``rope_parameters`` object
(``{"rope_theta": 100000.0, "rope_type": "default"}``, plus a scaling's own keys) and no longer
writes ``rope_theta`` or ``rope_scaling`` at the top level; mlx-lm 0.31-0.32 reads only the
top-level keys and silently falls back to its default theta (10,000 for Llama and Qwen2). A
folder saved by transformers 5 (SmolLM2's, every warm start, every checkpoint a trainer exports)
then runs on a worker with other positions than the trainer's: on SmolLM2-135M the recorded
logprobs were 0.29 nats per token from the learner's. `mlx_overrides` gives mlx-lm the old
spelling of what the folder says (a multimodal config's ``text_config`` too); a folder that
spells it the old way, or both ways, is left as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def mlx_overrides(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys to set in `config` (a config.json) so that mlx-lm reads the rotary settings it
    states; empty when there is nothing to change."""
    out: dict[str, Any] = {}
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta")
        if "rope_theta" not in config and isinstance(theta, int | float) and not isinstance(theta, bool):
            out["rope_theta"] = float(theta)
        if "rope_scaling" not in config and params.get("rope_type", params.get("type", "default")) != "default":
            out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    text = config.get("text_config")
    if isinstance(text, Mapping) and (inner := mlx_overrides(text)):
        out["text_config"] = {**text, **inner}
    return out
