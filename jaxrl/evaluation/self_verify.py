"""Self-verification metrics (DeepSeekMath-V2, https://arxiv.org/abs/2511.22570): the model grades its own samples.

With ``eval.self_verify`` set, ``jaxrl eval`` asks the evaluated model to verify each of its
samples: the sample is put in a verification rubric (``template``, a built-in of
``jaxrl.reward.judge.JUDGE_TEMPLATES`` or a file, slots ``{problem}`` and ``{proof}``) and the
model writes ``samples`` analyses of it, each ending in a score 0, 0.5 or 1 in ``\\boxed{}``
(``parse_judge_score``). A sample's self-score is the mean of its analyses' readable scores (none
readable: no self-score). From the self-scores and the samples' correctness (their reward above
``jaxrl.evaluation.core.CORRECT_ABOVE``, as for pass@k):

- ``best@n``: per prompt, the sample with the highest self-score (the first of equals; samples
  without a self-score last) is picked and its correctness counted, averaged over prompts: the
  paper's Best@n selection by the model's own verification;
- ``verifier_accuracy``: over the samples with a self-score, how often the model's verdict
  (correct when the self-score is above ``VERIFIED_ABOVE``) matches the reward's; against ground truth where the
  task's reward checks a reference answer (``kind: math``, ``code``), against the judge for a
  judge kind;
- ``self_verified``: the fraction of samples that got a self-score.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxrl.reward.judge import load_template, parse_judge_score, render
from jaxrl.data.pipeline import Example
from jaxrl.rollout.base import RolloutEngine, Sample, SamplingParams

# The model's verdict is "correct" when its self-score exceeds this: 1 on the rubric's scale; 0.5
# (sound, with minor errors) does not pass, as a correct proof scores 1.
VERIFIED_ABOVE = 0.5


@dataclasses.dataclass(frozen=True)
class SelfVerifyConfig:
    """``eval.self_verify``: template, the verification rubric (a ``JUDGE_TEMPLATES`` name or a text
    file with ``{problem}`` and ``{proof}`` slots); samples, analyses per sample (their readable
    scores are averaged); problem_field, the row field with the problem (None: the prompt)."""

    template: str = "proof_verification"
    samples: int = 1
    problem_field: str | None = None

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"eval.self_verify.samples={self.samples} must be >= 1")
        if "{proof}" not in load_template(self.template, "eval.self_verify.template"):
            raise ValueError(f"eval.self_verify.template={self.template!r} has no {{proof}} slot; the model would "
                             f"never see the sample it verifies")


@dataclasses.dataclass(frozen=True)
class SelfVerifier:
    """How ``jaxrl eval`` asks the model to verify its samples: the ``config``, and ``encode``, verification
    prompt text -> token ids (the data section's chat template and system prompt)."""

    config: SelfVerifyConfig
    encode: Callable[[str], list[int]]

    def scores(self, engine: RolloutEngine, tokenizer, examples: Sequence[Example], samples: Sequence[Sequence[Sample]],
               params: SamplingParams) -> np.ndarray:
        """[prompts, n] float64: the self-score of sample ``samples[i][j]`` of ``examples[i]`` (decoded
        as the reward reads it), NaN where none of its analyses is readable; one engine call."""
        template = load_template(self.config.template, "eval.self_verify.template")
        field = self.config.problem_field
        prompts = [self.encode(render(template, problem=e.prompt if field is None else str(e.row[field]),
                                      proof=tokenizer.decode(s.model_ids, skip_special_tokens=True)))
                   for e, group in zip(examples, samples, strict=True) for s in group]
        analyses = engine.generate(prompts, params, n=self.config.samples)
        out = np.full(len(prompts), np.nan)
        for i, group in enumerate(analyses):
            found = [parse_judge_score(tokenizer.decode(s.model_ids, skip_special_tokens=True)) for s in group]
            found = [s for s in found if s is not None]
            if found:
                out[i] = np.mean(found)
        return out.reshape(len(examples), -1)


def best_at_n(self_scores: np.ndarray, correct: np.ndarray) -> float:
    """From ``[prompts, n]`` self-scores (NaN: none) and correctness: the mean correctness of the
    sample each prompt's highest self-score picks (the first of equals; NaN ranks last)."""
    picked = np.argmax(np.where(np.isnan(self_scores), -np.inf, self_scores), axis=1)
    return float(np.mean(correct[np.arange(len(correct)), picked]))


def verifier_accuracy(self_scores: np.ndarray, correct: np.ndarray) -> float | None:
    """How often the model's verdict (self-score above ``VERIFIED_ABOVE``) is the sample's
    correctness, over the samples with a self-score; None when no sample has one."""
    known = ~np.isnan(self_scores)
    if not known.any():
        return None
    return float(np.mean((self_scores[known] > VERIFIED_ABOVE) == correct[known]))
