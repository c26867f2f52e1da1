"""Evaluation and pass-rate filtering on the engine and reward path training uses
(docs/evaluation.md): ``jaxrl eval`` scores a model on held-out prompts, ``jaxrl filter``
keeps the prompts whose pass rate lies in a band."""

from jaxrl.evaluation.core import EvalResult, TaskScores, evaluate, pass_at_k, sample_and_score

__all__ = ["EvalResult", "TaskScores", "evaluate", "pass_at_k", "sample_and_score"]
