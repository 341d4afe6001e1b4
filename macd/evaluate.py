"""Answering eval requests (`slime_stoa.protocol.eval_request`): k samples per requested prompt
from the weights the worker holds, uploaded as eval records (kind `eval`, never trained on).

`EvalResponder.poll_forever` lists `runs/<run>/eval-requests/` every `poll_s` (one listing, and
a conditional GET per request), parses each request strictly and, for a signed run, verifies it
with the worker's run trust; a bad one is reported once and ignored. `serve` is called by the
worker's generation loop between decode calls: when a request names the version installed, it
generates k samples for up to `chunk` of its prompts this worker has not answered (drawn at
random, so workers rarely overlap; duplicates are harmless, the requester keeps the first k per
prompt) and spools them as eval records. Generation runs on the MLX thread while the loop waits,
so the weights cannot change under it (an install only happens at the loop's safe points). A
request for a version the worker no longer holds (it moved on) or does not hold yet is skipped.
Which prompts are still wanted is the request's `prompts`, which the requester narrows as it
accepts records: workers never judge coverage from the records they list (those could be forged).

`answer_prompts` is the generation itself (single-turn groups, or tool episodes for a tool
task); `python -m macd.eval_process` (macd/eval_process.py) runs it for `stoa eval --local`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from slime_stoa.protocol.eval_request import MAX_REQUEST_BYTES, EvalRequest, EvalRequestError, parse_request
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.records import RolloutGroup, Sample, encode_group
from slime_stoa.protocol.run_manifest import RunManifest
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signed_record import sign_record
from slime_stoa.protocol.signing import SigningKey
from slime_stoa.protocol.store import NotFound, Store, StoreConfigError
from slime_stoa.protocol.task_manifest import read_task_object
from slime_stoa.tasks import Task, TaskItem, load_task
from slime_stoa.tasks.prompting import prompt_tokens

log = logging.getLogger("macd")

Mlx = Callable[..., Awaitable[Any]]  # runs a function on the MLX thread


async def answer_prompts(
    model: Any, tokenizer: Any, task: Task, prompts: Sequence[Sequence[int]], *, temperature: float, max_tokens: int,
    k: int, stop: tuple[str, ...], seed: int | None, mlx: Mlx, tool: Any = None, max_batch: int | None = None,
    on_group: Callable[[int], None] | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> list[list[Any]]:
    """k completions per prompt (token ids), in prompt order: `macd.generate.Completion`s, or
    `macd.episodes.EpisodeCompletion`s for a tool task (`tool` answers its calls); `on_group(n)`
    as each prompt's group finishes (`n` finished so far). `on_progress(done, total)` after every
    decode step, in tokens of the budget (`macd.generate.generate_groups`), on the MLX thread; a
    tool task's episodes (whose tool answers take their turns too) tell only `on_group`."""
    from .generate import SamplingConfig, generate_groups

    config = SamplingConfig(temperature=temperature, max_tokens=max_tokens, group_size=k, stop=stop, seed=seed)
    if task.tool_format is None:
        return await mlx(generate_groups, model, tokenizer, prompts, config, max_batch=max_batch, on_group=on_group,
                         on_progress=on_progress)
    from .episodes import run_episodes

    if tool is None:
        raise ValueError(f"task {task.name!r} uses a tool: give one to answer its calls")
    return await run_episodes(model, tokenizer, prompts, config, task.tool_format, tool, max_batch=max_batch, mlx=mlx,
                              on_group=on_group)


def eval_record(
    *, manifest: RunManifest, request: EvalRequest, worker_id: str, item: TaskItem, prompt: Sequence[int],
    completions: Sequence[Any], rewards: Sequence[float], digest: str, started_at: float, tool_task: bool,
    signer: SigningKey | None,
) -> Callable[[int, int], bytes]:
    """A spool builder of one eval record (signed by the worker key `signer` when given)."""
    samples = tuple(
        Sample(
            response_tokens=c.tokens, logprobs=c.logprobs, finish_reason=c.finish_reason, reward=float(r),
            **({"mask": c.mask, "turns": c.turns, "tool_calls": c.tool_calls} if tool_task else {}),
        )
        for c, r in zip(completions, rewards, strict=True)
    )
    finished_at = time.time()

    def build(seq: int, _timestamp_ms: int) -> bytes:
        record = encode_group(
            RolloutGroup(
                kind="eval", run=manifest.run,
                task_id=manifest.task, prompt_index=item.index, prompt_tokens=np.asarray(prompt, dtype=np.int32),
                samples=samples, weight_version=request.version, state_digest=digest,
                sampling=request.sampling(manifest.stop), worker_id=worker_id, seq=seq, started_at=started_at,
                finished_at=finished_at,
            )
        )
        return record if signer is None else sign_record(record, signer, run=manifest.run)

    return build


