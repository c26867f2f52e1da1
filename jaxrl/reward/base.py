"""The reward-function interface and batch scoring with per-task dispatch (SPEC section 6).

A reward function maps one sample to a ``RewardResult``:

    fn(prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult

``row`` is the dataset row the prompt came from (its answer, task tag, ...).
``unparsable`` says that the response could not be graded at all (no final
answer found, broken format); by default the trainer masks such samples out of
the gradient instead of penalising them (Motif: auxiliary penalties add noise).
A function that raises is reported with the sample and its result is counted
as unparsable; it never stops the run.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """score: the reward (0-1 for the built-ins); unparsable: no gradable answer."""

    score: float
    unparsable: bool = False


class RewardFn(Protocol):
    def __call__(
        self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping
    ) -> RewardResult: ...


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
    """Rewards of N samples, in the order given.

    scores: [N] float32 (0 where unparsable or raised); unparsable: [N] bool
    (True also where the function raised); raised: [N] bool; tasks: the task of each sample.
    """

    scores: np.ndarray
    unparsable: np.ndarray
    raised: np.ndarray
    tasks: tuple[str, ...]


class RewardRouter:
    """Chooses a reward function per sample from a dataset field (multi-task RL, Motif).

    functions: task name -> reward function. ``task_field`` names the row field
    holding the task; rows without it use ``default_task``.
    """

    def __init__(self, functions: Mapping[str, RewardFn], task_field: str = "task", default_task: str | None = None):
        if not functions:
            raise ValueError("RewardRouter needs at least one reward function (functions={} given)")
        if default_task is not None and default_task not in functions:
            raise ValueError(
                f"RewardRouter default_task={default_task!r} has no reward function; known tasks: {sorted(functions)}"
            )
        self.functions = dict(functions)
        self.task_field = task_field
        self.default_task = default_task

    def task_of(self, row: Mapping) -> str:
        task = row.get(self.task_field, self.default_task)
        if task is None:
            raise ValueError(
                f"row has no {self.task_field!r} field and no default task is configured; "
                f"add the field or set reward.default_task to one of {sorted(self.functions)}"
            )
        if task not in self.functions:
            raise ValueError(
                f"row task {task!r} (field {self.task_field!r}) has no reward function; "
                f"known tasks: {sorted(self.functions)}"
            )
        return str(task)

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        rows: Sequence[Mapping],
        on_error: Callable[[str], None] | None = None,
    ) -> ScoredBatch:
        """Scores N samples. A raising function -> warning naming the sample, counted unparsable."""
        n = len(responses)
        if not (len(prompts) == len(response_ids) == len(rows) == n):
            raise ValueError(
                f"RewardRouter.score: prompts ({len(prompts)}), responses ({n}), response_ids "
                f"({len(response_ids)}) and rows ({len(rows)}) must have the same length"
            )
        scores = np.zeros(n, np.float32)
        unparsable = np.zeros(n, bool)
        raised = np.zeros(n, bool)
        tasks = []
        for i in range(n):
            task = self.task_of(rows[i])
            tasks.append(task)
            try:
                result = self.functions[task](prompts[i], responses[i], response_ids[i], rows[i])
                score = float(result.score)
                if not np.isfinite(score):
                    raise ValueError(f"reward is not finite: {score}")
                scores[i], unparsable[i] = score, bool(result.unparsable)
            except Exception as e:  # noqa: BLE001 - a reward bug must never kill the run.
                message = (
                    f"reward function for task {task!r} raised {type(e).__name__}: {e} on sample {i} "
                    f"(prompt={prompts[i][:200]!r}, response={responses[i][:200]!r}); counted as unparsable"
                )
                log.warning(message)
                if on_error is not None:
                    on_error(message)
                scores[i], unparsable[i], raised[i] = 0.0, True, True
        return ScoredBatch(scores=scores, unparsable=unparsable, raised=raised, tasks=tuple(tasks))
