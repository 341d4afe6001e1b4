"""macd.episodes: multi-turn tool episodes on a tiny random Qwen2 with stand-in tools."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("MLX_DISABLE_COMPILE", "1")
mlx_lm = pytest.importorskip("mlx_lm")
pytest.importorskip("tokenizers")

from macd.episodes import EpisodeCompletion, EpisodeGenerator, run_episodes
from macd.generate import SamplingConfig, teacher_forced_logprobs
from slime_stoa.protocol.records import RolloutGroup, Sample, SamplingParams, encode_group
from slime_stoa.protocol.validate import RecordLimits, load_record
from slime_stoa.quickstart.tiny_model import build_tiny_model
from slime_stoa.tasks.episode import Episode, extract_query, turn_action
from slime_stoa.tasks.tool_format import ToolFormat
from slime_stoa.tasks.tools import EchoTool, LookupTool, ToolContext, call_tool, register_tool, tool_for

RECORDED_VS_TEACHER_ATOL = 1e-5  # as in test_generate: the cached decode and one full pass agree

# The random model writes "e" every few tokens: as the call tag it closes many tool calls, valid
# ones when the turn wrote a space (the call's opening tag) before it, invalid actions otherwise.
# Its answer tag is a special token it writes now and then.
FORMAT = ToolFormat(call_open=" ", call_close="e", answer_close="<|im_start|>", observation_open="[",
                    observation_close="]", max_turns=3, max_observation_tokens=6)
CONFIG = SamplingConfig(temperature=1.0, max_tokens=40, group_size=4, seed=3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return mlx_lm.load(str(build_tiny_model(tmp_path_factory.mktemp("tiny"))))


@pytest.fixture(scope="module")
def prompts(loaded: tuple[Any, Any]) -> list[list[int]]:
    _, tok = loaded
    return [list(tok.encode("7 + 5 =")), list(tok.encode("Tom has 3 apples and buys 4 more. How many?"))]


def spans(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


# -- the pure state machine ------------------------------------------------------------------------


def test_episode_state_machine() -> None:
    ep = Episode(budget=8, max_turns=2)
    assert ep.sampled(5, -0.5, eos=False, stopped=False) == "continue"
    assert ep.sampled(6, -0.25, eos=False, stopped=False, call="call") == "call"
    ep.ask("q")
    with pytest.raises(RuntimeError):
        ep.sampled(7, -1.0, eos=False, stopped=False)  # waiting for its tool
    assert ep.observe([90, 91, 92]) == ("continue", [90, 91, 92])
    assert (ep.turns, ep.tool_calls, ep.turn_start, ep.left) == (2, 1, 5, 3)
    # a call in the last allowed turn ends the episode; the tool is not run
    assert ep.sampled(8, -0.1, eos=False, stopped=False, call="call") == "done"
    assert ep.finish == "turns" and ep.query is None and not ep.waiting
    assert ep.mask == [1, 1, 0, 0, 0, 1] and ep.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -0.1]


def test_invalid_actions_get_an_observation_and_count_as_turns() -> None:
    ep = Episode(budget=20, max_turns=3)
    assert ep.sampled(1, -0.1, eos=False, stopped=False, call="invalid") == "invalid"
    assert ep.waiting and ep.query is None
    with pytest.raises(RuntimeError):
        ep.ask("q")  # an invalid action asks no tool
    assert ep.observe([9, 9]) == ("continue", [9, 9])
    assert (ep.turns, ep.tool_calls, ep.invalid_actions) == (2, 1, 1)
    assert ep.sampled(2, -0.1, eos=False, stopped=False, call="call") == "call"
    ep.ask("q")
    ep.observe([8])
    assert (ep.turns, ep.tool_calls, ep.invalid_actions) == (3, 2, 1)
    assert ep.sampled(3, -0.1, eos=False, stopped=False, call="invalid") == "done"
    assert ep.finish == "turns"
    with pytest.raises(RuntimeError):
        Episode(budget=5, max_turns=2).observe([1])  # not waiting


def test_a_call_inside_an_open_answer_ends_the_episode() -> None:
    ep = Episode(budget=20, max_turns=3)
    ep.sampled(1, -0.1, eos=False, stopped=False)
    assert ep.sampled(2, -0.1, eos=False, stopped=False, call="in_answer") == "done"
    assert (ep.finish, ep.format_error, ep.eos, ep.tool_calls) == ("stop", True, False, 0)
    last = Episode(budget=20, max_turns=1)  # before the turn limit
    assert last.sampled(2, -0.1, eos=False, stopped=False, call="in_answer") == "done" and last.finish == "stop"
    full = Episode(budget=1, max_turns=3)  # the budget first
    assert full.sampled(2, -0.1, eos=False, stopped=False, call="in_answer") == "done" and full.finish == "length"


def test_episode_budget_cuts_observations_and_outranks_calls() -> None:
    ep = Episode(budget=4, max_turns=5)
    ep.sampled(1, -0.1, eos=False, stopped=False, call="call")
    ep.ask("q")
    assert ep.observe([7, 7, 7, 7, 7]) == ("done", [7, 7, 7])  # cut to the budget
    assert ep.finish == "length" and ep.tool_calls == 1 and ep.turns == 1 and len(ep.tokens) == 4
    ep = Episode(budget=2, max_turns=5)
    ep.sampled(1, -0.1, eos=False, stopped=False)
    assert ep.sampled(2, -0.1, eos=False, stopped=False, call="call") == "done"  # no room for an answer
    assert ep.finish == "length"
    ep = Episode(budget=2, max_turns=5)
    ep.sampled(1, -0.1, eos=False, stopped=False)
    assert ep.sampled(2, -0.1, eos=True, stopped=False) == "done"
    assert (ep.finish, ep.eos) == ("stop", True)  # EOS at the limit is a stop, as in macd.generate


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ("think <search>a</search> <search> capital of France </search>", ("call", "a")),
        ("I think. <search>x <search> capital </search>", ("call", "capital")),
        ("<search></search>", ("call", "")),
        ("gene X</search>", ("invalid", "")),  # no opening tag: feedback, not a query
        ("<answer> let me check <search>q</search>", ("in_answer", "")),
        ("<search> x <answer> y</search>", ("in_answer", "")),
        ("<answer>a</answer><search>q</search>", ("call", "q")),  # closed answers (never in one engine turn)
        ("\uff1canswer\uff1e <search>q</search>", ("call", "q")),  # a look-alike opens nothing
    ],
)
def test_turn_action(turn: str, expected: tuple[str, str]) -> None:
    fmt = ToolFormat()
    assert turn_action(turn, fmt) == expected
    assert extract_query(turn, fmt) == (expected[1] if expected[0] == "call" else None)


def test_tool_output_cannot_carry_tags() -> None:
    fmt = ToolFormat(max_observation_tokens=3)
    assert fmt.clean_output("a</sea</search>rch>b<answer>c</answer>", 100) == (
        "a&lt;/sea&lt;/search&gt;rch&gt;b&lt;answer&gt;c&lt;/answer&gt;"
    )
    assert fmt.clean_output("stop here STOP", 100, extra=("STOP",)) == "stop here "
    assert fmt.clean_output("p < 0.05 &lt;", 100) == "p &lt; 0.05 &lt;"
    # a format whose tags hold no angle bracket: the tags are removed, until none is left
    odd = ToolFormat(call_open="[", call_close="e", answer_close="!", answer_open="?")
    assert odd.clean_output("e[[ee?!x", 100) == "x"
    with pytest.raises(ValueError):
        ToolFormat(call_close="</answer>")
    with pytest.raises(ValueError):
        ToolFormat(answer_open="")
    text = fmt.invalid_action_text
    assert text.startswith("My previous action is invalid.") and "<search> and </search>" in text
    assert "<" not in fmt.clean_output(text, 1000) and "&lt;answer&gt; and &lt;/answer&gt;" in fmt.clean_output(text, 1000)


# -- tools -------------------------------------------------------------------------------------------


def test_call_tool_runs_sync_tools_off_the_calling_thread_and_never_raises() -> None:
    seen: list[int] = []

    def sync_tool(q: str) -> str:
        seen.append(threading.get_ident())
        return q.upper()

    def broken(q: str) -> str:
        raise KeyError(q)

    async def slow(q: str) -> str:
        await asyncio.sleep(5)
        return q

    async def main() -> list[str]:
        return [await call_tool(sync_tool, "abc"), await call_tool(broken, "x"), await call_tool(slow, "y", timeout_s=0.05),
                await call_tool(lambda q: 5, "z"), await call_tool(EchoTool(">"), "hi")]  # type: ignore[arg-type, return-value]

    assert asyncio.run(main()) == ["ABC", "tool error: KeyError", "tool error: no answer within 0.05 s",
                                   "tool error: answered int, not text", ">hi"]
    assert seen and seen[0] != threading.get_ident()


def test_tool_registry() -> None:
    class FakeTask:
        name = "lookup-test"

    ctx = ToolContext(run="r")
    with pytest.raises(ValueError, match="no tool is registered"):
        tool_for(type("Other", (), {"name": "other"})(), ctx)
    register_tool("lookup-test", lambda task, context: LookupTool({"a": context.run}))
    assert tool_for(FakeTask(), ctx)("a") == "r"


# -- episodes on the tiny model -----------------------------------------------------------------------


def run(loaded: tuple[Any, Any], prompts: list[list[int]], tool: Any, **kw: Any) -> list[list[EpisodeCompletion]]:
    model, tok = loaded
    return asyncio.run(run_episodes(model, tok, prompts, CONFIG, FORMAT, tool, **kw))


@pytest.fixture(scope="module")
def episodes(loaded: tuple[Any, Any], prompts: list[list[int]]) -> tuple[list[list[EpisodeCompletion]], LookupTool]:
    tool = LookupTool({}, default="look: the answer is 12")
    return run(loaded, prompts, tool, max_batch=5), tool


def test_episodes_interleave_model_and_tool_tokens(
    loaded: tuple[Any, Any], prompts: list[list[int]], episodes: tuple[list[list[EpisodeCompletion]], LookupTool]
) -> None:
    model, tok = loaded
    groups, tool = episodes
    gen = EpisodeGenerator(model, tok, CONFIG, FORMAT, max_batch=1)
    observation = gen.observation_tokens(tool.default)
    feedback = gen.observation_tokens(FORMAT.invalid_action_text)
    gen.close()
    assert "e" not in tok.decode(observation)  # the call tag is stripped from the tool's output
    calls = invalid = 0
    finishes = set()
    for group in groups:
        assert len(group) == CONFIG.group_size
        for c in group:
            n = len(c.tokens)
            assert 1 <= n <= CONFIG.max_tokens and len(c.logprobs) == len(c.mask) == n
            assert c.mask.dtype == np.uint8 and set(c.mask.tolist()) <= {0, 1} and c.mask[0] == 1
            runs = spans(c.mask)
            tool_runs = [r for r in runs if r[0] == 0]
            assert (c.turns, c.tool_calls) == (len(runs) - len(tool_runs), len(tool_runs))
            assert c.turns <= FORMAT.max_turns
            for k, (value, start, end) in enumerate(runs):
                if value == 0:
                    # after a model turn that closed a call with its last token: exactly the tool's
                    # answer in its tags, or the feedback for an invalid action (cut only by the budget)
                    turn = c.tokens[runs[k - 1][1] : start].tolist()
                    assert FORMAT.call_close in tok.decode(turn) and FORMAT.call_close not in tok.decode(turn[:-1])
                    kind, _ = turn_action(tok.decode(turn), FORMAT)
                    expected = observation if kind == "call" else feedback
                    assert kind in ("call", "invalid")
                    assert c.tokens[start:end].tolist() == expected[: end - start]
                    assert end - start == len(expected) or end == n == CONFIG.max_tokens
                    assert np.all(c.logprobs[start:end].view(np.uint32) == 0)  # +0.0
                    invalid += kind == "invalid"
                else:
                    assert np.all(c.logprobs[start:end] < 0)
            calls += c.tool_calls - c.invalid_actions
            finishes.add(c.finish_reason)
            assert c.finish_reason in ("stop", "length", "turns")
            if c.finish_reason == "length":
                assert n == CONFIG.max_tokens
            if c.finish_reason == "turns":
                assert c.turns == FORMAT.max_turns and c.mask[-1] == 1
            assert c.text == tok.decode(c.tokens.tolist()[:-1] if c.tokens[-1] in tok.eos_token_ids else c.tokens.tolist())
    assert calls >= 4 and len(tool.queries) == calls
    assert invalid >= 1 and invalid == sum(c.invalid_actions for g in groups for c in g)
    assert "turns" in finishes  # the tiny model keeps calling: episodes hit the turn limit


def test_logprobs_align_with_model_tokens_only(
    loaded: tuple[Any, Any], prompts: list[list[int]], episodes: tuple[list[list[EpisodeCompletion]], LookupTool]
) -> None:
    """Resumed sequences continue from the KV cache they left with: a teacher-forced pass over
    prompt + the whole episode gives the recorded logprobs at every model token."""
    model, _ = loaded
    groups, _ = episodes
    checked = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            teacher = teacher_forced_logprobs(model, prompt, c.tokens, CONFIG.temperature)
            model_pos = c.mask == 1
            np.testing.assert_allclose(c.logprobs[model_pos], teacher[model_pos], atol=RECORDED_VS_TEACHER_ATOL, rtol=0)
            checked += int((~model_pos).any())
    assert checked >= 2  # episodes with tool spans were checked


def test_queries_are_the_turn_text_before_the_call_tag(
    loaded: tuple[Any, Any], episodes: tuple[list[list[EpisodeCompletion]], LookupTool]
) -> None:
    _, tok = loaded
    groups, tool = episodes
    expected = []
    for group in groups:
        for c in group:
            runs = spans(c.mask)
            for i, (value, start, end) in enumerate(runs):
                if value == 1 and i + 1 < len(runs):
                    query = extract_query(tok.decode(c.tokens[start:end].tolist()), FORMAT)
                    if query is not None:  # an invalid action asks no tool
                        expected.append(query)
    assert sorted(tool.queries) == sorted(expected)


def test_episodes_make_valid_v2_records(
    prompts: list[list[int]], episodes: tuple[list[list[EpisodeCompletion]], LookupTool]
) -> None:
    groups, _ = episodes
    for i, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        record = RolloutGroup(
            kind="train", run="run-1", task_id="search", prompt_index=i,
            prompt_tokens=prompt, weight_version=1, state_digest="ab" * 16,
            samples=[Sample(response_tokens=c.tokens, logprobs=c.logprobs, finish_reason=c.finish_reason, reward=0.0,
                            mask=c.mask, turns=c.turns, tool_calls=c.tool_calls) for c in group],
            sampling=SamplingParams(temperature=CONFIG.temperature, top_p=1.0, max_tokens=CONFIG.max_tokens,
                                    stop=(FORMAT.answer_close,)),
            worker_id="mac-01", seq=i, started_at=1_700_000_000.0, finished_at=1_700_000_001.0,
        )
        limits = RecordLimits(vocab_size=512, max_turns=FORMAT.max_turns, max_tool_tokens=FORMAT.max_observation_tokens + 2)
        assert load_record(encode_group(record), limits, now=1_700_000_002.0) == record


def test_episodes_are_deterministic_for_a_seed(
    loaded: tuple[Any, Any], prompts: list[list[int]], episodes: tuple[list[list[EpisodeCompletion]], LookupTool]
) -> None:
    """Async and sync tools, batch sizes aside, the same seed gives the same episodes."""
    groups, _ = episodes
    again = run(loaded, prompts, EchoTool(), max_batch=5)
    # same sampled tokens up to the first observation (the tools answer differently)
    for g1, g2 in zip(groups, again, strict=True):
        for a, b in zip(g1, g2, strict=True):
            first = spans(a.mask)[0][2]
            assert a.tokens[:first].tolist() == b.tokens[:first].tolist()


def test_discard_drops_waiting_episodes_and_ignores_late_answers(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    model, tok = loaded
    gen = EpisodeGenerator(model, tok, CONFIG, FORMAT, max_batch=8)
    gen.insert(prompts[0], "a")
    calls = []
    while not calls:
        gen.advance(4)
        calls = gen.take_calls()
    assert gen.waiting >= 1 and gen.groups == 1
    assert gen.discard() == ["a"] and gen.groups == gen.waiting == gen.decoding == 0
    gen.deliver(calls[0].episode, "late")
    gen.insert(prompts[1], "b")
    finished: list[Any] = []
    while gen.groups:  # answer every call at once; the late answer is ignored
        done, _ = gen.advance(16)
        finished += done
        for call in gen.take_calls():
            gen.deliver(call.episode, "ok")
    gen.close()
    assert [f.tag for f in finished] == ["b"] and len(finished[0].completions) == CONFIG.group_size


def test_mlx_work_can_run_on_its_own_thread(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    """As in the worker: every MLX call on one thread, the tools on the event loop."""
    from macd.mlx_thread import MLXThread

    mlx = MLXThread()
    loop_thread: list[int] = []

    class Tool:
        async def __call__(self, q: str) -> str:
            loop_thread.append(threading.get_ident())
            return "x"

    try:
        groups = run(loaded, prompts[:1], Tool(), mlx=mlx.run)
    finally:
        mlx.close()
    assert len(groups[0]) == CONFIG.group_size and loop_thread
    assert set(loop_thread) == {threading.get_ident()}



# -- Search-R1's rules (the search task's papersearchqa preset): turn budget, no-action feedback ----
R1_FORMAT = ToolFormat(call_open=" ", call_close="e", answer_close="<|im_start|>", observation_open="[",
                       observation_close="]", max_turns=3, max_observation_tokens=6, max_turn_tokens=4,
                       no_action="feedback", layout="search-r1")


def test_no_action_feedback_and_turn_budget_in_the_state_machine() -> None:
    ep = Episode(budget=50, max_turns=3, turn_budget=3, no_action_feedback=True)
    assert ep.sampled(1, -0.1, eos=False, stopped=False) == "continue" and ep.turn_left == 2
    assert ep.sampled(2, -0.1, eos=False, stopped=False) == "continue"
    assert ep.sampled(3, -0.1, eos=False, stopped=False) == "invalid"  # the turn budget, no action: feedback
    assert ep.observe([9, 9]) == ("continue", [9, 9]) and ep.turns == 2 and ep.invalid_actions == 1
    assert ep.sampled(7, -0.1, eos=True, stopped=False) == "invalid"  # an EOS without an answer: feedback too
    ep.observe([9])
    assert ep.sampled(7, -0.1, eos=True, stopped=False) == "done"  # the last turn: the episode ends
    assert (ep.finish, ep.eos, ep.turns, ep.tool_calls) == ("stop", True, 3, 2)
    assert ep.mask == [1, 1, 1, 0, 0, 1, 0, 1] and ep.tokens[4] == 9
    # without feedback the turn budget ends the episode ("length"), and EOS stops it
    plain = Episode(budget=50, max_turns=3, turn_budget=1)
    assert plain.sampled(1, -0.1, eos=False, stopped=False) == "done" and plain.finish == "length"
    answered = Episode(budget=50, max_turns=3, turn_budget=2, no_action_feedback=True)
    assert answered.sampled(1, -0.1, eos=False, stopped=True) == "done" and answered.finish == "stop"


def test_search_r1_episodes_continue_after_feedback_from_their_cache(loaded: tuple[Any, Any], prompts: list[list[int]]) -> None:
    """With Search-R1's rules the MLX driver keeps a turn that ended without an action (EOS or
    the turn budget) in the batch, appends the exact feedback text and goes on from its cache:
    the teacher-forced logprobs match the recorded ones at every model token."""
    model, tok = loaded
    groups = asyncio.run(run_episodes(model, tok, prompts, CONFIG, R1_FORMAT, LookupTool({}, default="Doc 1(Title: x) y")))
    feedback = tok.encode(R1_FORMAT.invalid_action_observation, add_special_tokens=False)
    assert tok.decode(feedback) == "\nMy previous action is invalid. If I want to search, I should put the query between " \
        "  and e. If I want to give the final answer, I should put the answer between <answer> and <|im_start|>. Let me try again.\n"
    no_action = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            runs = spans(c.mask)
            for k, (value, start, end) in enumerate(runs):
                if value == 1:
                    assert end - start <= R1_FORMAT.max_turn_tokens
                    continue
                turn = c.tokens[runs[k - 1][1] : start].tolist()
                if R1_FORMAT.call_close not in tok.decode(turn):  # ended without an action
                    assert len(turn) == R1_FORMAT.max_turn_tokens or turn[-1] in tok.eos_token_ids
                    assert c.tokens[start:end].tolist() == feedback[: end - start]
                    no_action += 1
            teacher = teacher_forced_logprobs(model, prompt, c.tokens, CONFIG.temperature)
            np.testing.assert_allclose(c.logprobs[c.mask == 1], teacher[c.mask == 1], atol=RECORDED_VS_TEACHER_ATOL, rtol=0)
    assert no_action >= 1
