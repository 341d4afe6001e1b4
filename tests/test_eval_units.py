"""Pure parts of the eval: the pass@k estimator, eval-request parsing, the result rows and files."""

from __future__ import annotations

import csv
import itertools
import json
import math
from pathlib import Path

import pytest

from slime_stoa.evaluation.passk import mean_pass_at_k, pass_at_k
from slime_stoa.evaluation.report import PromptResult, VersionResult, plot_curve, write_csv, write_json
from slime_stoa.protocol.eval_request import EvalRequest, EvalRequestError, parse_request
from slime_stoa.protocol.layout import RunLayout
from slime_stoa.protocol.run_trust import RunTrust
from slime_stoa.protocol.signing import SigningKey

RUN = "r"


def brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (c correct) holding at least one correct sample."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_of_every_subset(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_closed_forms_and_bad_input() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 0, 10) == 0.0 and pass_at_k(200, 200, 1) == 1.0
    assert pass_at_k(200, 13, 50) == pytest.approx(1 - math.comb(187, 50) / math.comb(200, 50))
    for bad in ((3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    assert mean_pass_at_k([[1.0, 0.0], [0.0, 0.0]], 1) == pytest.approx(0.25)
    assert mean_pass_at_k([[1.0, 0.0], [0.0, 0.0]], 2) == pytest.approx(0.5)
    assert mean_pass_at_k([[0.6, 0.4]], 1, threshold=0.5) == pytest.approx(0.5)


def req(**kw) -> EvalRequest:
    fields = dict(run=RUN, version=3, split="test", k=4, prompts=(0, 2, 5), max_tokens=64, temperature=0.7, created_at=1.7e9)
    return EvalRequest(**{**fields, **kw})


def test_request_round_trips_and_is_keyed_by_version_and_split() -> None:
    r = req()
    assert r.key == "runs/r/eval-requests/000000000003-test.json"
    assert RunLayout(RUN).parse_eval_request(r.key) == (3, "test")
    assert parse_request(r.to_bytes(), key=r.key, run=RUN) == r
    assert r.sampling(("</s>",)).max_tokens == 64 and r.sampling().top_p == 1.0
    for key in ("runs/r/eval-requests/3-test.json", "runs/r/eval-requests/000000000003-.json",
                "runs/r/eval-requests/000000000003-a/b.json", "runs/r/evals/000000000003-test.json"):
        assert RunLayout(RUN).parse_eval_request(key) is None


@pytest.mark.parametrize(
    "edit",
    [
        {"k": 0}, {"k": 65}, {"k": True}, {"version": -1}, {"max_tokens": 0}, {"temperature": 0},
        {"temperature": float("nan")}, {"prompts": [2, 1]}, {"prompts": [1, 1]}, {"prompts": [-1]},
        {"prompts": "012"}, {"split": "../x"}, {"run": "other"}, {"version": 4}, {"split": "train"},
        {"created_at": "now"}, {"extra": 1}, {"format": "stoa.eval-request/9"},
    ],
)
def test_hostile_requests_are_refused(edit: dict) -> None:
    doc = {**req().to_doc(), **edit}
    with pytest.raises(EvalRequestError):
        parse_request(json.dumps(doc).encode(), key=req().key, run=RUN)


def test_hostile_bytes_are_refused() -> None:
    key = req().key
    for data in (b"", b"[]", b"{", b'{"a":1,"a":2}', b"\xff", b"[" * 100 + b"]" * 100):
        with pytest.raises(EvalRequestError):
            parse_request(data, key=key, run=RUN)
    with pytest.raises(EvalRequestError):
        parse_request(req().to_bytes(), key="runs/r/current.json", run=RUN)
    missing = req().to_doc()
    del missing["k"]
    with pytest.raises(EvalRequestError, match="missing"):
        parse_request(json.dumps(missing).encode(), key=key, run=RUN)


def test_a_signed_run_needs_the_run_keys_signature() -> None:
    run_key, other = SigningKey.generate(), SigningKey.generate()
    trust = RunTrust(RUN, run_key.public)
    r = req()
    assert parse_request(r.to_bytes(run_key), key=r.key, run=RUN, trust=trust) == r
    for data in (r.to_bytes(), r.to_bytes(other)):
        with pytest.raises(EvalRequestError):
            parse_request(data, key=r.key, run=RUN, trust=trust)
    forged = json.loads(r.to_bytes(run_key))
    forged["k"] = 8  # changed after signing
    with pytest.raises(EvalRequestError):
        parse_request(json.dumps(forged).encode(), key=r.key, run=RUN, trust=trust)


def test_rows_and_files(tmp_path: Path) -> None:
    v0 = VersionResult(0, "test", 2, (PromptResult(0, (0.0, 0.0), (False, True)), PromptResult(1, (1.0, 0.0), (False, False))))
    v1 = VersionResult(
        1, "test", 2,
        (PromptResult(0, (1.0, 1.0), (False, False), (1, 0)), PromptResult(1, (1.0, 0.0), (False, False), (2, 1))),
    )
    rows = [v0.row(), v1.row()]
    assert rows[0] | {} == {"version": 0, "split": "test", "k": 2, "n_prompts": 2, "pass@1": 0.25, "pass@k": 0.5,
                            "reward_mean": 0.25, "search_rate": None}
    assert (rows[1]["pass@1"], rows[1]["pass@k"], rows[1]["search_rate"]) == (0.75, 1.0, 0.75)
    with pytest.raises(ValueError, match="fewer than k"):
        VersionResult(2, "test", 3, (PromptResult(0, (1.0,), (False,)),))
    got = list(csv.DictReader(write_csv(rows, tmp_path / "e.csv").open()))
    assert [r["version"] for r in got] == ["0", "1"] and got[0]["search_rate"] == "" and got[1]["pass@k"] == "1.0"
    doc = json.loads(write_json(rows, tmp_path / "e.json").read_text())
    assert [(v["version"], v["pass@1"], v["pass@k"], v["k"], v["n_prompts"]) for v in doc["versions"]] == [
        (0, 0.25, 0.5, 2, 2), (1, 0.75, 1.0, 2, 2),
    ]
    png = plot_curve(rows, tmp_path / "e.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
