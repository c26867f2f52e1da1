"""Stage 1, rollout: the step's prompts and the engine's samples of them.

Each step takes ``prompts_per_step`` prompts from the data iterator and ``group_size`` samples of
each from the rollout engine, plus one greedy response per prompt when the advantage estimator
needs it as a baseline (ReMax). Its options, each in its own module here:

- ``rollout.max_staleness`` > 0: batches generated in a background thread with weights up to
  that many updates older (:mod:`~jaxrl.trainer.stages.rollout.queue`);
- ``rollout.partial_tokens``: long generations spread over several steps
  (:mod:`~jaxrl.trainer.stages.rollout.partial`);
- an ``env`` section: every sample is a conversation with the row's environment
  (:mod:`~jaxrl.trainer.stages.rollout.episodes`).

Dynamic sampling draws more prompts through :meth:`RolloutStage.draw` (the reward stage decides
which groups to keep). Everything random is derived from ``(config.seed, step, draw)``
(:func:`sampling_seed`), so a resumed run samples exactly what the uninterrupted one did.

Metrics: ``rollout/response_length_{mean,max}``, ``rollout/staleness_{mean,max}``, the partial
queue's ``rollout/partial_*`` and ``rollout/token_staleness_*``, ``env/*`` for conversations,
and ``time/generation`` (the engine's time on the batch, in the background or not).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jaxrl.rollout.base import SamplingParams
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord
from jaxrl.trainer.stages.rollout.episodes import environment_metrics, generate_conversations
from jaxrl.trainer.stages.rollout.partial import PartialRolloutQueue
from jaxrl.trainer.stages.rollout.queue import RolloutQueue, staleness_metrics


class RolloutStage(Stage):
    """The rollout stage over ``context.engine``; ``queue`` holds the batches in flight."""

    name = "rollout"

    def __init__(self, context: StepContext):
        self.context = context
        r = context.config.rollout
        if r.partial_tokens:
            self.queue = PartialRolloutQueue(
                context.iterator, self._continue, lambda step, draw: sampling_seed(context.config.seed, step, draw),
                prompts=r.prompts_per_step, groups=r.partial_groups or 2 * r.prompts_per_step,
                group_size=r.group_size, partial_tokens=r.partial_tokens, max_new_tokens=r.max_new_tokens)
        else:
            self.queue = RolloutQueue(context.iterator, self.generate_pending, r.max_staleness)

    def start(self, step: int) -> None:
        engine = self.context.engine
        if self.queue.background and jax.process_count() > 1 and not engine.gathers_apart:
            raise ValueError(f"rollout.max_staleness={self.context.config.rollout.max_staleness} with several JAX "
                             f"processes needs an engine whose generation is no collective until its samples are "
                             f"gathered (rollout.engine=sglang): the {type(engine).__name__}'s would run in a second "
                             "thread beside the update's; set rollout.max_staleness=0")

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        batch = self.queue.take(step)
        record = record.replace(examples=batch.examples, samples=batch.samples, greedy=batch.greedy)
        samples = record.flat_samples
        return record, {**rollout_metrics(samples), **staleness_metrics(batch, step - 1), **batch.metrics,
                        **environment_metrics(samples), "time/generation": batch.generate_seconds}

    # ---------------------------------------------------------------- generation
    def sampling(self, seed: int, temperature: float | None = None) -> SamplingParams:
        return sampling_params(self.context.config.rollout, self.context.stop_token_ids, seed, temperature)

    def rollout(self, examples, seed: int, n: int, temperature: float | None = None) -> list:
        """``n`` samples [prompt][n] of each example with the engine's current weights."""
        return self.rollout_pending(examples, seed, n, temperature)()

    def rollout_pending(self, examples, seed: int, n: int, temperature: float | None = None) -> Callable[[], list]:
        """:meth:`rollout`, pending: this process's share is drawn now (no collective), the returned
        call gathers every process's."""
        c = self.context
        if c.envs is not None:  # conversations with the rows' environments (config section env), drawn whole
            played = generate_conversations(c.engine, c.envs, examples, self.sampling(seed, temperature), n)
            return lambda: played
        share = c.engine.generate_share([e.prompt_ids.tolist() for e in examples], self.sampling(seed, temperature),
                                        n=n)
        return lambda: c.engine.gather(share)

    def generate_pending(self, examples, index: int, draw: int = 0) -> Callable[[], tuple[list, list | None]]:
        """Batch ``index``'s samples (and ReMax's greedy baseline responses), pending as in
        :meth:`rollout_pending`; the queue draws them in its worker thread when it has one and gathers them
        in the trainer's. ``draw`` > 0: dynamic sampling's extra draw of the step, with its own seed."""
        config = self.context.config
        seed = sampling_seed(config.seed, index, draw)
        samples = self.rollout_pending(examples, seed=seed, n=config.rollout.group_size)
        greedy = self.rollout_pending(examples, seed=seed, n=1, temperature=0.0) \
            if config.advantage.needs_greedy_baseline else None
        return lambda: (samples(), None if greedy is None else greedy())

    def generate(self, examples, index: int, draw: int = 0) -> tuple[list, list | None]:
        """:meth:`generate_pending`, gathered at once."""
        return self.generate_pending(examples, index, draw)()

    def draw(self, step: int, draw: int) -> StepRecord:
        """Dynamic sampling's ``draw``-th extra draw of ``step``: new prompts, the same weights."""
        examples = next(self.context.iterator)
        samples, greedy = self.generate(examples, step, draw)
        return StepRecord(examples=examples, samples=samples, greedy=greedy)

    def _continue(self, prompts, n: int, budget: int, seed: int):
        """The partial queue's engine call: ``n`` samples of at most ``budget`` new tokens."""
        params = dataclasses.replace(self.sampling(seed), max_new_tokens=budget)
        return self.context.engine.generate(prompts, params, n=n)

    # ---------------------------------------------------------------- weight pushes
    @property
    def background(self) -> bool:
        """Whether batches are generated in a worker thread, beside the update."""
        return self.queue.background

    def drain(self) -> float:
        """Waits for the batches of the weights about to be replaced; returns the seconds waited."""
        return self.queue.before_push()

    def refill(self, weights: int, final: bool = False) -> None:
        """The engine now holds version ``weights``: start the batches that use it."""
        self.queue.fill(weights, final=final)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int) -> dict:
        return self.queue.state(step)

    def restore(self, meta: dict, items: dict) -> None:
        self.queue.restore(meta)

    def close(self) -> None:
        self.queue.close()


