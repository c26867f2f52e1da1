"""The reward-function interface and batch scoring with per-task dispatch (docs/training.md#rewards).

A reward function maps one sample to a ``RewardResult``:

    fn(prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult

``row`` is the dataset row the prompt came from (its answer, task tag, ...).
``unparsable`` says that the response could not be graded at all (no final
answer found, broken format); by default the trainer masks such samples out of
the gradient instead of penalising them (Motif: auxiliary penalties add noise).
A function that raises is reported with the sample and its result is counted
as unparsable; it never stops the run.

``RewardRouter`` here calls the functions in this process (tests, notebooks, plain
callables). ``jaxrl.reward.build_router`` returns its subclass
``jaxrl.reward.sandbox.SandboxedRewardRouter``, which calls them in a worker process under
``reward.timeout_s`` so that a hanging or crashing reward cannot stop the run either.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

HEAD = 200  # characters of the prompt and response quoted in a report


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

    scores: [N] float32 (0 where unparsable, raised or timed out); unparsable: [N] bool
    (True also where the function raised or timed out); raised: [N] bool (the function
    raised, returned a non-finite score, or killed its worker process); timed_out: [N] bool
    (the call exceeded ``reward.timeout_s`` and was killed; all False in-process);
    tasks: the task of each sample.
    """

    scores: np.ndarray
    unparsable: np.ndarray
    raised: np.ndarray
    tasks: tuple[str, ...]
    timed_out: np.ndarray | None = None

    def __post_init__(self):
        if self.timed_out is None:
            object.__setattr__(self, "timed_out", np.zeros(len(self.raised), bool))


class Outcome(NamedTuple):
    """What one reward call came to.

    kind: "ok" (``score``, ``unparsable`` set), "raised" (``error`` = "Type: message"),
    "timed_out", or "died" (``error`` describes how the worker process ended).
    """

    kind: str
    score: float = 0.0
    unparsable: bool = False
    error: str = ""


def call_reward(fn: RewardFn, prompt, response, response_ids, row) -> Outcome:
    """Calls ``fn`` on one sample; an exception or a non-finite score -> a "raised" outcome."""
    try:
        result = fn(prompt, response, response_ids, row)
        score, unparsable = float(result.score), bool(result.unparsable)
        if not np.isfinite(score):
            raise ValueError(f"reward is not finite: {score}")
    except Exception as e:  # noqa: BLE001 - a reward bug must never kill the run.
        return Outcome("raised", error=describe_exception(e))
    return Outcome("ok", score, unparsable)


