"""Math final-answer reward: extract the answer, parse it without evaluating text, compare values.

Extraction (linear in the response): the last ``\\boxed{...}``/``\\fbox{...}``, else a
"final answer" phrase (``final answer is X``, ``answer: X``, ``#### X``); none -> unparsable.
Comparison (:func:`check_answer`): by default (``checker="normalizer"``) :func:`grade_answer`:
raw strings, strings after normalising LaTeX (``\\frac``, ``\\sqrt``, braces, ``1,000``,
``%``...), then values. ``checker="math_verify"`` (opt-in) asks HF's math-verify first, LaTeX
extraction only (``jaxrl.reward.latex_verify``), and falls back to :func:`grade_answer` where it
cannot read an answer; it is not the default because it reaches Python's ``eval``
(docs/evaluation.md#math-answer-checking). Both checkers see only answers within the parser's
limits.

Parsing: ``jaxrl.reward.math_parser`` reads answers with a whitelisting parser that never
evaluates text, under size limits (an answer over a limit is unparsable, never a hang).

Values: equal trees match; otherwise mpmath computes both to ``NUMERIC_DIGITS`` digits and
compares them with a relative tolerance, with symbols at ``SAMPLE_POINTS`` fixed
pseudo-random points (|x| in [0.5, 2], either sign, so ``sqrt(x^2)`` is not ``x``): every
point where either side is finite must agree, and ``MIN_AGREEING_POINTS`` must be finite
on both. ``sympy.simplify`` is not used: its running time has no bound, even on small trees.
"""

from __future__ import annotations

import random
import re
from typing import Mapping, Sequence

import mpmath
import sympy

from jaxrl.reward.base import RewardResult
from jaxrl.reward.math_parser import AnswerTooLarge, NotMath, parse_answer

MAX_ANSWER_CHARS = 512
NUMERIC_DIGITS = 30
SAMPLE_POINTS = 6
MIN_AGREEING_POINTS = 3


# --- extraction -------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# (pattern, strip a final "." on the last line). Each captures the rest of the line with
# [^\n]* and trims it in Python: the old lazy ``(.+?)\s*(?:...)`` form backtracked
# quadratically over long runs of spaces (seconds for 20k characters).
_FINAL = [
    (re.compile(r"final answer\s*(?:is|:)?\s*[:=]?\s*([^\n]*)", re.IGNORECASE), True),
    (re.compile(r"answer\s*(?:is|:)\s*([^\n]*)", re.IGNORECASE), True),
    (re.compile(r"####\s*([^\n]*)"), False),
]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None.

    Scans from the last opening backwards. When a later box is unclosed, an earlier one
    can only close before that later box starts (past it, its depth is higher by >= 1),
    so each scan stops there and the whole search is linear in ``len(text)``.
    """
    starts = [m.end() for m in _BOXED.finditer(text)]
    stop = len(text)
    for start in reversed(starts):
        depth = 1
        for i in range(start, stop):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        stop = start
    return None


_ONLY_SPACE_LEFT = re.compile(r"\s*\Z")


def _trim_phrase(match: re.Match, text: str, strip_final_dot: bool) -> str:
    answer = match.group(1).rstrip()
    # "The final answer is 17." -> 17, only at the end of the text (a match, not a slice of
    # the rest: that would copy the text once per phrase, quadratic over many phrases).
    if strip_final_dot and answer.endswith(".") and _ONLY_SPACE_LEFT.match(text, match.end(1)):
        answer = answer[:-1]
    return answer.strip().strip("$").strip()


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last \\boxed{}, else a final-answer phrase, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for pattern, strip_final_dot in _FINAL:
        answers = [a for m in pattern.finditer(text) if (a := _trim_phrase(m, text, strip_final_dot))]
        if answers:
            return answers[-1]
    return None


# --- normalisation ----------------------------------------------------------------------

def _latex_group(text: str, start: int) -> tuple[str, int]:
    """The {...} group starting at ``text[start] == '{'``: (content, index after it)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    raise ValueError(f"unbalanced braces in {text!r}")


