"""Search tasks: questions answered by searching a passage corpus with BM25.

Pure parts, importable anywhere (workers, trainer): `rewards` (answer extraction, SQuAD
normalisation, EM, cover-EM and substring EM, the final answer of an episode), `formats` (the tool tags and observation text), `stats`
(episode metrics), `synthetic` (a seeded corpus + questions that need searching), `task` (the
registered `search` Task), `data` (reading question and corpus files, PaperSearchQA's formats),
`tokenizer` (the index's tokeniser, BM25 settings and presets).

With IO, bm25s or PyStemmer, imported only where needed: `passages` (memory-mapped passage
texts), `build` (the streaming, sharded index build), `retriever` (`Retriever.open`, async
search), `bundle` (the index as chunked bucket objects: `upload_index`, `fetch_index` with its
verified stamp), `prepare` (the operator's `stoa task prepare search`), `progress` (its bar).
"""

from __future__ import annotations

from slime_stoa.tasks.search.formats import SearchTags, format_passages, observation
from slime_stoa.tasks.search.rewards import (
    DEFAULT_MATCH,
    MATCH_KINDS,
    AnswerTags,
    FormatReward,
    answer_reward,
    cover_exact_match,
    decode_label,
    encode_label,
    exact_match,
    extract_answer,
    normalize_answer,
    parse_completion,
    substring_exact_match,
)
from slime_stoa.tasks.search.stats import EpisodeStats, SearchMetrics, summarize
from slime_stoa.tasks.search.task import Search, SearchConfig

__all__ = [
    "DEFAULT_MATCH",
    "MATCH_KINDS",
    "AnswerTags",
    "EpisodeStats",
    "FormatReward",
    "Search",
    "SearchConfig",
    "SearchMetrics",
    "SearchTags",
    "answer_reward",
    "cover_exact_match",
    "decode_label",
    "encode_label",
    "exact_match",
    "extract_answer",
    "format_passages",
    "normalize_answer",
    "observation",
    "parse_completion",
    "substring_exact_match",
    "summarize",
]
