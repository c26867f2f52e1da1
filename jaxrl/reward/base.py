"""The reward-function interface and batch scoring with per-task dispatch (docs/training.md#rewards).

A reward function maps one sample to a ``RewardResult``:

    fn(prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult

``row`` is the dataset row the prompt came from (its answer, task tag, ...).
``unparsable`` says that the response could not be graded at all (no final
answer found, broken format); by default the trainer masks such samples out of
the gradient instead of penalising them (Motif: auxiliary penalties add noise).
A function that raises is reported with the sample and its result is counted
as unparsable; it never stops the run.

Per-token rewards (for PPO with a critic, ``advantage.estimator: gae``): a function may also
return ``token_rewards``, one float per response token (``len(response_ids)``), whose sum is
``score``; the trainer then puts reward ``token_rewards[j]`` on response token ``j`` instead of
the whole score on the last token. A wrong length, a non-finite entry or a sum that is not
``score`` is a bug in the function: the call counts as raised and is reported with the task
and the sample, like an exception.

``RewardRouter`` here calls the functions in this process (tests, notebooks, plain
callables). ``jaxrl.reward.build_router`` returns its subclass
``jaxrl.reward.sandbox.SandboxedRewardRouter``, which calls them in a worker process under
``reward.timeout_s`` so that a hanging or crashing reward cannot stop the run either.
Tasks of a judge kind and of ``kind: code`` are not functions: a router's ``scorers``
(``jaxrl.reward.judge_batch.JudgeScorer``, ``jaxrl.reward.code_batch.CodeScorer``) score
their samples as one batch, here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

HEAD = 200  # characters of the prompt and response quoted in a report
# What the built-in rewards score in (math, format and the judges); a kind: python reward may differ.
BUILTIN_REWARD_RANGE = (0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """score: the reward (0-1 for the built-ins); unparsable: no gradable answer; token_rewards:
    optional per-token rewards, one per response token, summing to ``score`` (module docstring)."""

    score: float
    unparsable: bool = False
    token_rewards: Sequence[float] | None = None


class RewardFn(Protocol):
    """A reward function: a ``RewardResult``, or a plain number as its score (parsable)."""

    def __call__(
        self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping
    ) -> RewardResult | float: ...


@dataclasses.dataclass(frozen=True)
class ScoredBatch:
    """Rewards of N samples, in the order given.

    scores: [N] float32 (0 where unparsable, raised or timed out); unparsable: [N] bool
    (True also where the function raised or timed out); raised: [N] bool (the function
    raised, returned a non-finite score, or killed its worker process); timed_out: [N] bool
    (the call exceeded ``reward.timeout_s`` and was killed; all False in-process);
    tasks: the task of each sample; token_rewards: per sample, the function's per-token rewards
    ([len(response_ids)] float32) or None where it gave none (or the call failed).
    """

    scores: np.ndarray
    unparsable: np.ndarray
    raised: np.ndarray
    tasks: tuple[str, ...]
    timed_out: np.ndarray | None = None
    token_rewards: tuple[np.ndarray | None, ...] | None = None

    def __post_init__(self):
        if self.timed_out is None:
            object.__setattr__(self, "timed_out", np.zeros(len(self.raised), bool))
        if self.token_rewards is None:
            object.__setattr__(self, "token_rewards", (None,) * len(self.raised))


class Outcome(NamedTuple):
    """What one reward call came to.

    kind: "ok" (``score``, ``unparsable``, ``token_rewards`` set), "raised" (``error`` = "Type:
    message"), "timed_out", or "died" (``error`` describes how the worker process ended).
    A plain tuple of picklable values, so it crosses the sandbox's pipe as it is.
    """

    kind: str
    score: float = 0.0
    unparsable: bool = False
    error: str = ""
    token_rewards: tuple[float, ...] | None = None


def call_reward(fn: RewardFn, prompt, response, response_ids, row) -> Outcome:
    """Calls ``fn`` on one sample; an exception, a non-finite score or bad ``token_rewards``
    (:func:`check_token_rewards`) -> a "raised" outcome."""
    try:
        result = fn(prompt, response, response_ids, row)
        if isinstance(result, (int, float, np.integer, np.floating)) and not isinstance(result, (bool, np.bool_)):
            result = RewardResult(score=float(result))  # a bare number is the score, as most reward code returns
        elif not hasattr(result, "score"):
            raise TypeError(f"the reward function returned {type(result).__name__} {_clip(repr(result), 60)}; "
                            f"return a number or jaxrl.reward.RewardResult(score=...)")
        score, unparsable = float(result.score), bool(result.unparsable)
        if not np.isfinite(score):
            raise ValueError(f"reward is not finite: {score}")
        token_rewards = getattr(result, "token_rewards", None)
        if token_rewards is not None:
            token_rewards = check_token_rewards(token_rewards, score, len(response_ids))
    except Exception as e:  # noqa: BLE001 - a reward bug must never kill the run.
        return Outcome("raised", error=describe_exception(e))
    return Outcome("ok", score, unparsable, token_rewards=token_rewards)


def check_token_rewards(token_rewards, score: float, length: int) -> tuple[float, ...]:
    """``token_rewards`` as a tuple of floats; ValueError unless it holds one finite number per
    response token (``length``) and sums to ``score`` (relative and absolute tolerance 1e-5)."""
    values = np.asarray(token_rewards, np.float64)
    if values.ndim != 1 or len(values) != length:
        raise ValueError(f"token_rewards has shape {values.shape} but the response has {length} tokens; "
                         f"give one reward per response token (len(response_ids))")
    if not np.isfinite(values).all():
        raise ValueError(f"token_rewards holds non-finite values: {values.tolist()[:8]}")
    total = float(values.sum())
    if abs(total - score) > 1e-5 * max(1.0, abs(score)):
        raise ValueError(f"token_rewards sum to {total:.6g} but score is {score:.6g}; the score must be their sum")
    return tuple(float(v) for v in values)


# A reward error's message reaches the log once per sample: a message that holds a whole
# response (or a loop's worth of text) would bury everything else.
MAX_ERROR_CHARS = 500


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def describe_exception(e: BaseException) -> str:
    """``Type: message``, the message cut at MAX_ERROR_CHARS characters."""
    try:
        text = str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error type.
        text = "<message not printable>"
    return f"{type(e).__name__}: {_clip(text, MAX_ERROR_CHARS)}"


class RewardRouter:
    """Chooses a reward function per sample from a dataset field (multi-task RL, Motif).

    functions: task name -> reward function. ``task_field`` names the row field
    holding the task; rows without it use ``default_task``. ``answer_fields``: task ->
    the row field its reward needs (the math reference answer); ``row_problem`` flags
    rows without it. Functions run in this process, without a time limit: use
    ``jaxrl.reward.build_router`` (a ``SandboxedRewardRouter``) for that. ``scorers``: batch
    scorers (``jaxrl.reward.judge_batch.JudgeScorer`` for the judge kinds,
    ``jaxrl.reward.code_batch.CodeScorer`` for ``kind: code``), each scoring its ``tasks`` with
    ``score``, ``row_problem``, ``take_metrics`` and ``close``; the router owns them (``close``) and
    ``take_metrics`` returns their ``judge/*`` and ``code/*`` metrics.
    """

    timeout_s: float | None = None

    def __init__(
        self,
        functions: Mapping[str, RewardFn],
        task_field: str = "task",
        default_task: str | None = None,
        answer_fields: Mapping[str, str] | None = None,
        scorers: Sequence = (),
    ):
        self.batched = {task: scorer for scorer in scorers for task in scorer.tasks}
        known = sorted({*functions, *self.batched})
        if not known:
            raise ValueError("RewardRouter needs at least one reward function or batch-scored task (none given)")
        if default_task is not None and default_task not in known:
            raise ValueError(f"RewardRouter default_task={default_task!r} has no reward function; known tasks: {known}")
        unknown = sorted(set(answer_fields or {}) - set(functions))
        if unknown:
            raise ValueError(f"RewardRouter answer_fields names tasks {unknown} that have no reward function")
        self.functions = dict(functions)
        self.known = known
        self.task_field = task_field
        self.default_task = default_task
        self.answer_fields = dict(answer_fields or {})
        self.scorers = tuple(scorers)

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
                f"add the field or set reward.default_task to one of {self.known}"
            )
        try:
            known = task in self.functions or task in self.batched
        except TypeError:  # an unhashable value (a list, a dict) in the task field
            known = False
        if not known:
            return (
                f"row task {task!r} (field {self.task_field!r}) has no reward function; "
                f"known tasks: {self.known}"
            )
        return None

    def row_problem(self, row: Mapping) -> tuple[str, str] | None:
        """Why this row cannot be graded, as (reason, message), or None when it can.

        reason "unknown_task": no task field and no default task, or a task without a
        reward function; "missing_answer": the task's reward needs ``answer_fields[task]``
        (the math reference answer) and the row lacks it, or it is null or blank; for a judge or
        code task, its scorer's own reasons (``row_problem``); for a reward function with a
        ``row_problem(row)`` method of its own (``kind: instructions``), what that returns. Meant for
        the data loader, to skip such rows with their file and line before training.
        """
        problem = self._task_problem(row)
        if problem is not None:
            return "unknown_task", problem
        task = row.get(self.task_field, self.default_task)
        if task in self.batched:
            return self.batched[task].row_problem(task, row)
        field = self.answer_fields.get(task)
        if field is not None:
            value = row.get(field)
            if value is None or (isinstance(value, str) and not value.strip()):
                state = "no" if field not in row else ("a null" if value is None else "a blank")
                return "missing_answer", (
                    f"row of task {task!r} has {state} {field!r} field (the reference answer its reward "
                    f"compares against); fields: {sorted(map(str, row))}"
                )
        own_check = getattr(self.functions[task], "row_problem", None)
        return own_check(row) if own_check is not None else None

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
        outcomes = self._outcomes(tasks, prompts, responses, response_ids, rows, on_error)
        scores = np.zeros(n, np.float32)
        unparsable = np.zeros(n, bool)
        raised = np.zeros(n, bool)
        timed_out = np.zeros(n, bool)
        token_rewards: list[np.ndarray | None] = [None] * n
        for i, (task, outcome) in enumerate(zip(tasks, outcomes, strict=True)):
            if outcome.kind == "ok":
                scores[i], unparsable[i] = outcome.score, outcome.unparsable
                if outcome.token_rewards is not None:
                    token_rewards[i] = np.asarray(outcome.token_rewards, np.float32)
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
                           timed_out=timed_out, token_rewards=tuple(token_rewards))

    def _outcomes(self, tasks, prompts, responses, response_ids, rows, on_error) -> list[Outcome]:
        """One Outcome per sample: each batch scorer's tasks' from it, as one batch; the others' from
        their functions (``_call_all``)."""
        if not any(task in self.batched for task in tasks):
            return self._call_all(tasks, prompts, responses, response_ids, rows)
        outcomes: list[Outcome | None] = [None] * len(tasks)

        def pick(items, indices):
            return [items[i] for i in indices]

        for scorer in self.scorers:
            mine = [i for i, task in enumerate(tasks) if self.batched.get(task) is scorer]
            if mine:
                found = scorer.score(*(pick(x, mine) for x in (tasks, prompts, responses, rows)), on_error=on_error)
                for i, outcome in zip(mine, found, strict=True):
                    outcomes[i] = outcome
        plain = [i for i, task in enumerate(tasks) if task not in self.batched]
        if plain:
            found = self._call_all(*(pick(x, plain) for x in (tasks, prompts, responses, response_ids, rows)))
            for i, outcome in zip(plain, found, strict=True):
                outcomes[i] = outcome
        return outcomes

    def take_metrics(self) -> dict[str, float]:
        """The batch scorers' metrics (``judge/*``, ``code/*``) since the last call; {} without any."""
        return {name: value for scorer in self.scorers for name, value in scorer.take_metrics().items()}

    def _call_all(self, tasks, prompts, responses, response_ids, rows) -> list[Outcome]:
        """One Outcome per sample; here, in this process."""
        return [
            call_reward(self.functions[task], prompts[i], responses[i], response_ids[i], rows[i])
            for i, task in enumerate(tasks)
        ]

    def close(self) -> None:
        """Releases worker processes (none in-process) and the scorers' (the judges' models); safe to call more
        than once."""
        for scorer in self.scorers:
            scorer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
