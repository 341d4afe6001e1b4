"""Named settings of the search task that reproduce a published run (`stoa task prepare search
--preset NAME`), and how a preset and the operator's flags become the task meta.

`papersearchqa`: PaperSearchQA's RL runs (PaperSearchRL's `run_scripts/*psr1*bm25.sh`, on
Search-R1's code): Search-R1's prompt as one user message, at most 2 searches (`max_turns=2`),
BM25 with Search-R1's pyserini settings, the top 3 passages whole in rank order in Search-R1's
"Doc i(Title: ...)" layout, the observation cut at 500 tokens (`max_obs_length=500`), 500 model
tokens per turn (`max_response_length=500`), a turn without a search or an answer answered with
Search-R1's invalid-action feedback (the episode goes on), and strict EM as the reward
(`qa_em.compute_score_em`).

The meta keys a preset or a flag sets are written; the rest keep `SearchConfig`'s defaults
without being written, so task data prepared without a preset has the bytes it always had.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from slime_stoa.tasks.search.task import SearchConfig
from slime_stoa.tasks.search.tokenizer import PRESETS, PresetName

#: Written by `stoa task prepare search` whatever the preset (as before presets existed).
BASE_META: Mapping[str, Any] = MappingProxyType({"match": "cover_em", "top_k": 3, "max_observation_chars": 1500})
BASE_BM25: PresetName = "default"


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskPreset:
    """Task meta settings and the BM25 preset (`tokenizer.PRESETS`) of a published run."""

    meta: Mapping[str, Any] = field(default_factory=dict)
    bm25: PresetName = BASE_BM25
    about: str = ""


TASK_PRESETS: Mapping[str, TaskPreset] = MappingProxyType({
    "papersearchqa": TaskPreset(
        meta=MappingProxyType({
            "match": "em",
            "prompt": "search-r1",
            "observation": "search-r1",
            "top_k": 3,
            "max_searches": 2,
            "max_observation_tokens": 500,
            "max_turn_tokens": 500,
            "no_action": "feedback",
        }),
        bm25="search-r1",
        about="PaperSearchQA / Search-R1: its prompt, 2 searches, top-3 whole passages, 500-token observations "
              "and turns, invalid-action feedback, strict EM",
    ),
})


def resolve(preset: str | None, flags: Mapping[str, Any]) -> tuple[dict[str, Any], PresetName]:
    """(task meta, BM25 preset name) for `preset` (None: none) with the operator's `flags`
    ({meta key or "bm25": value}; a None value is a flag not given) applied over it.

    ValueError for an unknown preset or settings `SearchConfig` refuses."""
    if preset is not None and preset not in TASK_PRESETS:
        raise ValueError(f"unknown search preset {preset!r}; known: {sorted(TASK_PRESETS)}")
    chosen = TASK_PRESETS[preset] if preset is not None else TaskPreset()
    meta = {**BASE_META, **chosen.meta, **{k: v for k, v in flags.items() if k != "bm25" and v is not None}}
    bm25: PresetName = flags.get("bm25") or chosen.bm25
    if bm25 not in PRESETS:
        raise ValueError(f"unknown BM25 preset {bm25!r}; known: {sorted(PRESETS)}")
    SearchConfig.from_meta(meta)  # refuse bad settings before anything is read
    return meta, bm25


__all__ = ["BASE_BM25", "BASE_META", "TASK_PRESETS", "TaskPreset", "resolve"]
