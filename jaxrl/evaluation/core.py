"""Scoring a model the way papers report it (docs/evaluation.md#metrics).

``n`` samples per prompt from a rollout engine, each scored by the task's reward (the
same router as training). Per task and over all prompts:

- ``avg@n``: the mean reward over the ``n`` samples of a prompt, averaged over prompts
  (pass@1 averaged over the ``n`` samples when the reward is 0/1);
- ``pass@k`` for each configured ``k <= n``: the unbiased estimator of Chen et al. 2021,
  ``1 - C(n-c, k) / C(n, k)`` per prompt with ``c`` of its ``n`` samples correct
  (reward > ``CORRECT_ABOVE``), averaged over prompts;
- ``unparsable``: the fraction of samples the reward could not grade;
- with a ``SelfVerifier`` (``eval.self_verify``; the model verifies its own samples,
  ``jaxrl.evaluation.self_verify``): ``best@n``, per prompt the correctness of the sample with the
  highest self-score (the first of equals; samples without one last), averaged over prompts:
  DeepSeekMath-V2's Best@n selection; ``verifier_accuracy``, over the samples with a self-score,
  how often the model's verdict (self-score above ``VERIFIED_ABOVE``) is the sample's correctness:
  accuracy against ground truth where the task's reward checks a reference answer, agreement with
  the judge for a judge kind; ``self_verified``, the fraction of samples with a self-score; and,
  with ``refine_rounds``, pass@1 after each round of self-refinement (over all prompts).

The trainer's periodic held-out evaluation and ``jaxrl eval`` both call :func:`evaluate`;
``jaxrl filter`` calls :func:`sample_and_score`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Callable, Sequence

import numpy as np

from jaxrl.data.pipeline import Example
from jaxrl.evaluation.self_verify import SelfVerifier
from jaxrl.reward.base import RewardRouter, ScoredBatch
from jaxrl.rollout.base import RolloutEngine, Sample, SamplingParams

# A sample counts as correct for pass@k when its reward exceeds this (binary 0/1 rewards; the
# same rule as the pass@k advantages in jaxrl.losses.passk).
CORRECT_ABOVE = 0.5
# The model's own verdict is "correct" when its self-score exceeds this: 1 on the rubric's scale;
# 0.5 (sound, with minor errors) does not pass, as a correct proof scores 1.
VERIFIED_ABOVE = 0.5


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (Chen et al. 2021):
    the probability that a random ``k``-subset of the ``n`` samples holds a correct one."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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


@dataclasses.dataclass(frozen=True)
class TaskScores:
    """One task's (or all prompts') figures: ``prompts`` prompts, ``n`` samples each; the
    self-verification ones (``best_at_n``, ``verifier_accuracy``, ``self_verified``) None without it."""

    prompts: int
    n: int
    avg_at_n: float
    pass_at_k: dict[int, float]
    unparsable: float
    best_at_n: float | None = None
    verifier_accuracy: float | None = None
    self_verified: float | None = None

    @classmethod
    def of(cls, scores: np.ndarray, unparsable: np.ndarray, ks: Sequence[int],
           self_scores: np.ndarray | None = None) -> "TaskScores":
        """From ``[prompts, n]`` arrays of rewards and unparsable flags, and of self-scores (NaN: none)."""
        prompts, n = scores.shape
        correct = scores > CORRECT_ABOVE
        verified = {} if self_scores is None else {
            "best_at_n": best_at_n(self_scores, correct), "verifier_accuracy": verifier_accuracy(self_scores, correct),
            "self_verified": float(np.mean(~np.isnan(self_scores)))}
        return cls(prompts=prompts, n=n, avg_at_n=float(scores.mean(dtype=np.float64)),
                   pass_at_k={k: float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)])) for k in ks},
                   unparsable=float(unparsable.mean()), **verified)

    def verification(self) -> dict[str, float | None]:
        """The self-verification figures by their reported names; {} without them."""
        if self.self_verified is None:
            return {}
        return {f"best@{self.n}": self.best_at_n, "verifier_accuracy": self.verifier_accuracy,
                "self_verified": self.self_verified}


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Per-task and overall figures, with the sampling settings that produced them; with an
    environment (multi-turn prompts), its ``env/*`` metrics over the played conversations; with
    self-refinement, ``refinement``: pass@1 over all samples after each round (0: as drawn)."""

    tasks: dict[str, TaskScores]
    overall: TaskScores
    sampling: dict
    environment: dict = dataclasses.field(default_factory=dict)
    completions: tuple[dict, ...] = ()  # a few samples to read: prompt, response, reward, task
    refinement: tuple[float, ...] = ()

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat metrics for the trainer's log: ``PREFIX/reward`` (the overall avg@n),
        ``PREFIX/unparsable``, ``PREFIX/pass@K``, and per task ``PREFIX/TASK/...`` when there
        are several."""
        out = {}
        groups = [("", self.overall)] + ([(f"{t}/", s) for t, s in self.tasks.items()] if len(self.tasks) > 1 else [])
        for name, s in groups:
            out[f"{prefix}/{name}reward"] = s.avg_at_n
            out[f"{prefix}/{name}unparsable"] = s.unparsable
            out.update({f"{prefix}/{name}pass@{k}": v for k, v in s.pass_at_k.items()})
            out.update({f"{prefix}/{name}{k}": v for k, v in s.verification().items() if v is not None})
        return out

    def to_json(self) -> dict:
        def plain(s: TaskScores) -> dict:
            return {"prompts": s.prompts, "n": s.n, f"avg@{s.n}": s.avg_at_n, "unparsable": s.unparsable,
                    **{f"pass@{k}": v for k, v in s.pass_at_k.items()}, **s.verification()}

        return {"sampling": self.sampling, "overall": plain(self.overall),
                "tasks": {t: plain(s) for t, s in self.tasks.items()},
                **({"environment": self.environment} if self.environment else {}),
                **({"refinement": {"pass@1": list(self.refinement)}} if self.refinement else {}),
                **({"completions": list(self.completions)} if self.completions else {})}

    def table(self) -> str:
        """A plain-text table: one row per task and one for all prompts."""
        ks, verified = sorted(self.overall.pass_at_k), list(self.overall.verification())
        header = ["task", "prompts", f"avg@{self.overall.n}", *(f"pass@{k}" for k in ks), "unparsable", *verified]
        rows = [[t, str(s.prompts), f"{s.avg_at_n:.4f}", *(f"{s.pass_at_k[k]:.4f}" for k in ks),
                 f"{s.unparsable:.4f}", *("-" if v is None else f"{v:.4f}" for v in s.verification().values())]
                for t, s in [*sorted(self.tasks.items()), ("all", self.overall)]]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                 for r in [header, *rows]]
        settings = ", ".join(f"{k}={v}" for k, v in self.sampling.items())
        played = ", ".join(f"{k}={v:.4g}" for k, v in self.environment.items())
        refined = ", ".join(f"round {i}: {v:.4f}" for i, v in enumerate(self.refinement))
        return "\n".join([*lines, f"sampling: {settings}", *([f"environment: {played}"] if played else []),
                          *([f"self-refinement pass@1: {refined}"] if refined else [])])

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.write("\n")


def sampling_record(params: SamplingParams, n: int) -> dict:
    """What produced the samples, for the result files: the engine's settings and ``n``."""
    return {"n": n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens, "seed": params.seed}


