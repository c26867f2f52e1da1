"""The multi-turn rollout driver (docs/agentic.md#the-multi-turn-driver).

``run_episodes(engine, envs, rows, params)``: every environment is reset on its row; then, turn
after turn, all conversations still active advance one model turn together (one batched
``engine.continue_conversations`` call: the embedded sampler or SGLang, which continues from
the token ids so its prefix cache reuses the earlier turns), the environments answer the new
turns concurrently in a thread pool (each python tool call is its own subprocess, so threads
suffice and the GIL is not held while it runs), and conversations that are done leave the batch.

Limits (``Environment.limits``): at most ``max_turns`` model turns; a turn's ``max_new_tokens``
shrinks to what ``max_total_tokens`` leaves (conversations are grouped by that budget, one
engine call per distinct budget; usually one), and a conversation with nothing left ends, as
does one whose next observation would not fit. An observation is never appended after the
last model turn, so every conversation ends with model tokens.

Sampling seeds: turn ``t`` uses ``params.seed + t * 7919`` so later turns do not replay the
first turn's noise (the sampler's noise depends on the seed and the row's place in the batch).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from typing import Mapping, Sequence

import numpy as np

from jaxrl.env.base import ENV_ERROR, FINISH_REASONS, MAX_TOKENS, MAX_TURNS, Environment, StepResult
from jaxrl.reward.base import describe_exception
from jaxrl.rollout.base import Conversation, RolloutEngine, Sample, SamplingParams

log = logging.getLogger(__name__)
COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "truncations")


@dataclasses.dataclass
class Episode:
    """One conversation's outcome: the conversation (``model_mask``, ``turn_ids``, logprobs and
    routes across turns), why it ended (``finish``, one of ``jaxrl.env.base.FINISH_REASONS``),
    the environment's reward or None, and its tool counts.

    ``step_rewards``: the rewards the environment's steps gave, per turn or at the end, in order;
    ``reward``: the conversation's environment reward, their sum (sequence-level, as GRPO's
    advantages are), or ``Environment.final_reward`` when no step gave one, or None.
    """

    conversation: Conversation
    row: Mapping
    finish: str = ""
    reward: float | None = None
    step_rewards: list[float] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    error: str | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish)

    def as_sample(self, weight_version: str) -> Sample:
        """The conversation as one multi-turn ``Sample``: the tokens before the first model turn
        are its prompt, everything after its output (``output_mask`` 0 on the environment's
        tokens, ``output_turn_ids``), with the engine's logprobs and routes of every turn."""
        c = self.conversation
        model = np.flatnonzero(c.model_mask)
        first = int(model[0]) if model.size else len(c.token_ids)
        routes = c.routed_experts
        return Sample(
            prompt_ids=c.token_ids[:first], output_ids=c.token_ids[first:],
            output_logprobs=c.rollout_logprobs[first:], finish_reason=self.finish, weight_version=weight_version,
            routed_experts=None if routes is None else routes[first - 1:],
            prompt_routed_experts=None if routes is None else routes[:first - 1],
            output_mask=c.model_mask[first:], output_turn_ids=c.turn_ids[first:], episode=self)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    episodes: list[Episode]
    metrics: dict[str, float]

    @property
    def conversations(self) -> list[Conversation]:
        return [e.conversation for e in self.episodes]


def _safe_step(env: Environment, conversation: Conversation) -> StepResult | BaseException:
    turn = conversation.token_ids[conversation.turn_ids == conversation.num_model_turns - 1]
    try:
        return env.step(conversation, turn)
    except Exception as e:  # noqa: BLE001 - one broken environment ends its conversation, not the batch.
        return e


def run_episodes(engine: RolloutEngine, envs: Sequence[Environment], rows: Sequence[Mapping],
                 params: SamplingParams, *, tool_workers: int = 8) -> EpisodeBatch:
    """Multi-turn rollouts of ``envs[i]`` on ``rows[i]`` (module doc); one fresh environment per row.

    Returns the episodes in the order given and the metrics of :func:`episode_metrics`.
    """
    if len(envs) != len(rows):
        raise ValueError(f"run_episodes: {len(envs)} environments for {len(rows)} rows; give one per row")
    episodes = [Episode(env.reset(row), row) for env, row in zip(envs, rows, strict=True)]
    with (concurrent.futures.ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="jaxrl-env") as pool,
          _ending(engine)):
        turn = 0
        while True:
            active = [i for i, e in enumerate(episodes) if not e.done]
            for i in active:
                left = envs[i].limits.max_total_tokens - len(episodes[i].conversation.token_ids)
                if left < 1:
                    _finish(envs[i], episodes[i], MAX_TOKENS)
            active = [i for i in active if not episodes[i].done]
            if not active:
                break
            _advance(engine, envs, episodes, active, params, turn)
            results = list(pool.map(lambda i: _safe_step(envs[i], episodes[i].conversation), active))
            for i, result in zip(active, results, strict=True):
                _apply(envs[i], episodes[i], result)
            turn += 1
    return EpisodeBatch(episodes, episode_metrics(episodes))


