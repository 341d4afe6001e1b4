"""Eval without the fleet: a version's weights rebuilt from the bucket and sampled on this machine,
scored with the split's task reward. Two engines:

* ``mlx`` (the default): macd's MLX generation path (`macd.evaluate.answer_prompts`, the one
  workers use), run as its own process, ``python -m macd.eval_process`` (`mlx_sample`); needs the
  worker extra (mlx, mlx-lm). A tool task's tool runs here, and the process asks it over its
  pipes (`macd.eval_process.ParentTool`).
* ``transformers``: `slime_stoa.evaluation.hf_generate` on the trainer box (a GPU when there is
  one), the same episodes driven by transformers' `generate`; needs the trainer extra.

The int8 plane is not emulated: the version's bf16 state is what is sampled.

Progress (`EvalProgress`): both engines count it in tokens of the budget (prompts x k x max tokens;
a finished sample's unused budget counts as done, so a time left estimated from its rate is an
upper bound), with the prompts whose samples all finished beside: the mlx engine after every decode
step (a tool task's episodes: every call of decode steps, `macd.eval_process.EpisodeBudget`), the
transformers engine after every `generate` call (one turn of a batch of samples) and tool answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from slime_stoa.protocol.hf.folders import save_hf_folder
from slime_stoa.protocol.pulse.anchor import download_extras
from slime_stoa.protocol.pulse.history import read_anchor_manifest
from slime_stoa.protocol.pulse.rebuild import rebuild
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.store import Store
from slime_stoa.tasks import Task, TaskItem
from slime_stoa.tasks.prompting import prompt_tokens
from slime_stoa.tasks.tools import Tool, ToolContext, call_tool, tool_for

from .collect import read_split
from .report import PromptResult, VersionResult, answer_matches, task_match

Engine = Literal["mlx", "transformers"]
ENGINES: tuple[Engine, ...] = ("mlx", "transformers")

MLX_SAMPLER = ("-m", "macd.eval_process")  # the mlx engine's process: `sys.executable -m macd.eval_process`
MAX_LINE = 64 << 20  # the longest tool-call line read from it
# its --progress lines on stderr (`macd.eval_process.progress_line`): the prefix, then
# "TOKENS_DONE/TOKENS_TOTAL PROMPTS_DONE/PROMPTS_TOTAL", or "PROMPTS_DONE/PROMPTS_TOTAL" alone
PROGRESS_PREFIX = "stoa-eval-progress "


class EngineFailed(ChildProcessError):
    """The mlx engine's process did not sample (not installed, a bad model folder, killed...)."""


@dataclass(frozen=True, slots=True)
class EvalProgress:
    """How far a sampling is: `prompts_done` of `prompts` have all their samples; `tokens_done`
    of `tokens` budget tokens (None where the engine counts no tokens)."""

    prompts_done: int
    prompts: int
    tokens_done: int | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Sampled:
    """What is scored of one completion."""

    text: str
    finish_reason: str
    tool_calls: int


def _matches(task: Task, texts: Sequence[str], label: str) -> tuple[dict[str, float], ...] | None:
    """Each sample's EM and cover-EM when the task reports them (`report.answer_matches`)."""
    rows = [answer_matches(task, t, label) for t in texts]
    return None if any(r is None for r in rows) else tuple(r for r in rows if r is not None)


