"""Episode metrics of search tasks: how often and how much the model searches, and format errors.

The worker that runs multi-turn episodes fills one `EpisodeStats` per finished episode;
`summarize` turns a batch of them into the figures a tracker logs (`SearchMetrics.as_dict`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class EpisodeStats:
    """What one finished search episode did.

    - `turns`: model turns (generation calls) in the episode, >= 1.
    - `searches`: `<search>` calls the worker answered, >= 0.
    - `tool_tokens`: tokens of the observations the worker inserted (not generated), >= 0.
    - `format_error`: the episode ended without a well-formed final answer (see
      `rewards.extract_answer`).
    - `reward`: the episode's reward in [0, 1].
    """

    turns: int
    searches: int
    tool_tokens: int
    format_error: bool
    reward: float

    def __post_init__(self) -> None:
        for name, low in (("turns", 1), ("searches", 0), ("tool_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EpisodeStats.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.format_error, bool):
            raise ValueError(f"EpisodeStats.format_error must be a bool, got {self.format_error!r}")
        if not isinstance(self.reward, (int, float)) or not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"EpisodeStats.reward must be in [0, 1], got {self.reward!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchMetrics:
    """Means over a batch of episodes.

    - `episodes`: how many episodes the figures cover.
    - `search_rate`: fraction of episodes with at least one search.
    - `searches_per_episode`, `turns_per_episode`, `tool_tokens_per_episode`: means.
    - `format_error_rate`: fraction of episodes without a well-formed final answer.
    - `reward`: mean reward.
    """

    episodes: int
    search_rate: float
    searches_per_episode: float
    turns_per_episode: float
    tool_tokens_per_episode: float
    format_error_rate: float
    reward: float

    def as_dict(self, prefix: str = "search/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items()}


def summarize(episodes: Iterable[EpisodeStats]) -> SearchMetrics:
    """The means of `episodes`; ValueError for an empty batch (no figure is better than a made-up one)."""
    eps = list(episodes)
    if not eps:
        raise ValueError("summarize needs at least one episode")
    n = len(eps)
    return SearchMetrics(
        episodes=n,
        search_rate=sum(e.searches > 0 for e in eps) / n,
        searches_per_episode=sum(e.searches for e in eps) / n,
        turns_per_episode=sum(e.turns for e in eps) / n,
        tool_tokens_per_episode=sum(e.tool_tokens for e in eps) / n,
        format_error_rate=sum(e.format_error for e in eps) / n,
        reward=sum(e.reward for e in eps) / n,
    )