def normalize_answer(text: str) -> str:
    """LaTeX-ish answer -> a plain expression string (best effort). Quadratic: cap the input first."""
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^}]*\}", "", s)
    for cmd in (r"\left", r"\right", r"\!", r"\,", r"\;", r"\displaystyle", "$"):
        s = s.replace(cmd, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    while r"\frac" in s:  # each pass removes one backslash, so this ends
        i = s.index(r"\frac")
        j = i + len(r"\frac")
        while j < len(s) and s[j] == " ":
            j += 1
        if j < len(s) and s[j] == "{":
            num, j = _latex_group(s, j)
            den, j = _latex_group(s, j) if j < len(s) and s[j] == "{" else (s[j : j + 1], j + 1)
        else:  # \frac12
            num, den, j = s[j : j + 1], s[j + 1 : j + 2], j + 2
        s = f"{s[:i]}(({num})/({den})){s[j:]}"
    while r"\sqrt" in s:
        i = s.index(r"\sqrt")
        j = i + len(r"\sqrt")
        if j < len(s) and s[j] == "{":
            body, j = _latex_group(s, j)
        else:
            body, j = s[j : j + 1], j + 1
        s = f"{s[:i]}sqrt({body}){s[j:]}"
    s = s.replace(r"\cdot", "*").replace(r"\times", "*").replace(r"\div", "/").replace(r"\pi", "pi")
    s = s.replace("{", "(").replace("}", ")").replace("^", "**").replace("\\", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # 1,000 -> 1000
    s = s.rstrip(".").strip()
    if s.endswith("%"):
        s = s[:-1]
    return s.replace(" ", "")


# --- comparison -------------------------------------------------------------------------

_MPMATH_FUNCTIONS = {
    getattr(sympy, name): getattr(mpmath, name)
    for name in ("sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
                 "exp", "log", "factorial")
}
_MPMATH_FUNCTIONS[sympy.Abs] = abs
_MPMATH_CONSTANTS = {sympy.pi: mpmath.pi, sympy.E: mpmath.e, sympy.I: mpmath.j}


def _numeric(expr: sympy.Expr, point: Mapping) -> mpmath.mpc:
    """expr's value with mpmath, symbols taken from point: our own walk over the node types the
    parser builds, so no sympy evaluation (and its assumption queries) ever runs."""
    if expr.is_Symbol:
        return point[expr]
    if expr.is_Rational:
        return mpmath.mpf(expr.p) / expr.q
    if expr in _MPMATH_CONSTANTS:
        return +_MPMATH_CONSTANTS[expr]  # unary + rounds to the working precision
    args = [_numeric(arg, point) for arg in expr.args]
    if expr.is_Add:
        return mpmath.fsum(args)
    if expr.is_Mul:
        return mpmath.fprod(args)
    if expr.is_Pow:
        return mpmath.power(*args)
    if expr.func in _MPMATH_FUNCTIONS:
        return _MPMATH_FUNCTIONS[expr.func](*args)
    raise NotMath(f"no numeric value for {expr.func.__name__}")  # infinity


def _evaluate(expr: sympy.Expr, point: Mapping) -> mpmath.mpc | None:
    """expr at point to NUMERIC_DIGITS digits, or None where it is not a finite number."""
    try:
        with mpmath.workdps(NUMERIC_DIGITS):
            value = mpmath.mpmathify(_numeric(expr, point))
    except Exception:  # noqa: BLE001 - 1/0, a pole, no convergence...: no value, so no match, never a crash
        return None
    return value if mpmath.isfinite(value) else None


def _close(a: mpmath.mpc, b: mpmath.mpc, rel_tol: float) -> bool:
    return abs(a - b) <= rel_tol * max(1, abs(b))


def _values_match(a: sympy.Expr, b: sympy.Expr, rel_tol: float) -> bool:
    if a == b:  # also oo == oo, which has no numeric value
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    if not symbols:
        va, vb = _evaluate(a, {}), _evaluate(b, {})
        return va is not None and vb is not None and _close(va, vb, rel_tol)
    rng = random.Random(0)  # fixed points: the same answers always get the same score
    agreeing = 0
    for _ in range(SAMPLE_POINTS):
        point = {s: mpmath.mpf(rng.choice((-1, 1)) * rng.uniform(0.5, 2.0)) for s in symbols}
        va, vb = _evaluate(a, point), _evaluate(b, point)
        if va is None and vb is None:
            continue  # a pole or branch cut both sides share
        if va is None or vb is None or not _close(va, vb, rel_tol):
            return False
        agreeing += 1
    return agreeing >= MIN_AGREEING_POINTS


def grade_answer(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
    """True when two answers agree: strings, normalised strings, or values.

    Raises AnswerTooLarge when either answer exceeds a limit. Text that is not math
    (in either answer) does not match.
    """
    predicted, reference = predicted.strip(), reference.strip()
    if not predicted:
        return False
    if predicted == reference:
        return True
    for text in (predicted, reference):
        if len(text) > MAX_ANSWER_CHARS:
            raise AnswerTooLarge(f"answer of {len(text)} characters (limit {MAX_ANSWER_CHARS})")
    try:
        a, b = normalize_answer(predicted), normalize_answer(reference)
    except ValueError:  # unbalanced braces
        return False
    if not a:
        return False
    if a == b:
        return True
    try:
        return _values_match(parse_answer(a), parse_answer(b), rel_tol)
    except NotMath:
        return False


def _check_limits(text: str) -> None:
    """AnswerTooLarge when ``text`` is over the parser's limits (``jaxrl.reward.math_parser``): checked
    before math-verify sees it, whose sympy trees have no size bound of their own."""
    if len(text) > MAX_ANSWER_CHARS:
        raise AnswerTooLarge(f"answer of {len(text)} characters (limit {MAX_ANSWER_CHARS})")
    try:
        parse_answer(normalize_answer(text))
    except (NotMath, ValueError):  # not our grammar (an interval, a set...): math-verify may still read it
        pass


def check_answer(predicted: str, reference: str, rel_tol: float = 1e-6, checker: str = "normalizer") -> bool:
    """True when two final answers agree. ``checker="math_verify"``: math-verify's verdict when it
    reads both answers, else :func:`grade_answer`'s (the fallback); ``"normalizer"``:
    :func:`grade_answer` only. Raises AnswerTooLarge when either answer exceeds a limit."""
    predicted, reference = predicted.strip(), reference.strip()
    if checker == "math_verify" and predicted and predicted != reference:
        _check_limits(predicted)
        _check_limits(reference)
        from jaxrl.reward.latex_verify import latex_answers_match  # imported only by tasks that choose it

        verdict = latex_answers_match(predicted, reference)
        if verdict is not None:
            return verdict
    return grade_answer(predicted, reference, rel_tol)


def answers_match(predicted: str, reference: str, rel_tol: float = 1e-6, checker: str = "normalizer") -> bool:
    """``check_answer`` where an answer over the limits simply does not match."""
    try:
        return check_answer(predicted, reference, rel_tol, checker)
    except AnswerTooLarge:
        return False


class MathAnswerReward:
    """1.0 when the response's final answer equals ``row[answer_field]``, else 0.0.

    No extractable answer, or an answer (or reference) over the size limits ->
    ``unparsable=True`` (score 0). Text that is not math is a wrong answer (score 0,
    parsable). A row without the answer field raises (the router reports it with the sample).
    """

    def __init__(self, answer_field: str = "answer", rel_tol: float = 1e-6, checker: str = "normalizer"):
        self.answer_field = answer_field
        self.rel_tol = rel_tol
        self.checker = checker

    def __call__(self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult:
        if self.answer_field not in row:
            raise KeyError(f"row has no reference answer field {self.answer_field!r}; fields: {sorted(row)}")
        predicted = extract_answer(response)
        if predicted is None:
            return RewardResult(score=0.0, unparsable=True)
        try:
            ok = check_answer(predicted, str(row[self.answer_field]), self.rel_tol, self.checker)
        except AnswerTooLarge:
            return RewardResult(score=0.0, unparsable=True)
        return RewardResult(score=1.0 if ok else 0.0)
