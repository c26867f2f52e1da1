"""Multi-turn rollouts in the RL trainer: with an ``env`` section, every sample is a conversation.

Each of a step's prompts gets ``group_size`` fresh environments (chosen per row by
``env.tasks``, ``jaxrl.env.EnvRouter``) and ``jaxrl.env.run_episodes`` plays them all at once:
model turns batched through the engine, tool calls between them. A conversation becomes one
``Sample`` whose output is everything after the prompt (``Episode.as_sample``): the model's
turns and the environment's tokens, with ``output_mask`` marking the model's. From there the
step is the single-turn one, with three differences:

- the loss, its normaliser and the mismatch metrics see the model's tokens only (the step
  batch's ``mask`` and ``generated`` come from ``output_mask``);
- the task's reward function scores the text of the model's tokens (tool responses left out),
  and an environment's own reward, when it gives one, is added to that score (the reward
  stage, ``jaxrl.trainer.stages.reward``);
- ``env/*`` metrics (``jaxrl.env.rollout.episode_metrics``) and the mismatch of the first model
  turn against the later ones (``mismatch_turn/first_turn_*``, ``mismatch_turn/later_turns_*``).
"""

from __future__ import annotations

from typing import Sequence

from jaxrl.env import EnvRouter
from jaxrl.env.rollout import episode_metrics, run_episodes
from jaxrl.rollout.base import RolloutEngine, Sample, SamplingParams


def generate_conversations(engine: RolloutEngine, envs: EnvRouter, examples: Sequence, params: SamplingParams,
                           n: int) -> list[list[Sample]]:
    """``n`` conversations per example, as samples [prompt][n] (the layout of ``engine.generate``)."""
    rows = [e.row for e in examples for _ in range(n)]
    played = run_episodes(engine, [envs.make(row) for row in rows], rows, params,
                          tool_workers=envs.config.tool_workers)
    samples = [episode.as_sample(engine.weight_version) for episode in played.episodes]
    return [samples[i * n:(i + 1) * n] for i in range(len(examples))]


def recording_conversations(engine: RolloutEngine, envs: EnvRouter | None):
    """(generate, played) for ``jaxrl.evaluation``'s ``generate``: with environments, prompts are
    played as conversations (``generate_conversations``) and every played sample is appended to
    ``played`` (for its ``env/*`` metrics); without, (None, [])."""
    played: list[Sample] = []
    if envs is None:
        return None, played

    def generate(examples, params, n):
        samples = generate_conversations(engine, envs, examples, params, n)
        played.extend(s for group in samples for s in group)
        return samples

    return generate, played


def environment_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    episodes = [s.episode for s in samples if s.episode is not None]
    return episode_metrics(episodes) if episodes else {}
