"""Math final-answer reward: extract the answer, compare numerically and symbolically.

Extraction order: the last ``\\boxed{...}`` (balanced braces; ``\\fbox`` too), else
a "final answer" phrase (``final answer is X``, ``answer: X``, ``#### X``). No
answer found -> unparsable. Comparison: exact string match after normalising
LaTeX, else numeric match (relative tolerance), else symbolic equivalence with
sympy (``simplify(a - b) == 0``). When the optional ``math-verify`` package is
installed it is tried first for the symbolic step.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Mapping, Sequence

import sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

from jaxrl.reward.base import RewardResult

try:  # Optional: HF's math-verify handles far more LaTeX than the normaliser below.
    import math_verify
except ImportError:
    math_verify = None

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FINAL = [
    re.compile(r"final answer\s*(?:is|:)?\s*[:=]?\s*(.+?)\s*(?:\.\s*$|$|\n)", re.IGNORECASE),
    re.compile(r"answer\s*(?:is|:)\s*(.+?)\s*(?:\.\s*$|$|\n)", re.IGNORECASE),
    re.compile(r"####\s*(.+?)\s*$", re.MULTILINE),
]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last \\boxed{}, else a final-answer phrase, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in _FINAL:
        matches = pattern.findall(text)
        if matches:
            answer = matches[-1].strip().strip("$").strip()
            if answer:
                return answer
    return None


def _latex_group(text: str, start: int) -> tuple[str, int]:
    """The {...} group starting at ``text[start] == '{'``: (content, index after it)."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i], i + 1
    raise ValueError(f"unbalanced braces in {text!r}")


def normalize_answer(text: str) -> str:
    """LaTeX-ish answer -> a plain expression string sympy can parse (best effort)."""
    s = text.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^}]*\}", "", s)
    for cmd in (r"\left", r"\right", r"\!", r"\,", r"\;", r"\displaystyle", "$"):
        s = s.replace(cmd, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    while r"\frac" in s:
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


_TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor)


def _to_sympy(text: str):
    return parse_expr(text, transformations=_TRANSFORMS, evaluate=True)


def _as_number(text: str) -> float | None:
    try:
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
    """True when two answers agree: normalised strings, numbers, or symbolic equivalence."""
    a, b = normalize_answer(predicted), normalize_answer(reference)
    if not a:
        return False
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return abs(x - y) <= rel_tol * max(1.0, abs(y))
    if math_verify is not None:
        try:
            if math_verify.verify(math_verify.parse(f"${reference}$"), math_verify.parse(f"${predicted}$")):
                return True
        except Exception:  # noqa: BLE001 - fall back to sympy.
            pass
    try:
        ea, eb = _to_sympy(a), _to_sympy(b)
        difference = sympy.simplify(ea - eb)
        if difference == 0:
            return True
        value = complex(difference.evalf())
        return abs(value) <= rel_tol * max(1.0, abs(complex(eb.evalf())))
    except Exception:  # noqa: BLE001 - unparsable expressions simply do not match.
        return False


class MathAnswerReward:
    """1.0 when the response's final answer equals ``row[answer_field]``, else 0.0.

    No extractable answer -> ``unparsable=True`` (score 0). A row without the answer
    field raises (the router reports it with the sample).
    """

    def __init__(self, answer_field: str = "answer", rel_tol: float = 1e-6):
        self.answer_field = answer_field
        self.rel_tol = rel_tol

    def __call__(self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult:
        if self.answer_field not in row:
            raise KeyError(f"row has no reference answer field {self.answer_field!r}; fields: {sorted(row)}")
        predicted = extract_answer(response)
        if predicted is None:
            return RewardResult(score=0.0, unparsable=True)
        ok = answers_match(predicted, str(row[self.answer_field]), self.rel_tol)
        return RewardResult(score=1.0 if ok else 0.0)
