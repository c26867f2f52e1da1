"""Stage 5, advantage: each sample's advantage from the scores, on its loss tokens.

:class:`AdvantageStage` runs the sequence-level estimators of ``jaxrl.losses.advantages``
(``advantage.estimator``: GRPO, Dr. GRPO, RLOO, ReMax with the greedy baselines, OPO with the
generated lengths, ...) over the record's scores and validity, after the KL penalty enters the
reward when ``objective.kl_in_reward_coef > 0``; every loss token of a sample carries its
sample's advantage.

Its variant for ``advantage.estimator: gae`` is the critic
(:class:`~jaxrl.trainer.stages.advantage.critic.CriticStage`): a value model scores the batch,
token-level GAE gives advantages and returns, and the critic trains beside the policy as a
co-learner of the update stage. ``build_stages`` chooses one of the two.

Metrics: the estimator's ``advantage/*`` and, with greedy baselines, ``advantage/greedy_reward_mean``.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl.losses import ObjectiveConfig, kl_in_reward
from jaxrl.losses.advantages import AdvantageConfig, sequence_advantages
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord


class AdvantageStage(Stage):
    name = "advantage"

    def __init__(self, context: StepContext):
        self.context = context

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        c = self.context
        batch, metrics = advantages(record.batch, record.scored.scores, record.valid, c.config.advantage, c.objective,
                                    c.config.rollout.group_size, record.greedy_scores)
        return record.replace(batch=batch), metrics


def advantages(batch: StepBatch, scores: np.ndarray, valid: np.ndarray, config: AdvantageConfig,
               objective: ObjectiveConfig, group_size: int, greedy_scores: np.ndarray | None = None
               ) -> tuple[StepBatch, dict[str, float]]:
    """Per-token advantages (the sample's advantage on its masked tokens), after the KL penalty
    enters the reward when ``objective.kl_in_reward_coef > 0``. ``greedy_scores`` (one per
    prompt) is the baseline of "remax"; "opo" weighs its baseline by the generated lengths."""
    rewards = scores
    if objective.kl_in_reward_coef > 0:
        rewards = np.asarray(_kl_in_reward(scores, batch.old_logp, batch.ref_logp, batch.mask,
                                           coef=objective.kl_in_reward_coef))
    lengths = np.asarray(batch.generated).sum(axis=1)
    adv, metrics = sequence_advantages(config, rewards, valid, group_size, lengths=lengths, baselines=greedy_scores)
    if greedy_scores is not None:
        metrics["advantage/greedy_reward_mean"] = float(np.mean(greedy_scores))
    return batch.replace(advantages=adv[:, None] * batch.mask), metrics


_kl_in_reward = jax.jit(kl_in_reward, static_argnames=("coef",))