def describe_exception(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error type.
        text = "<message not printable>"
    return f"{type(e).__name__}: {text}"


class RewardRouter:
    """Chooses a reward function per sample from a dataset field (multi-task RL, Motif).

    functions: task name -> reward function. ``task_field`` names the row field
    holding the task; rows without it use ``default_task``. ``answer_fields``: task ->
    the row field its reward needs (the math reference answer); ``row_problem`` flags
    rows without it. Functions run in this process, without a time limit: use
    ``jaxrl.reward.build_router`` (a ``SandboxedRewardRouter``) for that.
    """

    timeout_s: float | None = None

    def __init__(
        self,
        functions: Mapping[str, RewardFn],
        task_field: str = "task",
        default_task: str | None = None,
        answer_fields: Mapping[str, str] | None = None,
    ):
        if not functions:
            raise ValueError("RewardRouter needs at least one reward function (functions={} given)")
        if default_task is not None and default_task not in functions:
            raise ValueError(
                f"RewardRouter default_task={default_task!r} has no reward function; known tasks: {sorted(functions)}"
            )
        unknown = sorted(set(answer_fields or {}) - set(functions))
        if unknown:
            raise ValueError(f"RewardRouter answer_fields names tasks {unknown} that have no reward function")
        self.functions = dict(functions)
        self.task_field = task_field
        self.default_task = default_task
        self.answer_fields = dict(answer_fields or {})

    def task_of(self, row: Mapping) -> str:
        problem = self._task_problem(row)
        if problem is not None:
            raise ValueError(problem)
        return str(row.get(self.task_field, self.default_task))

    def _task_problem(self, row: Mapping) -> str | None:
        task = row.get(self.task_field, self.default_task)
        if task is None:
            return (
                f"row has no {self.task_field!r} field and no default task is configured; "
                f"add the field or set reward.default_task to one of {sorted(self.functions)}"
            )
        try:
            known = task in self.functions
        except TypeError:  # an unhashable value (a list, a dict) in the task field
            known = False
        if not known:
            return (
                f"row task {task!r} (field {self.task_field!r}) has no reward function; "
                f"known tasks: {sorted(self.functions)}"
            )
        return None

    def row_problem(self, row: Mapping) -> tuple[str, str] | None:
        """Why this row cannot be graded, as (reason, message), or None when it can.

        reason "unknown_task": no task field and no default task, or a task without a
        reward function; "missing_answer": the task's reward needs ``answer_fields[task]``
        (the math reference answer) and the row lacks it, or it is null or blank. Meant for
        the data loader, to skip such rows with their file and line before training.
        """
        problem = self._task_problem(row)
        if problem is not None:
            return "unknown_task", problem
        task = row.get(self.task_field, self.default_task)
        field = self.answer_fields.get(task)
        if field is not None:
            value = row.get(field)
            if value is None or (isinstance(value, str) and not value.strip()):
                state = "no" if field not in row else ("a null" if value is None else "a blank")
                return "missing_answer", (
                    f"row of task {task!r} has {state} {field!r} field (the reference answer its reward "
                    f"compares against); fields: {sorted(map(str, row))}"
                )
        return None

    def score(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        rows: Sequence[Mapping],
        on_error: Callable[[str], None] | None = None,
    ) -> ScoredBatch:
        """Scores N samples. A raising (or, sandboxed, timed-out or crashing) function ->
        a warning naming the sample, passed to ``on_error`` too, and counted unparsable with score 0.

        A row whose task has no reward function raises ValueError (check ``row_problem`` first).
        """
        n = len(responses)
        if not (len(prompts) == len(response_ids) == len(rows) == n):
            raise ValueError(
                f"RewardRouter.score: prompts ({len(prompts)}), responses ({n}), response_ids "
                f"({len(response_ids)}) and rows ({len(rows)}) must have the same length"
            )
        tasks = [self.task_of(row) for row in rows]
        outcomes = self._call_all(tasks, prompts, responses, response_ids, rows)
        scores = np.zeros(n, np.float32)
        unparsable = np.zeros(n, bool)
        raised = np.zeros(n, bool)
        timed_out = np.zeros(n, bool)
        for i, (task, outcome) in enumerate(zip(tasks, outcomes, strict=True)):
            if outcome.kind == "ok":
                scores[i], unparsable[i] = outcome.score, outcome.unparsable
                continue
            unparsable[i] = True
            sample = f"on sample {i} (prompt={prompts[i][:HEAD]!r}, response={responses[i][:HEAD]!r})"
            if outcome.kind == "timed_out":
                timed_out[i] = True
                message = (
                    f"reward function for task {task!r} exceeded reward.timeout_s={self.timeout_s:g}s {sample}; "
                    f"its worker process was killed and restarted; counted as unparsable"
                )
            elif outcome.kind == "died":
                raised[i] = True
                message = (
                    f"reward function for task {task!r} killed its worker process ({outcome.error}) {sample}; "
                    f"the worker was restarted; counted as unparsable"
                )
            else:
                raised[i] = True
                message = f"reward function for task {task!r} raised {outcome.error} {sample}; counted as unparsable"
            log.warning(message)
            if on_error is not None:
                on_error(message)
        return ScoredBatch(scores=scores, unparsable=unparsable, raised=raised, tasks=tuple(tasks),
                           timed_out=timed_out)

    def _call_all(self, tasks, prompts, responses, response_ids, rows) -> list[Outcome]:
        """One Outcome per sample; here, in this process."""
        return [
            call_reward(self.functions[task], prompts[i], responses[i], response_ids[i], rows[i])
            for i, task in enumerate(tasks)
        ]

    def close(self) -> None:
        """Releases worker processes (none in-process); safe to call more than once."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
