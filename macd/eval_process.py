"""`python -m macd.eval_process`: the sampler process of `stoa eval --local` (its `mlx` engine).

It runs `macd.evaluate.answer_prompts` (macd's generation path, the one workers use) on a model
folder and a split's task data and writes the completions as JSON (`completion_doc`). A tool
task's calls are answered by the parent over the pipes (`--tool-stdio`, `ParentTool`): stdout
then carries only the tool lines, whatever else writes there goes to stderr. With --progress,
stderr gets `progress_line`s (`ProgressLines`) as decoding goes, in tokens of the budget (prompts x
k x max tokens, a finished sample's unused budget counted as done, so a time left estimated from
the rate is an upper bound) and prompts: a single-turn task's after every decode step
(`macd.generate.generate_groups`), a tool task's episodes' after every call of decode steps
(`EpisodeBudget`: model and tool tokens alike spend an episode's budget).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from slime_stoa.tasks import load_task
from slime_stoa.tasks.prompting import prompt_tokens

MAX_TOOL_LINE = 64 << 20  # the longest answer line read from the parent
# a --progress line (stoa eval reads it): the prefix, then "TOKENS_DONE/TOKENS_TOTAL PROMPTS_DONE/PROMPTS_TOTAL"
# (tokens of the budget, see `macd.generate.generate_groups`), or "PROMPTS_DONE/PROMPTS_TOTAL" alone
PROGRESS_PREFIX = "stoa-eval-progress "
PROGRESS_EVERY_S = 0.5  # a token line once this long passed since the last one...
PROGRESS_EVERY_SHARE = 0.01  # ...or this share of the budget more is done (and always the first and the last)


def progress_line(done: int, total: int, tokens_done: int | None = None, tokens: int | None = None) -> str:
    """A --progress line: `done` of `total` prompts, with `tokens_done` of `tokens` budget tokens
    when given."""
    counted = "" if tokens_done is None or tokens is None else f"{tokens_done}/{tokens} "
    return f"{PROGRESS_PREFIX}{counted}{done}/{total}"


class ProgressLines:
    """The --progress lines of one sampling of `prompts` prompts, written to `out`: `group(n)` as
    prompts' groups finish, `tokens(done, total)` as decoding goes (`answer_prompts`'s
    callbacks). Once tokens are counted, a line carries both counts and is written once `every_s`
    seconds have passed or `share` of the budget more is done since the last one (so some
    1/`share` lines, plus one per `every_s` of a slow sampling), the first and the last always;
    without them (none told yet), a line of prompts as each group finishes."""

    def __init__(
        self, out: TextIO, prompts: int, *, every_s: float = PROGRESS_EVERY_S, share: float = PROGRESS_EVERY_SHARE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.prompts, self.every_s, self.share, self.clock = out, prompts, every_s, share, clock
        self.prompts_done = 0
        self.counted: tuple[int, int] | None = None  # (done, total) budget tokens, once told
        self._last: tuple[int, float] | None = None  # (tokens done, when) of the last token line

    def group(self, done: int) -> None:
        self.prompts_done = done
        if self.counted is None:
            self._write(progress_line(done, self.prompts))

    def tokens(self, done: int, total: int) -> None:
        self.counted = (done, total)
        now = self.clock()
        if self._last is not None and done < total:
            last_done, last_at = self._last
            if now - last_at < self.every_s and done - last_done < total * self.share:
                return
        self._last = (done, now)
        self._write(progress_line(self.prompts_done, self.prompts, done, total))

    def _write(self, line: str) -> None:
        print(line, file=self.out, flush=True)


class EpisodeBudget:
    """The runner of a tool task's MLX work (`macd.episodes.run_episodes`' `mlx`) that tells the
    budget done, `told(done, total)`, after each call of decode steps: the model and tool tokens of
    every episode so far, plus the unused budget of the episodes of each finished group (counted
    only then: never more than is done, so an ETA from it stays an upper bound)."""

    def __init__(self, prompts: int, k: int, max_tokens: int, told: Callable[[int, int], None]) -> None:
        self.max_tokens, self.total, self.told = max_tokens, prompts * k * max_tokens, told
        self.gen: Any = None  # the episodes' generator, once `run_episodes` has built it here
        self.unused = 0  # budget left unspent by the episodes of finished groups

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        from .episodes import EpisodeGenerator

        result = fn(*args)
        if isinstance(result, EpisodeGenerator):
            self.gen = result
        elif self.gen is not None and fn == self.gen.advance:  # (finished groups, steps)
            finished, _ = result
            self.unused += sum(self.max_tokens - len(c.tokens) for group in finished for c in group.completions)
            self.told(min(self.total, self.gen.tokens + self.gen.tool_tokens + self.unused), self.total)
        return result


class ParentTool:
    """A tool answered by the process at the other end of the pipes: a query is one JSON line out,
    ``{"tool_call": {"id": N, "query": Q}}``, its answer one line in, ``{"id": N, "text": T}``, in
    any order (the parent runs the task's tool with `slime_stoa.tasks.tools.call_tool`, so the text
    is what the tool would have answered here)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[str]] = {}
        self._closed = False

    async def __call__(self, query: str) -> str:
        if self._closed:
            raise EOFError("the tool's pipe is closed")
        n = next(self._ids)
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[n] = answer
        try:
            self._out.write(json.dumps({"tool_call": {"id": n, "query": query}}) + "\n")
            self._out.flush()
            return await answer
        finally:
            self._waiting.pop(n, None)

    async def read_answers(self, reader: asyncio.StreamReader) -> None:
        """Hand each answer line to its query until the pipe closes (queries then still waiting fail)."""
        try:
            while line := await reader.readline():
                msg = json.loads(line)
                answer = self._waiting.get(int(msg["id"]))
                if answer is not None and not answer.done():
                    answer.set_result(str(msg["text"]))
        finally:
            self._closed = True
            for answer in self._waiting.values():
                if not answer.done():
                    answer.set_exception(EOFError("the tool's pipe closed before the answer"))