# generate(examples, params, n) -> samples[prompt][n], e.g. multi-turn conversations with the rows'
# environments (jaxrl.trainer.stages.rollout.episodes.generate_conversations); None: one model turn per sample.
Generate = Callable[[Sequence[Example], SamplingParams, int], list[list[Sample]]]


def sample_and_score(engine: RolloutEngine, router: RewardRouter, tokenizer, examples: Sequence[Example],
                     params: SamplingParams, n: int, on_error: Callable[[str], None] | None = None,
                     generate: Generate | None = None) -> tuple[list, ScoredBatch]:
    """``n`` samples per prompt (``samples[i][j]``, from ``generate`` when given, else one engine
    call) and their rewards, flat in that order. The model's tokens are decoded without special
    tokens (a conversation's tool responses left out), as the trainer decodes them for its rewards."""
    if generate is None:
        samples = engine.generate([e.prompt_ids.tolist() for e in examples], params, n=n)
    else:
        samples = generate(examples, params, n)
    flat = [(e, s) for e, group in zip(examples, samples, strict=True) for s in group]
    responses = [tokenizer.decode(s.model_ids, skip_special_tokens=True) for _, s in flat]
    scored = router.score([e.prompt for e, _ in flat], responses, [s.model_ids.tolist() for _, s in flat],
                          [e.row for e, _ in flat], on_error=on_error)
    return samples, scored


