"""The rollout interface every engine implements (embedded JAX sampler, SGLang).

Token in, token out: prompts and conversations are token ids, never text, so the
learner scores exactly the tokens the engine produced.

Which distribution the returned logprobs belong to (docs/rollouts.md#logprob-kinds):
- ``LogprobKind.RAW``: ``log_softmax(logits)`` at temperature 1, no top-k/top-p
  filtering. This is what the learner recomputes, so it is the right
  ``rollout_logp`` for mismatch metrics and TIS/MIS corrections.
- ``LogprobKind.PROCESSED``: the distribution actually sampled from:
  ``log_softmax(logits / T)`` renormalised over the top-k/top-p support. Using
  it as ``old_logp`` against a learner that scores raw logits biases the ratio
  whenever T != 1 or filtering is on (the TRL top-p bias issue).
The trainer asks for RAW by default; the choice is explicit in
``SamplingParams.logprob_kind``.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Sequence

import numpy as np


class LogprobKind(str, enum.Enum):
    RAW = "raw"
    PROCESSED = "processed"


def check_sampling_ranges(owner: str, params) -> None:
    """Raises ValueError naming ``owner.field`` when ``params``' temperature, top_p, top_k or
    max_new_tokens is out of range (shared by SamplingParams and the trainer's rollout config)."""
    if not params.temperature >= 0.0:
        raise ValueError(f"{owner}.temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"{owner}.top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"{owner}.top_k must be >= 0 (0 disables it), got {params.top_k}")
    if params.max_new_tokens < 1:
        raise ValueError(f"{owner}.max_new_tokens must be >= 1, got {params.max_new_tokens}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k=0`` and ``top_p=1.0`` disable filtering."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprob_kind: LogprobKind = LogprobKind.RAW

    def __post_init__(self):
        check_sampling_ranges("SamplingParams", self)
        object.__setattr__(self, "logprob_kind", LogprobKind(self.logprob_kind))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class Sample:
    """One generated continuation.

    prompt_ids: [P] int32, the full context the engine was given (for a
      continued conversation: every earlier turn, tool tokens included).
    output_ids: [N] int32, tokens the model generated in this call (a stop
      token, when hit, is the last one).
    output_logprobs: [N] float32, the engine's logprob of each output token, of
      the distribution named by ``logprob_kind``.
    finish_reason: "stop" (stop id hit) or "length".
    weight_version: the engine's weight version that produced the sample.
    routed_experts: [N, num_moe_layers, top_k] int32 for MoE models when the
      engine reports routes (rollout routing replay, R3), else None. Row j: the
      experts of the position whose forward produced output token j, i.e.
      position P-1+j of ``prompt_ids + output_ids``.
    prompt_routed_experts: [P-1, num_moe_layers, top_k] int32, the routes of
      prompt positions 0..P-2 (position P-1 is ``routed_experts[0]``), or None
      when routed_experts is. ``concatenate([prompt_routed_experts,
      routed_experts])`` is then the routes of positions 0..P+N-2, every token
      fed to the model (the last output token never is), as a learner forward
      over ``prompt_ids + output_ids`` replays them.
    output_mask, output_turn_ids: for a multi-turn sample (a whole conversation after its
      prompt, ``jaxrl.env``), [N] int32: 1 on the tokens the model generated and 0 on the
      environment's (tool responses), and the model turn of each token (-1 on the
      environment's); None for a single model turn. episode: the environment's record of the
      conversation (``jaxrl.env.rollout.Episode``: why it ended, its reward, tool counts), or None.
    output_versions: [N] int32, the learner version (trainer step) of the weights that generated
      each output token, for a sample continued across weight pushes (partial rollouts,
      ``rollout.partial_tokens``); None otherwise (every token is ``weight_version``'s).
    """

    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    finish_reason: str
    weight_version: str
    logprob_kind: LogprobKind = LogprobKind.RAW
    routed_experts: np.ndarray | None = None
    prompt_routed_experts: np.ndarray | None = None
    output_mask: np.ndarray | None = None
    output_turn_ids: np.ndarray | None = None
    episode: Any = None
    output_versions: np.ndarray | None = None

    @property
    def model_ids(self) -> np.ndarray:
        """The output tokens the model generated (every one, for a single turn)."""
        return self.output_ids if self.output_mask is None else self.output_ids[np.asarray(self.output_mask) > 0]


@dataclasses.dataclass
class Conversation:
    """A multi-turn, token-level conversation.

    ``token_ids`` [L] holds every token so far; ``model_mask`` [L] is 1 on tokens
    the model generated and 0 on prompt, tool and environment tokens;
    ``turn_ids`` [L] numbers model turns from 0 (-1 on non-model tokens);
    ``rollout_logprobs`` [L] holds the engine's logprob on model tokens (0 elsewhere).
    ``finish_reasons``: each model turn's ``Sample.finish_reason``, in order.
    ``routed_experts`` [R, num_moe_layers, top_k] int32 (MoE engines that report routes, else
    None): the routes of positions 0..R-1 as the engine computed them when it first fed each
    position, so model tokens keep their decode routes and the environment tokens between
    turns take the next turn's prefill routes (R = L - 1 after a model turn; environment tokens
    appended since are covered by the next turn).
    """

    token_ids: np.ndarray
    model_mask: np.ndarray
    turn_ids: np.ndarray
    rollout_logprobs: np.ndarray
    finish_reasons: tuple[str, ...] = ()
    routed_experts: np.ndarray | None = None

    @classmethod
    def from_prompt(cls, prompt_ids: Sequence[int]) -> "Conversation":
        n = len(prompt_ids)
        return cls(
            token_ids=np.asarray(prompt_ids, np.int32),
            model_mask=np.zeros(n, np.int32),
            turn_ids=np.full(n, -1, np.int32),
            rollout_logprobs=np.zeros(n, np.float32),
        )

    @property
    def num_model_turns(self) -> int:
        return int(self.turn_ids.max(initial=-1)) + 1

    def add_model_turn(self, sample: Sample) -> "Conversation":
        n = len(sample.output_ids)
        return Conversation(
            token_ids=np.concatenate([self.token_ids, np.asarray(sample.output_ids, np.int32)]),
            model_mask=np.concatenate([self.model_mask, np.ones(n, np.int32)]),
            turn_ids=np.concatenate([self.turn_ids, np.full(n, self.num_model_turns, np.int32)]),
            rollout_logprobs=np.concatenate(
                [self.rollout_logprobs, np.asarray(sample.output_logprobs, np.float32)]
            ),
            finish_reasons=self.finish_reasons + (sample.finish_reason,),
            routed_experts=self._routes_with(sample),
        )

    def _routes_with(self, sample: Sample) -> np.ndarray | None:
        """Routes after ``sample``'s turn: the positions already covered keep the routes they were
        generated with (a later prefill recomputes them, possibly differently); the rest come from
        this turn's prefill and decode. None unless every turn so far reported routes."""
        if sample.routed_experts is None or sample.prompt_routed_experts is None:
            return None
        if self.routed_experts is None and self.num_model_turns > 0:
            return None
        covered = 0 if self.routed_experts is None else len(self.routed_experts)
        parts = [] if self.routed_experts is None else [self.routed_experts]
        parts += [sample.prompt_routed_experts[covered:], sample.routed_experts]
        return np.concatenate(parts).astype(np.int32)

    def add_environment_tokens(self, token_ids: Sequence[int]) -> "Conversation":
        """Appends tool/environment tokens; they are never trained on."""
        n = len(token_ids)
        return Conversation(
            token_ids=np.concatenate([self.token_ids, np.asarray(token_ids, np.int32)]),
            model_mask=np.concatenate([self.model_mask, np.zeros(n, np.int32)]),
            turn_ids=np.concatenate([self.turn_ids, np.full(n, -1, np.int32)]),
            rollout_logprobs=np.concatenate([self.rollout_logprobs, np.zeros(n, np.float32)]),
            finish_reasons=self.finish_reasons,
            routed_experts=self.routed_experts,
        )


class PushVerificationError(RuntimeError):
    """A weight push that cannot be verified to have taken effect: the engine reports another
    weight version, or its logprobs differ from the learner's. The message names the
    server/version and what differed.

    Raised rather than trained through: samples from weights other than the learner's would
    bias every update that follows, silently.
    """


class RolloutEngine(abc.ABC):
    """What the trainer needs from a rollout engine.

    ``holds_references``: True when ``update_weights`` keeps the learner's arrays themselves
    (the embedded sampler), so a caller that updates those arrays in place (a donating train
    step) while the engine still generates must hand it a copy.

    With several JAX processes ``generate`` is a collective. An engine whose collective part is
    only the final gathering of every process's samples (SGLang: each process asks its own
    servers) says so with ``gathers_apart``: its :meth:`generate_share` then runs no collective
    (a background thread may call it beside the learner's update) and :meth:`gather`, called
    in the same order on every process, completes it.
    """

    holds_references: bool = False
    gathers_apart: bool = False

    @abc.abstractmethod
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1
    ) -> list[list[Sample]]:
        """``n`` samples for each prompt: result[i][j] is sample j of prompt i."""

    def generate_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> Any:
        """This process's part of ``generate`` (the whole of it here); :meth:`gather` finishes it."""
        return self.generate(prompts, params, n)

    def gather(self, share: Any) -> list[list[Sample]]:
        """``generate``'s result from :meth:`generate_share`'s."""
        return share

    def continue_conversations(
        self, conversations: Sequence[Conversation], params: SamplingParams
    ) -> list[Conversation]:
        """One more model turn for each conversation (token in, token out)."""
        samples = self.generate([c.token_ids.tolist() for c in conversations], params, n=1)
        return [c.add_model_turn(s[0]) for c, s in zip(conversations, samples, strict=True)]

    def end_conversations(self) -> None:
        """Called when every conversation of a multi-turn rollout has ended: an engine that keeps
        state between turns (the embedded sampler's kept KV cache) releases it. No-op here."""
        return None

    @abc.abstractmethod
    def update_weights(self, params, version: str) -> dict[str, float] | None:
        """Loads new weights (the learner's parameter state) and sets the version.

        May return metrics of the push (e.g. SGLang's ``push/*`` timings); the trainer logs them.
        """

    @property
    @abc.abstractmethod
    def weight_version(self) -> str:
        """The version of the weights the engine samples with now."""

    def close(self) -> None:
        """Releases servers, caches and threads. Idempotent.

        Deliberately not abstract: this default is a no-op hook for engines that hold nothing to
        release (e.g. the embedded ``JaxSampler``); engines with servers or threads override it.
        """
        return None
