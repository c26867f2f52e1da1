"""Reward functions against hand-written answers; the router's error handling."""

import logging

import numpy as np
import pytest

from jaxrl.config import ConfigError, from_dict
from jaxrl.reward import (
    FormatReward, MathAnswerReward, RewardConfig, RewardResult, RewardRouter, build_router, answers_match,
    extract_answer, extract_boxed,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{x^{2}}} done", r"\sqrt{x^{2}}"),
        ("no box here", None),
        (r"\boxed{unclosed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The final answer is 17.", "17"),
        ("work...\nAnswer: 3/4", "3/4"),
        ("steps\n#### 1,234", "1,234"),
        (r"answer: 5 but \boxed{6}", "6"),
        ("I cannot tell", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "predicted, reference, same",
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("0.5", r"\frac{1}{2}", True),
        (r"\dfrac{3}{4}", "0.75", True),
        ("1,000", "1000", True),
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        ("x^2+2x+1", "(x+1)^2", True),
        (r"\pi/2", r"\frac{\pi}{2}", True),
        ("41", "42", False),
        ("x+1", "x-1", False),
        ("", "0", False),
        ("banana", "42", False),
    ],
)
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_math_reward_scores_and_unparsable():
    fn = MathAnswerReward()
    assert fn("q", r"\boxed{7}", [], {"answer": "7"}) == RewardResult(1.0, False)
    assert fn("q", r"\boxed{8}", [], {"answer": "7"}) == RewardResult(0.0, False)
    assert fn("q", "no idea", [], {"answer": "7"}) == RewardResult(0.0, True)


def test_format_reward():
    fn = FormatReward(pattern=r"^<think>.*</think>", required_phrases=("Answer:",))
    assert fn("", "<think>x</think> Answer: 1", [], {}).score == 1.0
    assert fn("", "<think>x</think> 1", [], {}).score == 0.0
    assert fn("", "Answer: 1", [], {}).score == 0.0
    with pytest.raises(ValueError, match="not a valid regex"):
        FormatReward(pattern="(")


def test_router_mixes_tasks_by_field():
    config = from_dict(
        RewardConfig,
        {"task_field": "task", "default_task": "math",
         "tasks": {"math": {"kind": "math"}, "ifeval": {"kind": "format", "required_phrases": ["Hello"]}}},
    )
    router = build_router(config)
    rows = [{"answer": "2"}, {"task": "ifeval"}, {"task": "math", "answer": "3"}, {"task": "ifeval"}]
    responses = [r"\boxed{2}", "Hello world", "no answer", "bye"]
    out = router.score(["p"] * 4, responses, [[]] * 4, rows)
    np.testing.assert_array_equal(out.scores, [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(out.unparsable, [False, False, True, False])
    assert out.tasks == ("math", "ifeval", "math", "ifeval")


def test_gated_math_reward_needs_format():
    router = build_router(from_dict(RewardConfig, {"tasks": {"math": {"kind": "math", "pattern": r"^\\boxed"}}}))
    out = router.score(["p", "p"], [r"\boxed{2}", r"it is \boxed{2}"], [[], []], [{"answer": "2"}] * 2)
    np.testing.assert_array_equal(out.scores, [1.0, 0.0])


def _exploding(prompt, response, response_ids, row):
    if "boom" in response:
        raise RuntimeError("reward bug")
    return RewardResult(1.0)


def test_raising_reward_is_reported_and_unparsable(caplog):
    router = RewardRouter({"t": _exploding}, default_task="t")
    seen = []
    with caplog.at_level(logging.WARNING):
        out = router.score(["p0", "p1", "p2"], ["ok", "boom now", "ok"], [[1], [2], [3]], [{}, {}, {}],
                           on_error=seen.append)
    np.testing.assert_array_equal(out.scores, [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(out.unparsable, [False, True, False])
    np.testing.assert_array_equal(out.raised, [False, True, False])
    assert len(seen) == 1 and "RuntimeError" in seen[0] and "boom now" in seen[0] and "sample 1" in seen[0]
    assert "boom now" in caplog.text


def test_python_reward_kind_and_unknown_task():
    config = from_dict(RewardConfig, {"default_task": "t",
                                      "tasks": {"t": {"kind": "python", "function": f"{__name__}:_exploding"}}})
    router = build_router(config)
    assert router.score(["p"], ["fine"], [[]], [{}]).scores[0] == 1.0
    with pytest.raises(ValueError, match="'other'.*known tasks"):
        router.score(["p"], ["x"], [[]], [{"task": "other"}])
    with pytest.raises(ConfigError, match="default_task"):
        from_dict(RewardConfig, {"default_task": "nope"})


def _not_finite(prompt, response, response_ids, row):
    return RewardResult(float("nan") if "nan" in response else 0.5)


def test_in_process_router_reports_non_finite_and_never_times_out():
    router = RewardRouter({"t": _not_finite}, default_task="t")
    seen = []
    out = router.score(["p", "p"], ["nan", "ok"], [[], []], [{}, {}], on_error=seen.append)
    np.testing.assert_array_equal(out.scores, [0.0, 0.5])
    np.testing.assert_array_equal(out.raised, [True, False])
    np.testing.assert_array_equal(out.timed_out, [False, False])
    assert len(seen) == 1 and "ValueError: reward is not finite: nan on sample 0" in seen[0]
    router.close()  # nothing to stop in-process; still safe


def test_build_router_runs_rewards_in_a_worker_with_the_configured_limit():
    from jaxrl.reward import SandboxedRewardRouter

    config = from_dict(RewardConfig, {"timeout_s": 2.5, "tasks": {"math": {"kind": "math", "answer_field": "sol"}}})
    with build_router(config) as router:
        assert isinstance(router, SandboxedRewardRouter) and router.timeout_s == 2.5
        assert router.answer_fields == {"math": "sol"}
        out = router.score(["p"], [r"\boxed{3}"], [[]], [{"sol": "3"}])
        assert out.scores[0] == 1.0 and not out.timed_out[0] and router.worker_pid is not None
    assert router.worker_pid is None