def completion_doc(completion: Any) -> dict[str, Any]:
    """What `stoa eval --local` scores of a completion: text, finish reason, tool calls (0 for a
    single-turn one)."""
    return {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "tool_calls": int(getattr(completion, "tool_calls", 0)),
    }


async def _inline(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


async def sample_split(args: argparse.Namespace, protocol: TextIO) -> dict[str, Any]:
    """The completions of `args` (see `build_parser`): {"completions": [[doc, ...k], ...per prompt]}."""
    from .generate import load_model

    task = load_task(await asyncio.to_thread(args.task.read_bytes))
    if task.tool_format is not None and not args.tool_stdio:
        raise ValueError(f"task {task.name!r} uses a tool: sample it with --tool-stdio, the tool answering on stdin")
    if not (args.model / "config.json").is_file():
        raise ValueError(f"{args.model} is no model folder (no config.json)")
    items = task.items[: len(task) if args.prompts is None else args.prompts]
    model, tokenizer = load_model(args.model)
    prompts = [prompt_tokens(tokenizer, task, item) for item in items]
    tool, reading = None, None
    if args.tool_stdio:
        tool = ParentTool(protocol)
        reader = asyncio.StreamReader(limit=MAX_TOOL_LINE)
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        reading = asyncio.create_task(tool.read_answers(reader))
    lines = ProgressLines(sys.stderr, len(prompts)) if args.progress else None
    try:
        from .evaluate import answer_prompts  # MLX: loaded after main() chose its BLAS

        mlx: Callable[..., Any] = _inline
        if lines is not None and task.tool_format is not None:
            mlx = EpisodeBudget(len(prompts), args.k, args.max_tokens, lines.tokens)
            lines.tokens(0, mlx.total)
        groups = await answer_prompts(
            model, tokenizer, task, prompts, temperature=args.temperature, max_tokens=args.max_tokens, k=args.k,
            stop=tuple(args.stop), seed=args.seed, mlx=mlx, tool=tool, max_batch=args.max_batch,
            on_group=None if lines is None else lines.group, on_progress=None if lines is None else lines.tokens,
        )
    finally:
        if reading is not None:
            reading.cancel()
    return {"completions": [[completion_doc(c) for c in group] for group in groups]}


def _protocol_stream() -> TextIO:
    """This process's stdout, kept for the tool lines; whatever else writes to stdout (a library's
    print, at the Python or the C level) goes to stderr instead."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(kept, "w", encoding="utf-8", buffering=1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m macd.eval_process",
        description=(
            "Sample k completions for each of a task split's first prompts with MLX (macd's generation "
            "path) and write their text, finish reason and tool calls as JSON."
        ),
    )
    parser.add_argument("--model", type=Path, required=True, help="HF/MLX model folder")
    parser.add_argument("--task", type=Path, required=True, help="a split's task data file (as stored in the bucket)")
    parser.add_argument("--prompts", type=int, help="sample the split's first N prompts (default: all)")
    parser.add_argument("--k", type=int, default=1, help="samples per prompt (default: 1)")
    parser.add_argument("--max-tokens", type=int, required=True, help="longest response")
    parser.add_argument("--temperature", type=float, required=True, help="sampling temperature")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="a stop string (repeat for more; --stop=TEXT for one starting with '-')")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--max-batch", type=int, help="sequences decoded at once (default: all)")
    parser.add_argument("--tool-stdio", action="store_true",
                        help="a tool task: ask for each tool answer on stdout and read it from stdin (see ParentTool)")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout, as one line)")
    parser.add_argument("--progress", action="store_true",
                        help="write progress lines to stderr: budget tokens and prompts done (see ProgressLines)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    protocol = _protocol_stream() if args.tool_stdio else sys.stdout
    from .cpu_blas import use_fast_blas

    use_fast_blas()  # Linux: before MLX loads, as a worker does, so an eval samples at a worker's speed
    try:
        from . import generate  # noqa: F401  (mlx, mlx-lm: the worker extra)
    except ImportError as exc:
        print(f"error: sampling with MLX needs the worker extra (mlx, mlx-lm): {exc}", file=sys.stderr)
        return 2
    try:
        doc = asyncio.run(sample_split(args, protocol))
    except (OSError, ValueError) as exc:  # no such file, bad task data or settings, a tool task without its pipes
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(doc)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    else:
        protocol.write(text + "\n")
        protocol.flush()
    return 0


__all__ = ["EpisodeBudget", "ParentTool", "ProgressLines", "build_parser", "completion_doc", "main", "progress_line", "sample_split"]


if __name__ == "__main__":
    sys.exit(main())