def evaluate(engine: RolloutEngine, router: RewardRouter, tokenizer, examples: Sequence[Example],
             params: SamplingParams, n: int, ks: Sequence[int] = (), *, chunk_prompts: int | None = None,
             on_error: Callable[[str], None] | None = None, generate: Generate | None = None,
             self_verifier: SelfVerifier | None = None) -> EvalResult:
    """Samples ``n`` completions per prompt (with ``generate``, as :func:`sample_and_score`), scores
    them, and returns the per-task and overall avg@n and pass@k (``ks``, each at most ``n``), and
    with ``self_verifier`` the self-verification figures (the model verifies each sample with
    ``params``). ``chunk_prompts``: prompts per engine call (None: all at once), to bound the
    engine's batch."""
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per prompt, {n}); got k={bad}")
    if not examples:
        raise ValueError("evaluate: no prompts to score")
    step = chunk_prompts or len(examples)
    scores, unparsable, tasks, completions, self_scores, rounds = [], [], [], [], [], []
    for start in range(0, len(examples), step):
        chunk = examples[start:start + step]
        samples, scored = sample_and_score(engine, router, tokenizer, chunk, params, n, on_error, generate)
        if not completions:
            completions = _completions(tokenizer, chunk, samples, scored, n)
        scores.append(scored.scores.reshape(len(chunk), n))
        unparsable.append(scored.unparsable.reshape(len(chunk), n))
        tasks.extend(scored.tasks[::n])
        if self_verifier is not None:
            verified, refined = self_verifier.run(engine, router, tokenizer, chunk, samples, scores[-1], params,
                                                  on_error)
            self_scores.append(verified)
            rounds.append(refined)
    all_scores, all_unparsable, task_of = np.concatenate(scores), np.concatenate(unparsable), np.array(tasks)
    all_self = np.concatenate(self_scores) if self_scores else None
    # pass@1 by round of refinement, over all samples; only where there were rounds after the draw.
    by_round = (np.concatenate(rounds, axis=1) > CORRECT_ABOVE).mean(axis=1) if rounds else np.zeros(0)
    per_task = {t: TaskScores.of(all_scores[task_of == t], all_unparsable[task_of == t], ks,
                                 None if all_self is None else all_self[task_of == t])
                for t in sorted(set(tasks))}
    return EvalResult(tasks=per_task, overall=TaskScores.of(all_scores, all_unparsable, ks, all_self),
                      sampling=sampling_record(params, n), completions=tuple(completions),
                      refinement=tuple(map(float, by_round)) if len(by_round) > 1 else ())


COMPLETIONS_SHOWN = 4  # prompts whose first sample an evaluation keeps to be read (logs, TensorBoard, --json)


def _completions(tokenizer, examples: Sequence[Example], samples, scored: ScoredBatch, n: int) -> list[dict]:
    """The first sample of each of the first ``COMPLETIONS_SHOWN`` prompts, decoded as the reward read it."""
    return [{"prompt": e.prompt, "response": tokenizer.decode(samples[i][0].model_ids, skip_special_tokens=True),
             "reward": float(scored.scores[i * n]), "task": str(scored.tasks[i * n])}
            for i, e in enumerate(examples[:COMPLETIONS_SHOWN])]
