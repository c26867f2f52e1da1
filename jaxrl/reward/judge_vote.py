"""Scaled verification (DeepSeekMath-V2, https://arxiv.org/abs/2511.22570): one judgement drawn n times, combined.

A judge sampled at a temperature above 0 may grade the same proof differently from one draw to
the next. ``judge.samples`` draws each judgement that many times (each draw with its own sampling
seed, ``draw_seed``) and ``judge.combine`` folds the draws' scores into one:

- ``majority``: the most frequent score; a tie goes to the lowest of the tied scores, so a split
  vote never rates a proof higher than half of its judges did;
- ``mean``: the mean of the scores (0, 0.5 or 1 each, so the mean may be 1/3, 0.75, ...);
- ``min``: the lowest score, as the paper's automated labelling takes the lowest score of a
  proof's analyses: one judge that finds a real flaw outweighs the ones that missed it.

A draw without a score (an unparsable reply, a failed request) is left out of the combination;
only a judgement none of whose draws scored is missing. ``Agreement`` measures how far the
draws of a batch's judgements agree (``judge/agreement_*`` metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
from typing import Literal, Sequence

Combine = Literal["majority", "mean", "min"]


def combine_scores(how: Combine, scores: Sequence[float | None]) -> float | None:
    """The draws' ``scores`` combined by ``how`` (module docstring), the None entries (draws
    without a score) left out; None when no draw scored."""
    valid = [s for s in scores if s is not None]
    if not valid:
        return None
    if how == "min":
        return min(valid)
    if how == "mean":
        return sum(valid) / len(valid)
    counts = collections.Counter(valid)
    most = max(counts.values())
    return min(score for score, count in counts.items() if count == most)


def draw_seed(key: str, attempt: int) -> int:
    """The sampling seed of try ``attempt`` of the draw whose cache key is ``key`` (the key names the
    judge, the prompt and the draw): a draw is sampled alike in every run, different draws and
    tries differently. A server applies it only with ``--enable-deterministic-inference`` (SGLang
    on GPUs; a CPU server samples unseeded)."""
    return int(hashlib.sha256(f"{key}\0try {attempt}".encode()).hexdigest()[:15], 16)


@dataclasses.dataclass
class Agreement:
    """How the draws of judgements agree, summed over the judgements ``add``-ed with two or more
    scored draws: ``judgements`` of them, ``unanimous`` whose scores are all equal, and
    ``pairwise`` the sum over judgements of the fraction of their pairs of draws that agree."""

    judgements: int = 0
    unanimous: int = 0
    pairwise: float = 0.0

    def add(self, scores: Sequence[float | None]) -> None:
        valid = [s for s in scores if s is not None]
        if len(valid) < 2:
            return
        pairs = list(itertools.combinations(valid, 2))
        self.judgements += 1
        self.unanimous += len(set(valid)) == 1
        self.pairwise += sum(a == b for a, b in pairs) / len(pairs)

    def metrics(self) -> dict[str, float]:
        """``judge/voted`` (judgements with two or more scored draws), and over them
        ``judge/agreement_unanimous`` and ``judge/agreement_pairwise``; only the first when none."""
        if not self.judgements:
            return {"judge/voted": 0.0}
        return {"judge/voted": float(self.judgements),
                "judge/agreement_unanimous": self.unanimous / self.judgements,
                "judge/agreement_pairwise": self.pairwise / self.judgements}
