"""Reward functions: the interface, the math final-answer checker, format checks, per-task routing.

``build_router(RewardConfig)`` turns the config's task table into a ``SandboxedRewardRouter``:
every reward call runs in a worker process under ``reward.timeout_s`` (``jaxrl.reward.sandbox``).
A ``RewardRouter`` built from plain callables scores in-process.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

from jaxrl.reward.base import RewardFn, RewardResult, RewardRouter, ScoredBatch
from jaxrl.reward.format import FormatReward
from jaxrl.reward.math import MathAnswerReward, answers_match, extract_answer, extract_boxed
from jaxrl.reward.sandbox import SandboxedRewardRouter, WorkerStartError, check_seconds


@dataclasses.dataclass(frozen=True)
class TaskRewardConfig:
    """One task's reward.

    kind: "math" (final answer vs ``answer_field``), "format" (``pattern`` and
    ``required_phrases``), or "python" (``function`` = "module:callable", called with
    the reward-function signature). For "math", a ``pattern``/``required_phrases``
    gate multiplies the score (a correct answer in the wrong format scores 0).
    """

    kind: Literal["math", "format", "python"] = "math"
    answer_field: str = "answer"
    pattern: str | None = None
    required_phrases: tuple[str, ...] = ()
    function: str | None = None
    rel_tol: float = 1e-6

    def __post_init__(self):
        if self.kind == "python" and not self.function:
            raise ValueError("kind='python' needs function='module:callable'")
        if self.kind == "format" and self.pattern is None and not self.required_phrases:
            raise ValueError("kind='format' needs pattern or required_phrases")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """task_field: the row field naming each row's task; tasks: task -> its reward.

    timeout_s: the wall-clock limit of one reward-function call, in seconds. Calls run in a
    worker process; one that runs longer is killed, reported with its sample and counted
    (``reward/timed_out``) as unparsable with score 0.
    """

    task_field: str = "task"
    default_task: str | None = "math"
    tasks: dict[str, TaskRewardConfig] = dataclasses.field(default_factory=lambda: {"math": TaskRewardConfig()})
    mask_unparsable: bool = True
    timeout_s: float = 10.0

    def __post_init__(self):
        check_seconds("reward.timeout_s", self.timeout_s)
        if not self.tasks:
            raise ValueError("reward.tasks is empty; give at least one task, e.g. {math: {kind: math}}")
        if self.default_task is not None and self.default_task not in self.tasks:
            raise ValueError(f"reward.default_task={self.default_task!r} is not in reward.tasks {sorted(self.tasks)}")


class _Gated:
    """A reward multiplied by a format gate."""

    def __init__(self, inner: RewardFn, gate: FormatReward):
        self.inner, self.gate = inner, gate

    def __call__(self, prompt, response, response_ids, row) -> RewardResult:
        result = self.inner(prompt, response, response_ids, row)
        if result.unparsable or self.gate.passes(response):
            return result
        return RewardResult(score=0.0, unparsable=False)


def _load_callable(spec: str) -> RewardFn:
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"reward function {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {spec!r} cannot be imported: {e}") from e


def build_reward(task: TaskRewardConfig) -> RewardFn:
    if task.kind == "python":
        return _load_callable(task.function)
    if task.kind == "format":
        return FormatReward(task.pattern, task.required_phrases)
    math = MathAnswerReward(task.answer_field, task.rel_tol)
    if task.pattern is not None or task.required_phrases:
        return _Gated(math, FormatReward(task.pattern, task.required_phrases))
    return math


def build_router(config: RewardConfig) -> SandboxedRewardRouter:
    """The config's tasks behind one worker process, each call limited to ``config.timeout_s``.

    The functions are built here too, so a ``kind: python`` spec that cannot be imported
    raises ValueError naming it now. Call ``close()`` on the router when done.
    """
    return SandboxedRewardRouter(
        config.tasks, task_field=config.task_field, default_task=config.default_task, timeout_s=config.timeout_s,
    )


__all__ = [
    "FormatReward", "MathAnswerReward", "RewardConfig", "RewardFn", "RewardResult", "RewardRouter",
    "SandboxedRewardRouter", "ScoredBatch", "TaskRewardConfig", "WorkerStartError", "answers_match",
    "build_reward", "build_router", "extract_answer", "extract_boxed",
]
