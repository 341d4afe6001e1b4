"""The tools of tool tasks: the `Tool` protocol, a registry keyed by task, and stand-in tools.

A tool answers an episode's query with text (`slime_stoa.tasks.episode` turns it into an observation). It
is either ``async def __call__(query) -> str`` or a plain function, which `call_tool` runs in a
worker thread: tools never run on the MLX thread. `call_tool` never raises: a tool error, a
timeout or a non-string answer becomes an error text the model sees, and the episode goes on.

`tool_for(task, context)` builds the tool of a run's task from the factory registered under the
task's name (`register_tool`); the search task's retriever is registered here
(`_search_tool`). `EchoTool` and `LookupTool` are stand-ins for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

DEFAULT_TIMEOUT_S = 30.0


class Tool(Protocol):
    """Answers a query with text: async, or sync (run off the MLX thread)."""

    def __call__(self, query: str) -> Any: ...  # str, or an awaitable of str


@dataclass(frozen=True, kw_only=True)
class ToolContext:
    """What a tool factory may use to build a run's tool."""

    run: str
    """The run's name."""
    store: Any = None
    """The run's bucket (`slime_stoa.protocol.store.Store`), e.g. to fetch a search index."""
    data_dir: Path | None = None
    """The worker's local data folder, e.g. to cache an index."""
    shared_dir: Path | None = None
    """A folder every worker process of this machine shares (the search index is fetched there
    once and memory-mapped by all of them); `data_dir` when None."""


ToolFactory = Callable[[Any, ToolContext], Tool]  # (task, context) -> tool

_FACTORIES: dict[str, ToolFactory] = {}


def register_tool(task_name: str, factory: ToolFactory) -> None:
    """Make `factory(task, context)` the tool of the task named `task_name` (replaces any)."""
    _FACTORIES[task_name] = factory


def tool_for(task: Any, context: ToolContext) -> Tool:
    """The tool of `task` (a `slime_stoa.tasks.Task` with a `tool_format`); ValueError if its
    task registers none."""
    factory = _FACTORIES.get(task.name)
    if factory is None:
        raise ValueError(f"task {task.name!r} uses a tool but no tool is registered for it (slime_stoa.tasks.tools.register_tool)")
    return factory(task, context)


async def prepare_tool(tool: Tool) -> None:
    """Open what `tool` needs before its first query (e.g. fetch and map an index): its
    ``async prepare()`` when it has one. Errors propagate (the caller reports and retries)."""
    prepare = getattr(tool, "prepare", None)
    if prepare is not None:
        await prepare()


def _is_async(tool: Any) -> bool:
    return inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(type(tool).__call__)


async def call_tool(tool: Tool, query: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """`tool(query)` as text; an error or a timeout becomes a short error text (never raises,
    except on cancellation)."""
    try:
        async with asyncio.timeout(timeout_s):
            if _is_async(tool):
                out = await tool(query)
            else:
                out = await asyncio.to_thread(tool, query)
                if inspect.isawaitable(out):
                    out = await out
    except TimeoutError:
        return f"tool error: no answer within {timeout_s:g} s"
    except Exception as exc:  # a tool bug must not end the episode
        return f"tool error: {type(exc).__name__}"
    return out if isinstance(out, str) else f"tool error: answered {type(out).__name__}, not text"


class EchoTool:
    """Stand-in: answers the query itself (optionally prefixed)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.queries: list[str] = []

    async def __call__(self, query: str) -> str:
        self.queries.append(query)
        return self.prefix + query


class LookupTool:
    """Stand-in: a fixed table from query to text (a default for unknown queries); sync, so
    `call_tool` runs it in a thread."""

    def __init__(self, table: Mapping[str, str], default: str = "no result") -> None:
        self.table = dict(table)
        self.default = default
        self.queries: list[str] = []

    def __call__(self, query: str) -> str:
        self.queries.append(query)
        return self.table.get(query, self.default)


def _search_tool(task: Any, context: ToolContext) -> Tool:
    """The search task's BM25 retriever; its index is fetched (resumably, one process at a time)
    into ``<shared_dir or data_dir>/search-index/`` (`retriever.index_folder`: named by its
    manifest's digest) and memory-mapped read-only, at `prepare` or the first query: the
    processes of one machine share one copy of it, on disk and in memory."""
    from slime_stoa.tasks.search.retriever import SearchTool, index_folder  # bm25s: the worker extra

    root = context.shared_dir or context.data_dir
    if root is None:
        raise ValueError("the search tool needs a data folder for its index")
    tool = SearchTool(task, context.store, context.run, index_folder(Path(root) / "search-index", task, context.run))
    return SearchR1Observation(tool) if task.config.observation == "search-r1" else tool


class SearchR1Observation:
    """A search tool whose answer is Search-R1's observation body: the top `config.top_k`
    passages whole, in rank order (`formats.format_search_r1`), not cut to
    `max_observation_chars` (the episode runner cuts the observation to its token cap)."""

    def __init__(self, tool: Any) -> None:
        self.tool = tool  # a `retriever.SearchTool`: its index opens once, at `prepare` or first use

    async def prepare(self) -> None:
        await prepare_tool(self.tool)

    async def __call__(self, query: str) -> str:
        from slime_stoa.tasks.search.formats import format_search_r1

        retriever = await self.tool.retriever()
        hits = await retriever.asearch(query, self.tool.task.config.top_k)
        return format_search_r1([h.text for h in hits])


register_tool("search", _search_tool)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "EchoTool",
    "LookupTool",
    "SearchR1Observation",
    "Tool",
    "ToolContext",
    "ToolFactory",
    "call_tool",
    "prepare_tool",
    "register_tool",
    "tool_for",
]
