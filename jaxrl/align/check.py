"""Running the comparison: sample with an engine, recompute with the learner.

``collect(engine, prompts, params, n)`` turns an engine's samples into an
``AlignmentBatch``; ``score_with_learner(model, batch)`` adds the learner's
recompute of the same tokens (``jaxrl.models.scoring.sequence_logprobs``, the path
the trainer uses for ``old_logp``); ``check_engine`` does both and writes the report.
Works with any ``RolloutEngine`` (the embedded sampler, SGLang).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from flax import nnx

from jaxrl.align.dump import AlignmentBatch
from jaxrl.align.gate import Gate, GateResult
from jaxrl.align.metrics import DEFAULT_RATIO_BAND, build_report
from jaxrl.align.report import write_report
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import Conversation, RolloutEngine, SamplingParams


def collect(engine: RolloutEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
            n: int = 1) -> AlignmentBatch:
    """Samples ``n`` continuations per prompt; one sequence per sample, prompt i's first."""
    samples = engine.generate(prompts, params, n)
    conversations = [Conversation.from_prompt(s.prompt_ids).add_model_turn(s) for row in samples for s in row]
    meta = {"engine": type(engine).__name__, "weight_version": engine.weight_version,
            "logprob_kind": params.logprob_kind.value, "sampling": dataclasses.asdict(params)
            | {"logprob_kind": params.logprob_kind.value}}
    return AlignmentBatch.from_conversations(conversations, meta=meta)


def score_with_learner(model: nnx.Module, batch: AlignmentBatch,
                       mesh: jax.sharding.Mesh | None = None) -> AlignmentBatch:
    """``batch`` with ``learner_logprobs`` recomputed by ``model`` on the same tokens, through the
    learner's one scoring path (``jaxrl.models.scoring``, the trainer's ``old_logp``)."""
    return batch.with_learner_logprobs(sequence_logprobs(model, batch.token_ids, batch.lengths, mesh))


def check_engine(engine: RolloutEngine, model: nnx.Module, prompts: Sequence[Sequence[int]],
                 params: SamplingParams, n: int = 1, *, out_dir: str | None = None, gate: Gate | None = None,
                 ratio_band: tuple[float, float] = DEFAULT_RATIO_BAND, figures: bool = True,
                 mesh: jax.sharding.Mesh | None = None) -> tuple[AlignmentBatch, dict, GateResult | None]:
    """Engine vs learner on ``prompts``: returns (scored batch, report, gate result).

    With PROCESSED logprobs and temperature != 1 or filtering on, the engine's numbers are of a
    different distribution than the learner's raw recompute: the report then measures that
    bias (docs/rollouts.md#logprob-kinds), not an implementation mismatch; ask for RAW to check alignment.
    """
    batch = score_with_learner(model, collect(engine, prompts, params, n), mesh)
    if out_dir is None:
        report = build_report(batch, ratio_band=ratio_band)
        return batch, report, gate.check(report) if gate is not None else None
    report, result, _ = write_report(batch, out_dir, gate=gate, ratio_band=ratio_band, figures=figures)
    return batch, report, result


__all__ = ["collect", "score_with_learner", "check_engine"]
