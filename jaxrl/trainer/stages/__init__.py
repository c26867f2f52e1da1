"""The stages of one RL step, in the data's order; :func:`build_stages` assembles them for a run.

=========  ==============================================  =====================================
stage      what it adds to the step record                 module
=========  ==============================================  =====================================
rollout    the step's prompts and the engine's samples     ``rollout`` (queue, partial, episodes)
reward     scores, validity, greedy baselines              ``reward`` (dynamic sampling)
pack       the ``StepBatch``                               ``pack``
recompute  ``old_logp``, ``ref_logp``                      ``recompute``
advantage  ``advantages`` (with GAE: values, returns)      ``advantage`` (the critic)
filter     ``skip_update``                                 ``filter``
update     the policy's (and co-learners') new state       ``update``
push       the engine's new weights (last push verified)   ``push``
=========  ==============================================  =====================================

Each stage is its own room (``jaxrl.trainer.stages.base`` states the contract): it imports no
other stage and not the trainer; what one stage needs of another (the rollout stage's extra
draws for dynamic sampling, its queue for the push, the critic as the update's co-learner) is
handed to it here. ``RLTrainer`` (``jaxrl.trainer.rl``) runs the list and knows no stage's
internals, so a new stage is added here, or by a caller through ``extra``, without touching it.
"""

from __future__ import annotations

from typing import Sequence

from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.stages.advantage import AdvantageStage
from jaxrl.trainer.stages.advantage.critic import CriticStage
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord
from jaxrl.trainer.stages.filter import FilterStage
from jaxrl.trainer.stages.pack import PackStage
from jaxrl.trainer.stages.push import PushStage
from jaxrl.trainer.stages.recompute import RecomputeStage, objective_for_run
from jaxrl.trainer.stages.reward import RewardStage
from jaxrl.trainer.stages.rollout import RolloutStage, sampler_batch
from jaxrl.trainer.stages.update import UpdateStage

__all__ = ["Stage", "StepContext", "StepRecord", "build_stages", "frozen_policy_steps", "objective_for_run",
           "sampler_batch"]


def build_stages(context: StepContext, extra: Sequence[tuple[str, Stage]] = ()) -> list[Stage]:
    """The run's stages in order. With ``advantage.estimator: gae`` the advantage stage is the
    critic, which also trains as the update's co-learner. ``extra``: ``(after, stage)`` pairs, each
    ``stage`` inserted right after the stage named ``after`` (in the order given)."""
    rollout = RolloutStage(context)
    advantage = CriticStage(context) if context.config.critic is not None else AdvantageStage(context)
    co_learners = [advantage] if isinstance(advantage, CriticStage) else []
    stages: list[Stage] = [
        rollout, RewardStage(context, draw=rollout.draw), PackStage(context), RecomputeStage(context), advantage,
        FilterStage(context), UpdateStage(context, co_learners), PushStage(context, rollouts=rollout)]
    for after, stage in extra:
        names = [s.name for s in stages]
        if after not in names:
            raise ValueError(f"cannot insert stage {stage.name!r} after {after!r}: the stages are {names}")
        if stage.name in names:
            raise ValueError(f"a stage named {stage.name!r} exists already; give the new stage a name of its own")
        stages.insert(names.index(after) + 1, stage)
    return stages


def frozen_policy_steps(config: TrainConfig) -> int:
    """The first RL steps in which only a co-learner trains (the critic's ``critic.warmup_steps``)."""
    return config.critic.warmup_steps if config.critic is not None else 0