@contextlib.contextmanager
def _ending(engine: RolloutEngine):
    """Tells the engine when the episodes are over (however they end), so it frees what it kept
    between turns."""
    try:
        yield
    finally:
        engine.end_conversations()


def _advance(engine: RolloutEngine, envs, episodes: list[Episode], active: list[int], params: SamplingParams,
             turn: int) -> None:
    """One model turn for every active conversation: one engine call per distinct token budget."""
    groups: dict[int, list[int]] = {}
    for i in active:
        left = envs[i].limits.max_total_tokens - len(episodes[i].conversation.token_ids)
        groups.setdefault(min(params.max_new_tokens, left), []).append(i)
    seed = (params.seed + turn * 7919) % 2**32
    for budget, members in sorted(groups.items()):
        turn_params = dataclasses.replace(params, max_new_tokens=budget, seed=seed)
        advanced = engine.continue_conversations([episodes[i].conversation for i in members], turn_params)
        for i, conversation in zip(members, advanced, strict=True):
            episodes[i].conversation = conversation


def _apply(env: Environment, episode: Episode, result: StepResult | BaseException) -> None:
    if isinstance(result, BaseException):
        episode.error = describe_exception(result)
        log.warning("environment %s raised %s; its conversation ends (counted as env_error)",
                    type(env).__name__, episode.error)
        _finish(env, episode, ENV_ERROR)
        return
    for key in COUNTS:
        episode.counts[key] += int(result.info.get(key, 0))
    if result.reward is not None:
        episode.step_rewards.append(float(result.reward))
    conversation = episode.conversation
    if result.done:
        _finish(env, episode, str(result.info.get("finish", "answered")))
    elif conversation.num_model_turns >= env.limits.max_turns:
        _finish(env, episode, MAX_TURNS)
    elif len(conversation.token_ids) + len(result.observation_ids) >= env.limits.max_total_tokens:
        _finish(env, episode, MAX_TOKENS)
    else:
        episode.conversation = conversation.add_environment_tokens(result.observation_ids)


def _finish(env: Environment, episode: Episode, finish: str) -> None:
    episode.finish = finish
    reward = sum(episode.step_rewards) if episode.step_rewards else None
    if reward is None and finish != ENV_ERROR:
        try:
            reward = env.final_reward(episode.conversation, finish)
        except Exception as e:  # noqa: BLE001 - a broken reward hook leaves the reward to the trainer.
            log.warning("environment %s final_reward raised %s", type(env).__name__, describe_exception(e))
    episode.reward = reward
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 - cleanup failures are reported, the episode stands.
        log.warning("environment %s close raised %s", type(env).__name__, describe_exception(e))


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``env/*`` metrics of a batch: per-conversation means of turns and tool calls, tool error
    and timeout rates (per call), truncated observations, and the fraction of conversations
    that ended for each reason (answered vs a limit)."""
    n = max(1, len(episodes))
    calls = sum(e.counts["tool_calls"] for e in episodes)
    metrics = {
        "env/turns_per_conversation": sum(e.conversation.num_model_turns for e in episodes) / n,
        "env/tool_calls_per_conversation": calls / n,
        "env/tool_error_rate": sum(e.counts["tool_errors"] for e in episodes) / max(1, calls),
        "env/tool_timeout_rate": sum(e.counts["tool_timeouts"] for e in episodes) / max(1, calls),
        "env/truncations": float(sum(e.counts["truncations"] for e in episodes)),
        "env/tokens_per_conversation": sum(len(e.conversation.token_ids) for e in episodes) / n,
        "env/model_tokens_per_conversation": sum(int(np.sum(e.conversation.model_mask)) for e in episodes) / n,
    }
    for reason in FINISH_REASONS:
        metrics[f"env/finished_{reason}"] = sum(e.finish == reason for e in episodes) / n
    metrics["env/finished_by_limit"] = sum(e.finish in (MAX_TURNS, MAX_TOKENS) for e in episodes) / n
    return metrics
