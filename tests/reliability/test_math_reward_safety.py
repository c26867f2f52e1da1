"""The math reward never executes text from a response or a dataset row, and never hangs.

Model outputs and dataset answers are untrusted: these tests feed both with code-execution
attempts, with answers built to make sympy compute forever, and with responses built to make
the extraction scans quadratic. Each test's docstring says what happened before the fix.
"""

import builtins
import time

import pytest

import jaxrl.reward.math as math_reward
import jaxrl.reward.math_parser as math_parser
from jaxrl.reward import MathAnswerReward, RewardResult, answers_match, extract_answer

# A loaded CI machine is slow; each of these returns in milliseconds on an idle one.
FAST_S = 2.0

CODE_PAYLOADS = [
    "__import__('pathlib').Path('{target}').touch()",
    "eval(\"__import__('pathlib').Path('{target}').touch()\")",
    "exec(\"open('{target}','w').close()\")",
    "(lambda: __import__('pathlib').Path('{target}').touch())()",
    "lambda: open('{target}', 'w')",
    "open('{target}', 'w')",
    "getattr(__builtins__, 'open')('{target}', 'w')",
    "().__class__.__bases__[0].__subclasses__()",
    "eval('1')",
    "__import__('os').system('touch {target}')",
]


def _score(response: str, answer: str) -> RewardResult:
    return MathAnswerReward()("prompt", response, [], {"answer": answer})


@pytest.fixture
def recorded_eval_exec(monkeypatch):
    """Every source string passed to eval/exec while the test runs (run through unchanged)."""
    seen = []
    real_eval, real_exec = builtins.eval, builtins.exec

    def recording_eval(source, *args, **kwargs):
        seen.append(str(source))
        return real_eval(source, *args, **kwargs)

    def recording_exec(source, *args, **kwargs):
        seen.append(str(source))
        return real_exec(source, *args, **kwargs)

    monkeypatch.setattr(builtins, "eval", recording_eval)
    monkeypatch.setattr(builtins, "exec", recording_exec)
    return seen


@pytest.mark.parametrize("payload", CODE_PAYLOADS)
def test_model_answer_is_never_executed(payload, tmp_path, recorded_eval_exec):
    """Before: parse_expr evaluated Python, so ``\\boxed{__import__('pathlib').Path(X).touch()}``
    in a response created the file X on the trainer's host (and the eval(...) form did too)."""
    target = tmp_path / "pwned"
    response = "Reasoning... so the answer is \\boxed{%s}" % payload.format(target=target)
    assert _score(response, "1") == RewardResult(score=0.0, unparsable=False)  # not math: a wrong answer
    assert not target.exists()
    assert recorded_eval_exec == []


@pytest.mark.parametrize("payload", CODE_PAYLOADS)
def test_dataset_answer_is_never_executed(payload, tmp_path, recorded_eval_exec):
    """Before: the reference answer went through the same parse_expr, so a poisoned dataset row
    ran its ``answer`` field as Python on the host for every sample scored against it."""
    target = tmp_path / "pwned"
    reference = payload.format(target=target)
    assert _score(r"\boxed{1}", reference).score == 0.0
    assert _score("The final answer is 1.", reference).score == 0.0
    assert answers_match("1", reference) is False
    assert not target.exists()
    assert recorded_eval_exec == []


def test_module_has_no_evaluating_parser():
    """Before: the module imported sympy's parse_expr and, when installed, math_verify (whose
    parsing we cannot vouch for). Neither may come back."""
    for module in (math_reward, math_parser):
        assert "parse_expr" not in vars(module)
        assert "math_verify" not in vars(module)


def _timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


