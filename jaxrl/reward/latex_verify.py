"""HF's math-verify as the math reward's opt-in first checker (docs/evaluation.md#math-answer-checking).

Only its LaTeX extraction is used: the answer goes through latex2sympy's grammar, which builds
sympy trees without running text. Its plain-expression extraction (``ExprExtractionConfig``)
calls sympy's ``parse_expr``, which evaluates Python, so it stays off (the reason the
normaliser of ``jaxrl.reward.math_parser`` exists). Even so, latex2sympy hands number text to
sympy's ``sympify``, which runs ``eval`` (tests/reward/test_checkers.py shows it), so this
checker is opt-in (``checker: math_verify``) and the default stays the normaliser. Its timeouts are off too: they use
``signal.alarm``, which works in a main thread only; the reward worker process runs every call
under ``reward.timeout_s`` instead (``jaxrl.reward.sandbox``).
"""

from __future__ import annotations

import logging

from math_verify import LatexExtractionConfig, parse, verify

# The "timeout is disabled" notice: the sandbox's timeout is the one that applies.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_LATEX_ONLY = [LatexExtractionConfig()]


def _parsed(answer: str) -> list:
    return parse(f"${answer}$", extraction_config=_LATEX_ONLY, parsing_timeout=None)


def latex_answers_match(predicted: str, reference: str) -> bool | None:
    """math-verify's verdict on two extracted final answers, or None when it cannot read one of them."""
    gold, guess = _parsed(reference), _parsed(predicted)
    if not gold or not guess:
        return None
    return bool(verify(gold, guess, timeout_seconds=None))