async def local_eval(
    store: Store, manifest: RunManifest, *, version: int, split: str, k: int, n_prompts: int | None,
    max_tokens: int, temperature: float, work_dir: Path, threshold: float, seed: int | None = None,
    trust: RunTrust | None = None, engine: Engine = "mlx", device: str | None = None,
    on_progress: Callable[[EvalProgress], None] | None = None,
) -> VersionResult:
    """k samples for each of the split's first `n_prompts` prompts (None: all) from `version`,
    sampled by `engine` (`device`: the transformers engine's torch device, default a GPU if any).
    `on_progress` when sampling starts (nothing done: how much there is) and as it goes."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    task = await read_split(store, manifest, split)
    items = task.items[: len(task) if n_prompts is None else n_prompts]
    rebuilt = await rebuild(store, manifest.run, version, trust=trust)
    anchor = await read_anchor_manifest(store, rebuilt.manifest.anchor.manifest, trust=trust)
    folder = work_dir / f"v{version}"
    await download_extras(store, anchor, folder / "extras")
    await asyncio.to_thread(save_hf_folder, rebuilt.state, folder, source_dir=folder / "extras")
    tool = None
    if task.tool_format is not None:
        tool = tool_for(task, ToolContext(run=manifest.run, store=store, data_dir=work_dir))
    if on_progress is not None:
        on_progress(EvalProgress(0, len(items), 0, len(items) * k * max_tokens))  # both engines count budget tokens
    groups = await _sample(
        engine, folder, task, items, k=k, temperature=temperature, max_tokens=max_tokens, stop=manifest.stop,
        seed=seed, tool=tool, work_dir=work_dir, device=device, on_progress=on_progress,
    )
    results = tuple(
        PromptResult(
            prompt_index=item.index,
            rewards=tuple(float(task.reward(c.text, item.label)) for c in group),
            truncated=tuple(c.finish_reason in ("length", "turns") for c in group),
            tool_calls=tuple(int(c.tool_calls) for c in group) if tool is not None else None,
            matches=_matches(task, [c.text for c in group], item.label),
        )
        for item, group in zip(items, groups, strict=True)
    )
    return VersionResult(version, split, k, results, threshold, match=task_match(task))


async def _sample(
    engine: Engine, folder: Path, task: Task, items: Sequence[TaskItem], *, k: int, temperature: float,
    max_tokens: int, stop: tuple[str, ...], seed: int | None, tool: Tool | None, work_dir: Path, device: str | None,
    on_progress: Callable[[EvalProgress], None] | None = None,
) -> Sequence[Sequence[Any]]:
    """k completions per item, in item order (`text`, `finish_reason`, `tool_calls` each)."""
    if engine == "transformers":
        from .hf_generate import default_device, hf_answer_prompts, load_hf_model

        model, tokenizer = await asyncio.to_thread(load_hf_model, folder, device or default_device())
        prompts = [prompt_tokens(tokenizer, task, item) for item in items]
        told = None if on_progress is None else _Told(on_progress, len(prompts), len(prompts) * k * max_tokens)
        return await hf_answer_prompts(
            model, tokenizer, task, prompts, temperature=temperature, max_tokens=max_tokens, k=k,
            stop=stop, seed=seed, tool=tool, on_group=None if told is None else told.group,
            on_progress=None if told is None else told.tokens,
        )
    return await mlx_sample(
        folder, task, n_prompts=len(items), k=k, temperature=temperature, max_tokens=max_tokens,
        stop=stop, seed=seed, tool=tool, work_dir=work_dir, on_progress=on_progress,
    )


class _Told:
    """The transformers engine's callbacks (budget tokens, groups finished) told as one `EvalProgress`."""

    def __init__(self, on_progress: Callable[[EvalProgress], None], prompts: int, tokens: int) -> None:
        self.on_progress, self.prompts = on_progress, prompts
        self.prompts_done, self.budget = 0, (0, tokens)  # the last budget told

    def tokens(self, done: int, total: int) -> None:
        self.budget = (done, total)
        self.on_progress(EvalProgress(self.prompts_done, self.prompts, done, total))

    def group(self, n: int) -> None:
        self.prompts_done = n
        self.tokens(*self.budget)


def mlx_command(
    folder: Path, task_file: Path, out_file: Path, *, n_prompts: int, k: int, temperature: float, max_tokens: int,
    stop: tuple[str, ...], seed: int | None, tool: bool, progress: bool = False,
) -> list[str]:
    """The command line of the mlx engine's process (`macd.eval_process.build_parser`)."""
    return [
        sys.executable, *MLX_SAMPLER, "--model", str(folder), "--task", str(task_file), "--prompts", str(n_prompts),
        "--k", str(k), "--max-tokens", str(max_tokens), "--temperature", repr(float(temperature)),
        *(f"--stop={s}" for s in stop), *(() if seed is None else ("--seed", str(seed))),
        *(("--tool-stdio",) if tool else ()), *(("--progress",) if progress else ()), "--out", str(out_file),
    ]


