"""Format checks: a response passes when it matches a regex and contains required phrases.

Used alone (an instruction-following task) or inside ``jaxrl.reward.build_reward`` as a
gate. A format reward never marks a sample unparsable: failing the format is
itself the gradable outcome.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from jaxrl.reward.base import RewardResult


class FormatReward:
    """1.0 when ``pattern`` (if any) matches (re.search, DOTALL) and every required phrase occurs."""

    def __init__(self, pattern: str | None = None, required_phrases: Sequence[str] = ()):
        if pattern is None and not required_phrases:
            raise ValueError("FormatReward needs a pattern or at least one required phrase; both are empty")
        try:
            self.pattern = re.compile(pattern, re.DOTALL) if pattern is not None else None
        except re.error as e:
            raise ValueError(f"FormatReward pattern {pattern!r} is not a valid regex: {e}") from e
        self.required_phrases = tuple(required_phrases)

    def passes(self, response: str) -> bool:
        if self.pattern is not None and self.pattern.search(response) is None:
            return False
        return all(phrase in response for phrase in self.required_phrases)

    def __call__(self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult:
        return RewardResult(score=1.0 if self.passes(response) else 0.0)
