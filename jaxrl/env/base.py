"""The environment interface of multi-turn rollouts (docs/agentic.md#environments).

An environment owns one conversation: ``reset(row)`` builds its first tokens from a dataset row,
``step(conversation, model_turn)`` answers each model turn with observation tokens (or ends the
conversation). The multi-turn driver (``jaxrl.env.rollout``) creates one environment per row,
so an environment may keep per-conversation state (the row, tool results) on itself.

Everything is token ids: an environment appends its observation's ids once and never
re-tokenises earlier turns, so the learner scores exactly the tokens the engine saw.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl.rollout.base import Conversation

# Why a conversation ended (the driver's metrics count each).
ANSWERED = "answered"          # the model answered without calling a tool
TURN_LENGTH = "turn_length"    # the model's last turn hit max_new_tokens without a tool call
MAX_TURNS = "max_turns"        # limits.max_turns model turns were taken
MAX_TOKENS = "max_tokens"      # the conversation reached limits.max_total_tokens
ENV_ERROR = "env_error"        # the environment itself raised (a bug in it, reported and counted)
FINISH_REASONS = (ANSWERED, TURN_LENGTH, MAX_TURNS, MAX_TOKENS, ENV_ERROR)


@dataclasses.dataclass(frozen=True)
class EnvLimits:
    """Limits on one conversation.

    max_turns: model turns at most. max_total_tokens: prompt, model and observation tokens
    together; the last turn's ``max_new_tokens`` shrinks to what is left. max_observation_tokens:
    one observation's tokens at most; longer tool output is cut and ends with a visible marker.
    max_tool_calls_per_turn: calls beyond it are answered with an error, not run.
    """

    max_turns: int = 4
    max_total_tokens: int = 2048
    max_observation_tokens: int = 256
    max_tool_calls_per_turn: int = 4

    def __post_init__(self):
        for name in ("max_turns", "max_total_tokens", "max_observation_tokens", "max_tool_calls_per_turn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"env limits {name} must be an integer >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One environment step.

    observation_ids: tokens to append (empty when done). reward: this step's reward, for the turn
    just taken or (at done) for the conversation, else None; a conversation's environment reward
    is the sum of its steps' rewards. done: the conversation ends now.
    info: counts for the metrics: ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
    ``truncations`` (ints), and ``finish`` (one of FINISH_REASONS) when done.
    """

    observation_ids: tuple[int, ...] = ()
    reward: float | None = None
    done: bool = False
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "observation_ids", tuple(int(t) for t in self.observation_ids))
        if self.done and self.observation_ids:
            raise ValueError("StepResult: a step that ends the conversation appends no observation")


class Environment(abc.ABC):
    """One conversation's environment (module doc). ``limits`` bounds it; the driver enforces
    turns and total tokens, the environment the size of each observation."""

    limits: EnvLimits = EnvLimits()

    @abc.abstractmethod
    def reset(self, row: Mapping) -> Conversation:
        """The conversation's first tokens (the prompt) for dataset row ``row``."""

    @abc.abstractmethod
    def step(self, conversation: Conversation, model_turn: np.ndarray) -> StepResult:
        """Answers the model's last turn (``model_turn``, its token ids, already the tail of
        ``conversation``). Bad tool calls are observations, never exceptions."""

    def final_reward(self, conversation: Conversation, finish: str) -> float | None:
        """The reward of a conversation that ended for ``finish`` without a step reward (a limit
        was hit); None by default, leaving the score to the trainer's reward functions."""
        return None

    def close(self) -> None:
        """Releases what the environment holds; called by the driver when its conversation ends.
        A no-op hook by default (the built-in environment holds no process between calls)."""
        return None


def truncate_tokens(ids: Sequence[int], limit: int, marker_ids: Sequence[int]) -> tuple[list[int], bool]:
    """``ids`` cut to at most ``limit`` tokens, ending with ``marker_ids`` when cut; (ids, cut).
    When even the marker does not fit, the first ``limit`` tokens of the marker."""
    ids = list(ids)
    if len(ids) <= limit:
        return ids, False
    keep = max(0, limit - len(marker_ids))
    return (ids[:keep] + list(marker_ids))[:limit], True
