"""Eval requests: the trainer side asks the fleet for an evaluation of one weight version.

    runs/<run>/eval-requests/<v>-<split>.json     (`RunLayout.eval_request`)

A request names a weight version, a split of the run's task (e.g. GSM8K's `test`), the prompt
indices still wanted and `k` samples per prompt, drawn at `temperature` with `max_tokens` (the
run manifest's stop strings). Workers holding that version answer with eval records (kind
`eval`, under `runs/<run>/evals/`), which the trainer never trains on. The folder is
trainer-written (a split store routes it to the weights bucket), and for a signed run the
document is signed with the run key: a worker verifies it with its run trust and ignores
anything else.

`prompts` shrinks as the requester accepts records: it rewrites the request with the prompts
not yet covered (and a higher `revision`), so workers re-reading it between chunks stop
generating what is already in. Coverage is judged only by the requester (records checked and
re-scored), never by workers from the records they list: those could be forged.

Parsing is strict (`parse_request`): strict JSON, no unknown or missing field, every value in
range, the document's version and split those of its key; `EvalRequestError` otherwise. A
request is read from the bucket with `get_request`, at most MAX_REQUEST_BYTES + 1 bytes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from .layout import RunLayout, check_name
from .records import SamplingParams
from .run_trust import RunTrust, Untrusted
from .signing import SIGNATURE_FIELD, SigningKey, sign_document
from .store import GetResult, Store
from .store.capped import read_capped
from .strict_json import load_json

FORMAT = "stoa.eval-request/1"
MAX_REQUEST_BYTES = 4 << 20
MAX_PROMPTS = 100_000  # prompt indices in one request
MAX_K = 64  # samples per prompt (the records' max_samples)
MAX_TOKENS = 1 << 20
MAX_TEMPERATURE = 100.0
_FIELDS = frozenset({"format", "run", "version", "split", "k", "prompts", "max_tokens", "temperature", "created_at", "revision"})


class EvalRequestError(ValueError):
    """A malformed, mis-keyed or untrusted eval request."""


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"eval request {name} must be an int in [{lo}, {hi}], got {str(value)[:40]!r}")
    return value


def _float(value: Any, name: str, lo: float, hi: float, *, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"eval request {name} must be a finite number, got {str(value)[:40]!r}")
    if value < lo or value > hi or (open_low and value == lo):
        raise ValueError(f"eval request {name} {value} is out of range")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class EvalRequest:
    """One eval request (ValueError for a bad field)."""

    run: str
    """The run whose weights are evaluated."""
    version: int
    """The weight version to evaluate."""
    split: str
    """The split of the run's task to evaluate on (`runs/<run>/tasks/<task>/<split>.jsonl.zst`)."""
    k: int
    """Samples per prompt (pass@k is estimated from them)."""
    prompts: tuple[int, ...]
    """Prompt indices of the split still wanted, sorted, without repeats."""
    max_tokens: int
    """Longest response, in tokens."""
    temperature: float
    """Sampling temperature (top_p is always 1)."""
    created_at: float = field(default_factory=time.time)
    """When the request was first written (seconds since the epoch)."""
    revision: int = 0
    """Raised each time the requester narrows `prompts`."""

    def __post_init__(self) -> None:
        check_name("run", self.run)
        check_name("task split", self.split)
        _int(self.version, "version", 0, 10**12 - 1)
        _int(self.k, "k", 1, MAX_K)
        _int(self.max_tokens, "max_tokens", 1, MAX_TOKENS)
        _int(self.revision, "revision", 0, 10**9)
        object.__setattr__(self, "temperature", _float(self.temperature, "temperature", 0.0, MAX_TEMPERATURE, open_low=True))
        object.__setattr__(self, "created_at", _float(self.created_at, "created_at", 0.0, 1e11))
        if isinstance(self.prompts, (str, bytes)) or not isinstance(self.prompts, (list, tuple)):
            raise ValueError("eval request prompts must be a list of prompt indices")
        if len(self.prompts) > MAX_PROMPTS:
            raise ValueError(f"eval request has {len(self.prompts)} prompts, at most {MAX_PROMPTS}")
        prompts = tuple(_int(i, "prompt index", 0, 10**9) for i in self.prompts)
        if list(prompts) != sorted(set(prompts)):
            raise ValueError("eval request prompts must be sorted and without repeats")
        object.__setattr__(self, "prompts", prompts)

    @property
    def key(self) -> str:
        return RunLayout(self.run).eval_request(self.version, self.split)

    def sampling(self, stop: tuple[str, ...] = ()) -> SamplingParams:
        """The sampling parameters its records carry (`stop`: the run manifest's)."""
        return SamplingParams(temperature=self.temperature, top_p=1.0, max_tokens=self.max_tokens, stop=tuple(stop))

    def to_doc(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "run": self.run, "version": self.version, "split": self.split, "k": self.k,
            "prompts": list(self.prompts), "max_tokens": self.max_tokens, "temperature": self.temperature,
            "created_at": self.created_at, "revision": self.revision,
        }

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The request's JSON, signed with the run key `key` when given."""
        doc = self.to_doc() if key is None else sign_document(self.to_doc(), key)
        return json.dumps(doc, sort_keys=True).encode() + b"\n"


async def get_request(store: Store, key: str, *, if_none_match: str | None = None) -> GetResult | None:
    """The stored eval request at `key` (bytes and ETag), read with one GET of at most
    MAX_REQUEST_BYTES + 1 bytes; None when its ETag is still `if_none_match`. TooLarge (a
    ValueError) when larger, NotFound when missing."""
    return await read_capped(store, key, MAX_REQUEST_BYTES, if_none_match=if_none_match)


def parse_request(data: bytes, *, key: str, run: str, trust: RunTrust | None = None) -> EvalRequest:
    """The request stored at `key` of `run`; EvalRequestError unless it is well-formed, its
    version and split are its key's, and (with `trust`, a signed run) it is signed by the run key."""
    where = RunLayout(run).parse_eval_request(key)
    if where is None:
        raise EvalRequestError(f"{str(key)[:120]!r} is not an eval-request key of run {run!r}")
    try:
        doc = load_json(data, max_bytes=MAX_REQUEST_BYTES)
    except ValueError as exc:
        raise EvalRequestError(f"{key}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise EvalRequestError(f"{key}: not a {FORMAT} document")
    if trust is not None:
        try:
            trust.verify(doc, key)
        except Untrusted as exc:
            raise EvalRequestError(f"{key}: {exc}") from None
    body = {k: v for k, v in doc.items() if k != SIGNATURE_FIELD}
    if set(body) != _FIELDS:
        raise EvalRequestError(f"{key}: fields {sorted(set(body) ^ _FIELDS)} unknown or missing")
    try:
        request = EvalRequest(**{k: v for k, v in body.items() if k != "format"})
    except (ValueError, TypeError) as exc:
        raise EvalRequestError(f"{key}: {exc}") from None
    if request.run != run or (request.version, request.split) != where:
        raise EvalRequestError(
            f"{key}: the document is for v{request.version} split {request.split!r} of run {request.run!r}"
        )
    return request


__all__ = ["FORMAT", "MAX_REQUEST_BYTES", "EvalRequest", "EvalRequestError", "get_request", "parse_request"]