@pytest.mark.parametrize(
    "response",
    [
        r"\boxed{9^9^9^9}",
        r"\boxed{10^{10^{10}}}",
        r"\boxed{2^{10^{100}}}",
        r"\boxed{x^{10^{9}}}",
        r"\boxed{1e100000}",
        r"\boxed{(1.000001)^{10^{9}}}",
        r"\boxed{e^{e^{e^{e^{10}}}}}",
        r"\boxed{" + "1" * 100_000 + "}",
        r"\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
        r"\boxed{" + "(" * 40 + "1" + ")" * 40 + "}",  # short, but too deep
        r"\boxed{" + "\\sin" * 40 + " x}",
        r"\boxed{" + "+".join(["x"] * 250) + "}",  # too many nodes
    ],
    ids=["9^9^9^9", "10^10^10", "2^10^100", "x^10^9", "1e100000", "1.000001^10^9", "exp-tower",
         "100k-chars", "5000-parens", "40-parens", "40-sins", "250-terms"],
)
def test_answer_over_the_limits_is_unparsable_and_fast(response):
    """Before: sympy evaluated ``9^9^9^9`` and ``10^{10^{10}}`` exactly, building an integer with
    hundreds of millions of digits: the reward hung (still running after 10 s) and only a
    timeout around it could stop it. Now the size bounds refuse such answers before any
    computation, and the sample is masked (unparsable) instead of scored as wrong."""
    result, seconds = _timed(_score, response, "1")
    assert result == RewardResult(score=0.0, unparsable=True)
    assert seconds < FAST_S, f"{seconds:.2f} s"


@pytest.mark.parametrize("reference", [r"9^9^9^9", r"10^{10^{10}}", "1" * 100_000])
def test_reference_over_the_limits_is_unparsable_and_fast(reference):
    """Before: a dataset answer like ``9^9^9^9`` hung every sample scored against it. Now it
    cannot be graded safely, so the sample is masked."""
    result, seconds = _timed(_score, r"\boxed{1}", reference)
    assert result == RewardResult(score=0.0, unparsable=True)
    assert seconds < FAST_S, f"{seconds:.2f} s"
    assert _score("\\boxed{%s}" % reference, reference).score == 1.0  # the same text still matches


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{" * 20_000,  # unclosed boxes
        "answer: x" + " " * 100_000 + "y",
        "final answer" + " " * 100_000 + "x",
        "answer is 7.\n" * 50_000,
    ],
    ids=["20k-unclosed-boxes", "spaces-after-answer", "spaces-after-final-answer", "50k-phrases"],
)
def test_extraction_is_linear(response):
    """Before: the last-box scan restarted at every ``\\boxed{`` (35 000 unclosed ones: 7.7 s) and
    the final-answer regex backtracked quadratically over spaces (10 000 spaces: 1.7 s)."""
    _, seconds = _timed(extract_answer, response)
    assert seconds < FAST_S, f"{seconds:.2f} s"
    _, seconds = _timed(_score, response, "7")
    assert seconds < FAST_S, f"{seconds:.2f} s"


@pytest.mark.parametrize(
    "predicted, reference",
    [
        (r"\frac{1}{2}", "0.5"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        (r"\frac{\sqrt{3}}{2}", r"\sin(\pi/3)"),
        ("x^2-1", "(x-1)(x+1)"),
        (r"\sin^2 x + \cos^2 x", "1"),
        (r"e^{i\pi}", "-1"),
        (r"\ln 8", r"3\ln 2"),
        ("2^{10}", "1024"),
        (r"2^{2023}", r"2 \cdot 2^{2022}"),
        (r"\frac{x^2+2x+1}{x+1}", "x+1"),
        (r"\dfrac{3}{4}\%", "0.75"),
        (r"\infty", r"\infty"),
        (r"\left(\frac{1}{3}\right)", "0.3333333"),
    ],
)
def test_closed_form_equivalences_still_match(predicted, reference):
    """Before: these went through parse_expr + sympy.simplify (and ``e^{i\\pi}``, ``\\ln 8`` did
    not match: ``e`` was a plain symbol, ``ln`` unknown). The safe parser and the bounded
    numeric comparison must keep them matching, fast."""
    result, seconds = _timed(_score, "\\boxed{%s}" % predicted, reference)
    assert result == RewardResult(score=1.0, unparsable=False)
    assert seconds < FAST_S


@pytest.mark.parametrize(
    "predicted, reference",
    [("x+1", "x-1"), (r"\sqrt{x^2}", "x"), (r"\frac{1}{0}", r"\frac{2}{0}"), ("41", "42"),
     ("2^{10}", "1025"), ("hello world!", "42")],
)
def test_different_answers_do_not_match(predicted, reference):
    """Numeric comparison at sample points must not turn different answers into matches; text
    that is not math is an ordinary wrong answer (scored, not masked)."""
    assert _score("\\boxed{%s}" % predicted, reference) == RewardResult(score=0.0, unparsable=False)
