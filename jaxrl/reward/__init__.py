"""Reward functions: the interface, the math final-answer checker, format checks, verifiable instruction
checks (IFEval's), code tests, judges, per-task routing.

``build_router(RewardConfig)`` turns the config's task table into a ``SandboxedRewardRouter``:
every reward call runs in a worker process under ``reward.timeout_s`` (``jaxrl.reward.sandbox``).
A ``RewardRouter`` built from plain callables scores in-process. Tasks of a judge kind
(``jaxrl.reward.judge``) are scored as a batch by their judge models, which the caller serves and
hands in (``judges``); tasks of ``kind: code`` as a batch of sandboxed executions run side by side
(``jaxrl.reward.code_batch``).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from jaxrl.errors import needs_extra

# Without the [train] extra (sympy) an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.reward"):
    from jaxrl.reward.base import RewardFn, RewardResult, RewardRouter, ScoredBatch
    from jaxrl.reward.code import CodeConfig, extract_code
    from jaxrl.reward.code_batch import CodeScorer
    from jaxrl.reward.format import FormatReward
    from jaxrl.reward.instructions import InstructionsConfig, InstructionsReward
    from jaxrl.reward.judge import JUDGE_KINDS, JUDGE_TEMPLATES, JudgeConfig, parse_judge_score
    from jaxrl.reward.judge_batch import JudgeCache, JudgeModel, JudgeReply, JudgeScorer, JudgeUnavailableError
    from jaxrl.reward.math import MathAnswerReward, answers_match, extract_answer, extract_boxed
    from jaxrl.reward.sandbox import SandboxedRewardRouter, WorkerStartError
    from jaxrl.reward.tasks import TaskRewardConfig, build_reward
    from jaxrl.sandbox import check_seconds


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """task_field: the row field naming each row's task; tasks: task -> its reward.

    timeout_s: the wall-clock limit of one reward-function call, in seconds. Calls run in a
    worker process; one that runs longer is killed, reported with its sample and counted
    (``reward/timed_out``) as unparsable with score 0. It also bounds each execution of a
    ``kind: code`` task: its ``code.sandbox.timeout_s`` may not exceed it.
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
        for name, task in self.tasks.items():
            if task.code is not None and task.code.sandbox.timeout_s > self.timeout_s:
                raise ValueError(f"reward.tasks.{name}.code.sandbox.timeout_s={task.code.sandbox.timeout_s:g} exceeds "
                                 f"reward.timeout_s={self.timeout_s:g}, the wall-clock limit of one reward call; "
                                 f"lower the first or raise the second")


def build_router(config: RewardConfig, judges: Mapping[str, JudgeModel] | None = None,
                 judge_cache: str | None = None) -> SandboxedRewardRouter:
    """The config's tasks behind one worker process, each call limited to ``config.timeout_s``;
    the judge tasks scored by ``judges`` (name -> model, every ``judge.server`` the tasks name),
    with their scores cached in memory and, given ``judge_cache`` (a JSONL path), on disk.

    The functions are built here too, so a ``kind: python`` spec that cannot be imported
    raises ValueError naming it now, and a ``kind: code`` task with ``isolation: required`` on a
    machine without the jail raises ``SandboxUnavailableError``. The router owns the judges. Call
    ``close()`` on it when done.
    """
    judged = {name: task for name, task in config.tasks.items() if task.kind in JUDGE_KINDS}
    coded = {name: task for name, task in config.tasks.items() if task.kind == "code"}
    scorers = ([JudgeScorer(judged, judges or {}, JudgeCache(judge_cache))] if judged else []) + (
        [CodeScorer(coded)] if coded else [])
    return SandboxedRewardRouter(
        {name: task for name, task in config.tasks.items() if name not in judged and name not in coded},
        task_field=config.task_field, default_task=config.default_task, timeout_s=config.timeout_s, scorers=scorers,
    )


__all__ = [
    "CodeConfig", "CodeScorer", "FormatReward", "InstructionsConfig", "InstructionsReward", "JUDGE_KINDS",
    "JUDGE_TEMPLATES", "JudgeCache", "JudgeConfig", "JudgeModel", "JudgeReply", "JudgeScorer", "JudgeUnavailableError",
    "MathAnswerReward", "RewardConfig", "RewardFn", "RewardResult", "RewardRouter", "SandboxedRewardRouter",
    "ScoredBatch", "TaskRewardConfig", "WorkerStartError", "answers_match", "build_reward", "build_router",
    "extract_answer", "extract_boxed", "extract_code", "parse_judge_score",
]
