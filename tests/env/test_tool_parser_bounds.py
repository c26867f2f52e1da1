"""The tool-call parser on adversarial model text: one linear scan, capped (docs/agentic.md#tools).

A model turn is untrusted text. Before, ``parse_tool_calls("<tool_call>" * 8192)`` took 7 to 24
seconds (the regex tried every open tag against the whole rest of the text); each case here
parses in milliseconds, and the bound of one second leaves a loaded machine wide room while the
quadratic parser misses it several times over.
"""

import time

import pytest

from jaxrl.env import parse_tool_calls
from jaxrl.env.tools import MAX_PARSED_CHARS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
N = 8192
NEVER_CLOSED = "never closed"
BOUND_S = 1.0


def _timed(text: str, **kwargs):
    start = time.perf_counter()
    calls = parse_tool_calls(text, **kwargs)
    return calls, time.perf_counter() - start


def _errors(calls) -> list[str]:
    return [c.error for c in calls if c.error is not None]


@pytest.mark.parametrize("text", [OPEN * N, (OPEN + '{"name": "calculator"') * N],
                         ids=["bare-open-tags", "open-tags-with-json"])
def test_many_unclosed_open_tags_are_one_error_call_in_linear_time(text):
    calls, seconds = _timed(text)
    assert seconds < BOUND_S
    # Nothing is ever closed: the turn holds exactly one (unclosed) call, reported, none run.
    assert len(calls) == 1 and NEVER_CLOSED in calls[0].error and calls[0].name == ""


def test_many_fences_and_open_tags_in_linear_time():
    # "```python\n<tool_call>" repeated: fences pair up (open, close, open, close ...), each block
    # holding the text "<tool_call>" up to the next fence; the tags themselves are never closed.
    calls, seconds = _timed(("```python\n" + OPEN) * N, code_blocks=True)
    assert seconds < BOUND_S
    blocks = [c for c in calls if c.error is None]
    assert len(blocks) == N // 2 and {(c.name, c.arguments["code"]) for c in blocks} == {("python", OPEN)}
    assert len(calls) == N // 2 + 1 and NEVER_CLOSED in calls[-1].error


def test_many_malformed_closed_calls_each_get_their_own_error():
    calls, seconds = _timed((OPEN + "{" + CLOSE) * N + OPEN + '[1]' + CLOSE)
    assert seconds < BOUND_S
    errors = _errors(calls)
    assert len(calls) == len(errors) == N + 1
    assert all("not valid JSON" in e for e in errors[:N]) and "must be a JSON object, got list" in errors[N]


def test_a_huge_single_call_and_a_deeply_nested_one_parse_in_linear_time():
    expression = "1+" * 300_000 + "1"  # 600K characters, under the cap
    calls, seconds = _timed(OPEN + f'{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}' + CLOSE
                            + OPEN + "[" * 100_000 + CLOSE)
    assert seconds < BOUND_S
    assert calls[0].error is None and calls[0].arguments == {"expression": expression}
    assert "not valid JSON" in calls[1].error and len(calls) == 2


def test_text_past_the_cap_is_not_read_and_the_model_is_told():
    call = OPEN + '{"name": "calculator", "arguments": {"expression": "1+1"}}' + CLOSE
    # A call past the cap is not run: the parser never reads that far.
    text = call + "x" * MAX_PARSED_CHARS + call
    calls, seconds = _timed(text)
    assert seconds < BOUND_S
    assert [c.error for c in calls[:1]] == [None] and len(calls) == 2
    assert f"{len(text)} characters" in calls[1].error and f"first {MAX_PARSED_CHARS}" in calls[1].error
    # Ten million characters of open tags: the first MAX_PARSED_CHARS hold one unclosed call.
    calls, seconds = _timed(OPEN * 1_000_000)
    assert seconds < BOUND_S
    assert len(calls) == 2 and NEVER_CLOSED in calls[0].error and f"first {MAX_PARSED_CHARS}" in calls[1].error


def test_the_cap_is_a_parameter():
    calls = parse_tool_calls("```python\nprint(1)\n``` and then " + "y" * 100, code_blocks=True, max_chars=30)
    assert [(c.name, c.arguments.get("code")) for c in calls[:1]] == [("python", "print(1)\n")]
    assert len(calls) == 2 and "first 30 characters" in calls[1].error
    assert parse_tool_calls("x" * 30, max_chars=30) == []  # exactly at the cap: all of it is read
