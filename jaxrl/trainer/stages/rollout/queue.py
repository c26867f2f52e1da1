"""The rollout queue: each step's prompts and their samples, generated ahead of the learner.

``rollout.max_staleness`` (s) bounds how many optimizer updates a batch's weights may lag the
learner's (docs/training.md#asynchronous-rollouts). Batch ``k`` is generated with the weights
of version ``max(k - 1 - s, 0)`` (the learner's after that many steps), so:

- s = 0 is the synchronous loop: batch k is drawn after the push of version k - 1 and generated
  when step k asks for it, in the trainer's own thread;
- s >= 1 generates in one background thread: after the push of version j the queue draws batch
  j + s + 1 and starts it, so while the learner updates on batch j + 1 the engine generates
  the next one with the weights it has (verl's one-step-off-policy, slime's asynchronous
  training for s = 1). The engine holds one weight version at a time, so a push first waits for
  every batch started before it (those are the batches of older versions).

Every sample records the version that produced it (``Sample.weight_version``); the learner
recomputes ``old_logp`` with its current weights and the mismatch corrections use the
engine's logprobs as the behaviour policy's.

Exact resume: when the run saves after step j, batches j + 1 .. j + s were generated with
weights the checkpoint does not hold, so their samples are saved with it (:meth:`state`, a
JSON record with the arrays base64-encoded); batch j + s + 1 uses version j, which it does
hold, and is regenerated on resume from the same prompts and seed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable

import numpy as np

from jaxrl.trainer.stages.rollout.records import decode_groups, encode_groups

# (examples, batch index) -> a call that returns (samples [prompt][sample], greedy samples [prompt][1] or
# None): this process's share is drawn before it returns, and the call gathers every process's (a
# collective with several JAX processes, so the queue makes it in the trainer's thread, in batch order).
GenerateFn = Callable[[list, int], Callable[[], tuple[list, list | None]]]


@dataclasses.dataclass
class RolloutBatch:
    """Batch ``index``'s prompts and the engine's samples of them; ``weights``: the learner
    version the engine held when it was started; ``generate_seconds``: the engine's time on it."""

    index: int
    examples: list
    weights: int
    data_before: dict
    samples: list | None = None
    greedy: list | None = None
    generate_seconds: float = 0.0
    future: concurrent.futures.Future | None = None
    pending: Callable[[], tuple[list, list | None]] | None = None  # drawn, not yet gathered
    metrics: dict = dataclasses.field(default_factory=dict)  # the queue's own rollout/* metrics


class RolloutQueue:
    """Batches in flight between the data iterator and the learner (see the module doc).

    iterator: the run's prompt iterator (``state()``/``restore()``, drawn only from the
    trainer's thread); generate: draws one batch's samples with the engine's current weights
    (``GenerateFn``);
    background: generate in a worker thread (default: when ``max_staleness > 0``; a test can run
    the worker at s = 0).
    """

    def __init__(self, iterator, generate: GenerateFn, max_staleness: int, background: bool | None = None):
        self.iterator = iterator
        self.generate = generate
        self.max_staleness = max_staleness
        self.background = max_staleness > 0 if background is None else background
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxrl-rollout") if self.background else None
        self._pending: dict[int, RolloutBatch] = {}

    # ---------------------------------------------------------------- the loop
    def fill(self, weights: int, final: bool = False) -> None:
        """Called with the learner's version once the engine holds it (at start-up and after each
        push): draws and starts every batch up to ``weights + max_staleness + 1``; after the
        ``final`` step's push none with these weights (a resumed longer run regenerates it)."""
        for index in range(weights + 1, weights + self.max_staleness + (1 if final else 2)):
            if index not in self._pending:
                self._start(RolloutBatch(index, [], weights, self.iterator.state()))

    def take(self, index: int) -> RolloutBatch:
        """Batch ``index``, waiting for its generation to finish."""
        if index not in self._pending:
            raise RuntimeError(f"rollout batch {index} was never started (pending: {sorted(self._pending)}); "
                               "call fill() after each weight push")
        return self._finish(self._pending.pop(index))

    def before_push(self) -> float:
        """Waits for every started batch (they use the weights about to be replaced); returns the seconds waited."""
        start = time.perf_counter()
        for batch in self._pending.values():
            self._finish(batch)
        return time.perf_counter() - start

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    # ---------------------------------------------------------------- checkpoints
    def state(self, learner_version: int) -> dict[str, Any]:
        """The checkpoint record after the push of ``learner_version``: the iterator state before
        the first pending batch's prompts were drawn, and the samples of the pending batches made
        with older weights (the others are regenerated on resume)."""
        pending = sorted(self._pending.values(), key=lambda b: b.index)
        data = pending[0].data_before if pending else self.iterator.state()
        saved = [self._finish(b) for b in pending if b.weights < learner_version]
        return {"data": data, "pending": [_encode_batch(b) for b in saved]}

    def restore(self, record: dict[str, Any]) -> None:
        """Puts back the state of :meth:`state`: the iterator and the saved batches (same prompts,
        redrawn from the restored iterator; the saved samples), from a checkpoint's meta record
        (``pending`` absent in checkpoints written before it existed). Call :meth:`fill` next."""
        self.iterator.restore(record["data"])
        for saved in record.get("pending", ()):
            batch = RolloutBatch(int(saved["index"]), [], int(saved["weights"]), self.iterator.state())
            batch.examples = next(self.iterator)
            batch.samples = decode_groups(saved["samples"], batch.examples)
            batch.greedy = None if saved["greedy"] is None else decode_groups(saved["greedy"], batch.examples)
            batch.generate_seconds = float(saved["generate_seconds"])
            self._pending[batch.index] = batch

    # ---------------------------------------------------------------- internals
    def _start(self, batch: RolloutBatch) -> None:
        batch.examples = next(self.iterator)
        self._pending[batch.index] = batch
        if self._pool is not None:
            batch.future = self._pool.submit(self._generate, batch)

    def _generate(self, batch: RolloutBatch) -> None:
        start = time.perf_counter()
        batch.pending = self.generate(batch.examples, batch.index)
        batch.generate_seconds = time.perf_counter() - start

    def _finish(self, batch: RolloutBatch) -> RolloutBatch:
        """The batch with its samples: drawn here (no worker) or waited for (re-raising the
        worker's error, e.g. a server that failed for good), then gathered in this thread."""
        if batch.samples is None:
            if batch.future is None:
                self._generate(batch)
            else:
                batch.future.result()
            start = time.perf_counter()
            batch.samples, batch.greedy = batch.pending()
            batch.pending = None
            batch.generate_seconds += time.perf_counter() - start
        return batch


def staleness_metrics(batch: RolloutBatch, learner_version: int) -> dict[str, float]:
    """``rollout/staleness_{mean,max}``: updates between each sample's weights and the learner's."""
    lags = [learner_version - int(s.weight_version) for group in batch.samples for s in group]
    return {"rollout/staleness_mean": float(np.mean(lags)), "rollout/staleness_max": float(np.max(lags))}


def _encode_batch(batch: RolloutBatch) -> dict[str, Any]:
    return {"index": batch.index, "weights": batch.weights, "generate_seconds": batch.generate_seconds,
            "samples": encode_groups(batch.samples),
            "greedy": None if batch.greedy is None else encode_groups(batch.greedy)}