class EvalResponder:
    """The run's open eval requests, as last read, and the prompts this worker answered."""

    def __init__(
        self, *, store: Store, manifest: RunManifest, worker_id: str, trust: RunTrust | None,
        signer: SigningKey | None, rng: random.Random, seed: int | None = None, poll_s: float = 10.0, chunk: int = 4,
        tool_for: Callable[[Task], Any] | None = None,
    ) -> None:
        self.store, self.manifest, self.worker_id = store, manifest, worker_id
        self.trust, self.signer, self.rng, self.seed = trust, signer, rng, seed
        self.poll_s, self.chunk, self.tool_for = poll_s, chunk, tool_for
        self.layout = RunLayout(manifest.run)
        self.requests: dict[str, EvalRequest] = {}  # key -> the request as last read
        self.answered: dict[tuple[str, float], set[int]] = {}  # (key, created_at) -> prompts this worker did
        self.splits: dict[str, Task] = {}
        self.groups = 0  # eval records spooled
        self._etags: dict[str, str] = {}
        self._refused: set[tuple[str, str]] = set()
        self._tools: dict[str, Any] = {}

    async def poll_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except StoreConfigError:
                raise
            except Exception as exc:  # a store outage or a hostile object: try again next time
                log.warning("eval requests not read: %s: %s", type(exc).__name__, exc)
            try:
                async with asyncio.timeout(self.poll_s):
                    await stop.wait()
            except TimeoutError:
                pass

    async def refresh(self) -> None:
        """Read the eval requests again (unchanged ones by ETag)."""
        keys = [i.key async for i in self.store.list(self.layout.eval_requests_prefix)]
        self.requests = {k: r for k, r in self.requests.items() if k in keys}
        for key in keys:
            if self.layout.parse_eval_request(key) is None:
                continue
            try:
                got = await self.store.get(key, length=MAX_REQUEST_BYTES + 1, if_none_match=self._etags.get(key))
            except NotFound:
                continue
            if got is None:  # unchanged
                continue
            try:
                request = parse_request(got.data, key=key, run=self.manifest.run, trust=self.trust)
                if request.split not in self.splits:
                    self.splits[request.split] = await self._load_split(request.split)
            except (EvalRequestError, ValueError) as exc:
                self.requests.pop(key, None)
                if (key, got.etag) not in self._refused:
                    self._refused.add((key, got.etag))
                    log.warning("ignoring eval request %s: %s", key, exc)
                continue
            self._etags[key] = got.etag
            self.requests[key] = request

    async def _load_split(self, split: str) -> Task:
        # a signed run's split is checked against its signed task manifest before it is parsed
        data = await read_task_object(self.store, self.manifest.run, self.manifest.task, split, self.trust)
        task = load_task(data)
        if task.name != self.manifest.task:
            raise ValueError(f"the {split!r} split holds task {task.name!r}, the run's is {self.manifest.task!r}")
        return task

    def next_job(self, version: int) -> tuple[EvalRequest, list[TaskItem]] | None:
        """Up to `chunk` prompts of a request for `version` this worker has not answered."""
        for request in self.requests.values():
            if request.version != version or not request.prompts:
                continue
            task = self.splits[request.split]
            done = self.answered.setdefault((request.key, request.created_at), set())
            todo = [p for p in request.prompts if p not in done and p < len(task)]
            if todo:
                picked = sorted(self.rng.sample(todo, min(self.chunk, len(todo))))
                return request, [task.item(p) for p in picked]
        return None

    async def serve(self, version: int, digest: str, *, mlx: Mlx, model: Any, tokenizer: Any, spool: Any) -> bool:
        """Answer one chunk of a request for `version` (the installed weights, `digest`); False
        when there is none."""
        job = self.next_job(version)
        if job is None:
            return False
        request, items = job
        task = self.splits[request.split]
        done = self.answered[(request.key, request.created_at)]
        tool_task = task.tool_format is not None
        tool = None
        if tool_task:
            if self.tool_for is None:
                done.update(i.index for i in items)
                log.warning("eval request %s: task %s needs a tool this worker has not got; skipped", request.key, task.name)
                return False
            tool = self._tools.get(request.split) or self._tools.setdefault(request.split, self.tool_for(task))
        started = time.time()
        prompts = [prompt_tokens(tokenizer, task, item) for item in items]
        seed = None if self.seed is None else self.rng.randrange(1 << 30)
        completions = await answer_prompts(
            model, tokenizer, task, prompts, temperature=request.temperature, max_tokens=request.max_tokens,
            k=request.k, stop=self.manifest.stop, seed=seed, mlx=mlx, tool=tool,
        )
        for item, prompt, group in zip(items, prompts, completions, strict=True):
            rewards = [task.reward(c.text, item.label) for c in group]
            build = eval_record(
                manifest=self.manifest, request=request, worker_id=self.worker_id, item=item, prompt=prompt,
                completions=group, rewards=rewards, digest=digest, started_at=started, tool_task=tool_task,
                signer=self.signer,
            )
            await asyncio.to_thread(spool.add, build, kind="eval")
            done.add(item.index)
            self.groups += 1
        log.info("eval v%d (%s): answered %d prompt(s) with k=%d", version, request.split, len(items), request.k)
        return True


__all__ = ["EvalResponder", "answer_prompts", "eval_record"]