async def mlx_sample(
    folder: Path, task: Task, *, n_prompts: int, k: int, temperature: float, max_tokens: int,
    stop: tuple[str, ...], seed: int | None, tool: Tool | None, work_dir: Path,
    on_progress: Callable[[EvalProgress], None] | None = None,
) -> list[list[Sampled]]:
    """k completions for each of `task`'s first `n_prompts` prompts from the model `folder`,
    sampled by ``python -m macd.eval_process`` (its tool calls answered here by `tool`;
    `on_progress` told of its progress lines); EngineFailed when the process fails."""
    work_dir.mkdir(parents=True, exist_ok=True)
    task_file, out_file = work_dir / "eval-task.data", work_dir / "eval-completions.json"
    await asyncio.to_thread(task_file.write_bytes, task.encode())
    out_file.unlink(missing_ok=True)
    cmd = mlx_command(folder, task_file, out_file, n_prompts=n_prompts, k=k, temperature=temperature,
                      max_tokens=max_tokens, stop=stop, seed=seed, tool=tool is not None, progress=on_progress is not None)
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdin=asyncio.subprocess.PIPE if tool is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=MAX_LINE,
    )
    stderr_tail: deque[str] = deque(maxlen=20)
    try:
        await asyncio.gather(_answer_tool_calls(proc, tool), _keep_tail(proc.stderr, stderr_tail, on_progress))
        code = await proc.wait()
    finally:
        if proc.returncode is None:  # cancelled, or a bad line from it
            proc.kill()
            await proc.wait()
    if code != 0:
        raise EngineFailed(f"the mlx engine (`{' '.join(cmd[:3])}`) {_exit_text(code)}: "
                           f"{_last_line(stderr_tail) or 'it printed nothing'}")
    try:
        doc = json.loads(await asyncio.to_thread(out_file.read_text, encoding="utf-8"))
        groups = [[Sampled(str(c["text"]), str(c["finish_reason"]), int(c["tool_calls"])) for c in g]
                  for g in doc["completions"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineFailed(f"the mlx engine wrote no readable completions to {out_file}: {exc}") from None
    if len(groups) != n_prompts or any(len(g) != k for g in groups):
        raise EngineFailed(f"the mlx engine answered {[len(g) for g in groups]} samples per prompt; "
                           f"asked for {k} for each of {n_prompts}")
    return groups


async def _answer_tool_calls(proc: asyncio.subprocess.Process, tool: Tool | None) -> None:
    """Answer each `{"tool_call": {"id", "query"}}` line of the process with `call_tool` (as a
    worker's episodes do), until its stdout closes. Without a tool, its stdout is read and dropped."""
    assert proc.stdout is not None
    calls: set[asyncio.Task[None]] = set()

    async def answer(tool: Tool, n: int, query: str) -> None:
        text = await call_tool(tool, query)  # never raises: an error or a timeout is the text
        assert proc.stdin is not None
        with contextlib.suppress(ConnectionError):  # it finished (or timed out) without this answer
            proc.stdin.write((json.dumps({"id": n, "text": text}) + "\n").encode())
            await proc.stdin.drain()

    try:
        while line := await proc.stdout.readline():
            if tool is None:
                continue
            try:
                call = json.loads(line)["tool_call"]
                n, query = int(call["id"]), call["query"]
                if not isinstance(query, str):
                    raise TypeError("the query is not text")
            except (ValueError, KeyError, TypeError) as exc:
                raise EngineFailed(f"the mlx engine wrote a line that is no tool call ({exc}): {line[:200]!r}") from None
            task = asyncio.create_task(answer(tool, n, query))
            calls.add(task)
            task.add_done_callback(calls.discard)
    finally:
        for task in calls:
            task.cancel()
        if proc.stdin is not None:
            proc.stdin.close()


async def _keep_tail(
    stream: asyncio.StreamReader | None, tail: deque[str], on_progress: Callable[[EvalProgress], None] | None = None,
) -> None:
    """Keep the stream's last lines in `tail`, its progress lines told to `on_progress` instead."""
    assert stream is not None
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        progress = parse_progress(text)
        if progress is None:
            tail.append(text)
        elif on_progress is not None:
            on_progress(progress)


def parse_progress(line: str) -> EvalProgress | None:
    """The progress a line of the mlx engine's process tells: "TOKENS/TOTAL PROMPTS/TOTAL" or
    "PROMPTS/TOTAL" after the prefix; None for any other line."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    fields = line[len(PROGRESS_PREFIX):].split()
    counts = [c for field in fields if (c := _fraction(field)) is not None]
    if len(counts) != len(fields) or len(counts) not in (1, 2):
        return None
    if len(counts) == 1:
        return EvalProgress(*counts[0])
    (tokens_done, tokens), (done, total) = counts
    return EvalProgress(done, total, tokens_done, tokens)


def _fraction(field: str) -> tuple[int, int] | None:
    """(done, total) of "DONE/TOTAL" (decimal digits); None for anything else."""
    done, sep, total = field.partition("/")
    digits = sep and done.isascii() and done.isdigit() and total.isascii() and total.isdigit()
    return (int(done), int(total)) if digits else None


def _last_line(lines: deque[str]) -> str:
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def _exit_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
