"""Reward functions: the interface, the math final-answer checker, format checks, per-task routing.

``build_router(RewardConfig)`` turns the config's task table into a ``SandboxedRewardRouter``:
every reward call runs in a worker process under ``reward.timeout_s`` (``jaxrl.reward.sandbox``).
A ``RewardRouter`` built from plain callables scores in-process.
"""

from __future__ import annotations

import dataclasses

from jaxrl.errors import needs_extra

# Without the [train] extra (sympy) an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.reward"):
    from jaxrl.reward.base import RewardFn, RewardResult, RewardRouter, ScoredBatch
    from jaxrl.reward.format import FormatReward
    from jaxrl.reward.math import MathAnswerReward, answers_match, extract_answer, extract_boxed
    from jaxrl.reward.sandbox import SandboxedRewardRouter, WorkerStartError, check_seconds
    from jaxrl.reward.tasks import TaskRewardConfig, build_reward


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
