"""Self-verification in evaluation (DeepSeekMath-V2, https://arxiv.org/abs/2511.22570): the model
grades, and then refines, its own samples.

With ``eval.self_verify`` set, ``jaxrl eval`` asks the evaluated model to verify each of its
samples: the sample is put in a verification rubric (``template``, a built-in of
``jaxrl.reward.judge.JUDGE_TEMPLATES`` or a file, slots ``{problem}`` and ``{proof}``) and the
model writes ``samples`` analyses of it, each ending in a score 0, 0.5 or 1 in ``\\boxed{}``
(``parse_judge_score``). A sample's self-score is the mean of its analyses' readable scores (none
readable: no self-score); ``jaxrl.evaluation.core`` turns the self-scores into Best@n and the
verifier's accuracy.

With ``refine_rounds`` k > 0, the paper's sequential refinement follows: in each round, every
sample the model has not verified as correct (self-score below 1, or none) is rewritten by the
model from the refinement prompt (``refine_template``: the problem, the sample, and its most
critical analysis, the one with the lowest readable score), the rewrite is scored by the task's
reward, verified again, and replaces the sample; ``jaxrl.evaluation.core`` reports pass@1 after
each round (round 0: the samples as drawn) from the rewards. Every generation is one model turn with the
evaluation's sampling settings.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxrl.data.pipeline import Example
from jaxrl.reward.base import RewardRouter
from jaxrl.reward.judge import JUDGE_TEMPLATES, load_template, parse_judge_score, render
from jaxrl.rollout.base import RolloutEngine, Sample, SamplingParams

# The refinement prompt, in our words after the paper's idea (the generator revises its proof from
# the issues its verification found). Slots: {problem}, {proof}, {analysis}.
REFINE_TEMPLATES = {"refinement": """\
Below are a problem, your earlier solution to it, and an evaluation of that solution. Write an improved \
solution: fix every issue the evaluation rightly points out, keep what is correct, and make each step \
rigorous. Where the evaluation is wrong about a step, keep the step and justify it more clearly. Give \
the complete solution, not a list of changes.

## Problem
{problem}

## Earlier solution
{proof}

## Evaluation
{analysis}"""}


@dataclasses.dataclass(frozen=True)
class SelfVerifyConfig:
    """``eval.self_verify``: template, the verification rubric (a ``JUDGE_TEMPLATES`` name or a text
    file with ``{problem}`` and ``{proof}`` slots); samples, analyses per sample (their readable
    scores are averaged); problem_field, the row field with the problem (None: the prompt);
    refine_rounds, rounds of self-refinement (0: none); refine_template, the refinement prompt (a
    ``REFINE_TEMPLATES`` name or a file with ``{problem}``, ``{proof}`` and ``{analysis}`` slots)."""

    template: str = "proof_verification"
    samples: int = 1
    problem_field: str | None = None
    refine_rounds: int = 0
    refine_template: str = "refinement"

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"eval.self_verify.samples={self.samples} must be >= 1")
        if self.refine_rounds < 0:
            raise ValueError(f"eval.self_verify.refine_rounds={self.refine_rounds} must be >= 0 (0: no refinement)")
        for key, slots in (("template", ("{proof}",)), ("refine_template", ("{proof}", "{analysis}"))):
            text = self.text(key)
            if missing := [slot for slot in slots if slot not in text]:
                raise ValueError(f"eval.self_verify.{key}={getattr(self, key)!r} has no {' or '.join(missing)} slot; "
                                 f"the model would never see what it works on")

    def text(self, key: str) -> str:
        """The text of template ``key`` (``template`` or ``refine_template``)."""
        builtins = REFINE_TEMPLATES if key == "refine_template" else JUDGE_TEMPLATES
        return load_template(getattr(self, key), f"eval.self_verify.{key}", builtins)


@dataclasses.dataclass(frozen=True)
class SelfVerifier:
    """How ``jaxrl eval`` has the model verify and refine its samples: the ``config``, and ``encode``,
    prompt text -> token ids (the data section's chat template and system prompt)."""

    config: SelfVerifyConfig
    encode: Callable[[str], list[int]]

    def run(self, engine: RolloutEngine, router: RewardRouter, tokenizer, examples: Sequence[Example],
            samples: Sequence[Sequence[Sample]], rewards: np.ndarray, params: SamplingParams,
            on_error: Callable[[str], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """For sample ``samples[i][j]`` of ``examples[i]``, whose reward is ``rewards[i, j]``: its
        self-score (``[prompts, n]``, NaN: none readable), and its reward after each round of
        refinement (``[refine_rounds + 1, prompts * n]``, row 0 ``rewards``)."""
        flat = [e for e, group in zip(examples, samples, strict=True) for _ in group]
        proofs = [_text(tokenizer, s) for group in samples for s in group]
        scores, analyses = self._verify(engine, tokenizer, flat, proofs, params)
        # The self-scores of the samples as drawn (a copy: refinement overwrites ``scores``).
        first, rounds = scores.reshape(len(examples), -1).copy(), [np.asarray(rewards, np.float64).reshape(-1)]
        refine = self.config.text("refine_template")
        for _ in range(self.config.refine_rounds):
            todo = [i for i, score in enumerate(scores) if not score == 1.0]  # NaN included
            now = rounds[-1].copy()
            if todo:
                prompts = [self.encode(render(refine, problem=self._problem(flat[i]), proof=proofs[i],
                                              analysis=analyses[i])) for i in todo]
                rewrites = [group[0] for group in engine.generate(prompts, params, n=1)]
                texts = [_text(tokenizer, s) for s in rewrites]
                scored = router.score([flat[i].prompt for i in todo], texts, [s.model_ids.tolist() for s in rewrites],
                                      [flat[i].row for i in todo], on_error=on_error)
                now[todo] = scored.scores
                new_scores, new_analyses = self._verify(engine, tokenizer, [flat[i] for i in todo], texts, params)
                for k, i in enumerate(todo):
                    proofs[i], scores[i], analyses[i] = texts[k], new_scores[k], new_analyses[k]
            rounds.append(now)
        return first, np.stack(rounds)

    def _problem(self, example: Example) -> str:
        field = self.config.problem_field
        return example.prompt if field is None else str(example.row[field])

    def _verify(self, engine: RolloutEngine, tokenizer, examples: Sequence[Example], proofs: Sequence[str],
                params: SamplingParams) -> tuple[np.ndarray, list[str]]:
        """Each proof's self-score (NaN: none readable; a fresh array) and its most critical analysis
        (the lowest readable score, the first of equals; the first analysis when none is readable)."""
        template = self.config.text("template")
        prompts = [self.encode(render(template, problem=self._problem(e), proof=p))
                   for e, p in zip(examples, proofs, strict=True)]
        scores, critical = np.full(len(prompts), np.nan), []
        for i, group in enumerate(engine.generate(prompts, params, n=self.config.samples)):
            texts = [_text(tokenizer, s) for s in group]
            graded = [(score, text) for text in texts if (score := parse_judge_score(text)) is not None]
            if graded:
                scores[i] = np.mean([score for score, _ in graded])
            critical.append(min(graded, key=lambda g: g[0])[1] if graded else texts[0])
        return scores, critical


def _text(tokenizer, sample: Sample) -> str:
    """The model's tokens of ``sample`` as text, decoded as the reward reads them."""
    return tokenizer.decode(sample.model_ids, skip_special_tokens=True)