def rollout_metrics(samples: list) -> dict[str, float]:
    lengths = np.asarray([len(s.output_ids) for s in samples])
    return {"rollout/response_length_mean": float(lengths.mean()),
            "rollout/response_length_max": float(lengths.max())}


def sampling_params(rollout, stop_token_ids: tuple[int, ...], seed: int,
                    temperature: float | None = None) -> SamplingParams:
    """The engine's sampling parameters of a ``rollout`` section (``temperature`` overrides its own)."""
    return SamplingParams(
        temperature=rollout.temperature if temperature is None else temperature, top_p=rollout.top_p,
        top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens, stop_token_ids=stop_token_ids, seed=seed,
        logprob_kind=rollout.logprob_kind)


def sampling_seed(seed: int, step: int, draw: int = 0) -> int:
    """A distinct, reproducible 31-bit sampling seed per (run seed, step[, extra draw])."""
    entropy = [seed, step + 1] + ([draw] if draw else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)


def sampler_batch(config) -> int:
    """The most sequences the embedded sampler decodes at once: ``rollout.max_batch``, or (0) a step's
    whole batch or the held-out evaluation's, whichever is larger."""
    r = config.rollout
    return r.max_batch or max(r.prompts_per_step * r.group_size, config.eval.max_prompts * config.eval.samples)
