"""The two math answer checkers on a table of hard equivalences (docs/evaluation.md#math-answer-checking).

Each row states what each checker answers today, including where one of them is wrong, so a
change in either shows up here rather than silently in training rewards."""

import builtins

import pytest

from jaxrl.reward import MathAnswerReward
from jaxrl.reward.math import check_answer

# (predicted, reference, math_verify checker, normaliser alone)
TABLE = [
    (r"\frac{1}{2}", "0.5", True, True),
    (r"\dfrac{1}{2}", r"\frac12", True, True),
    ("3/4", "0.75", True, True),
    ("0.333", "1/3", False, False),
    (r"\left(1,2\right)", "(1,2)", True, True),
    ("[0,1)", "[0, 1)", True, True),
    ("[0,1)", "(0,1]", False, False),
    (r"(-\infty, 2]", r"(-\infty,2]", True, True),
    (r"\{1,2\}", r"\{2,1\}", True, False),  # sets: the normaliser compares strings only
    (r"5\text{ cm}", "5", True, True),
    ("5 cm", "5", True, False),  # a bare unit: the normaliser reads "5cm" as 5*c*m
    (r"50\%", "50", True, True),
    (r"50\%", "0.5", True, False),  # the normaliser drops "%", so 50% is 50
    (r"2\sqrt{2}", r"\sqrt{8}", True, True),
    (r"\frac{\sqrt{3}}{2}", r"\sin(\pi/3)", True, True),
    ("x=3", "3", True, False),  # an equation: math-verify takes its right-hand side
    (r"\pi", "3.14159", False, True),  # math-verify reads both and says no, so the fallback is not asked
    ("x^2+2x+1", "(x+1)^2", True, True),
    ("1,000", "1000", True, True),
    ("abc", "1", False, False),
]


@pytest.mark.parametrize("predicted, reference, math_verify, normalizer", TABLE,
                         ids=[f"{p} vs {r}" for p, r, _, _ in TABLE])
def test_hard_equivalences(predicted, reference, math_verify, normalizer):
    assert check_answer(predicted, reference, checker="math_verify") is math_verify
    assert check_answer(predicted, reference, checker="normalizer") is normalizer


def test_reward_uses_the_configured_checker():
    row = {"answer": "0.5"}
    assert MathAnswerReward(checker="math_verify")("p", r"\boxed{50\%}", [], row).score == 1.0
    assert MathAnswerReward()("p", r"\boxed{50\%}", [], row).score == 0.0  # the default: the normaliser


def test_math_verify_reaches_eval(monkeypatch):
    """Why math-verify is opt-in: reading a plain ``1`` it hands text to Python's eval (through
    sympy's sympify), which the default normaliser never does (tests/reliability)."""
    seen = []
    real_eval = builtins.eval
    monkeypatch.setattr(builtins, "eval",
                        lambda source, *a, **k: seen.append(str(source)) or real_eval(source, *a, **k))
    check_answer("1", "2", checker="normalizer")
    assert seen == []
    check_answer("1", "2", checker="math_verify")
    assert seen
