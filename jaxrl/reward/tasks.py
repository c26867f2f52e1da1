"""One task's reward, from its config: the math checker, a format check, instruction checks, a user's
callable, a judge, or code tests.

Built in the reward worker process (``jaxrl.reward.sandbox``) as well as in the trainer, so
this module imports only the reward functions themselves. The judge kinds (``JUDGE_KINDS``) and
``code`` are not functions (``BATCH_KINDS``): the router scores them as a batch in the trainer's
process (``jaxrl.reward.judge_batch``, ``jaxrl.reward.code_batch``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

from jaxrl.errors import InputError
from jaxrl.reward.base import RewardFn, RewardResult
from jaxrl.reward.code import CodeConfig
from jaxrl.reward.format import FormatReward
from jaxrl.reward.instructions import InstructionsConfig, InstructionsReward
from jaxrl.reward.judge import JUDGE_KINDS, JudgeConfig
from jaxrl.reward.math import MathAnswerReward

# Every kind a task may have: the per-sample functions, then those scored as a batch (the judge
# kinds of jaxrl.reward.judge, and code).
BATCH_KINDS = (*JUDGE_KINDS, "code")
RewardKind = Literal[("math", "format", "instructions", "python", *BATCH_KINDS)]


@dataclasses.dataclass(frozen=True)
class TaskRewardConfig:
    """One task's reward.

    kind: "math" (final answer vs ``answer_field``), "format" (``pattern`` and
    ``required_phrases``), "instructions" (the row's verifiable instructions, IFEval's format;
    options in ``instructions``, IFEval's defaults without it: docs/rewards.md#kind-instructions),
    or "python" (``function`` = "module:callable", called with the reward-function signature).
    For "math", a ``pattern``/``required_phrases`` gate multiplies the score (a correct answer in
    the wrong format scores 0). checker (math):
    "normalizer" (the default: the never-evaluating normaliser alone) or "math_verify" (HF
    math-verify first, the normaliser where it cannot read an answer; it reaches Python's
    ``eval`` on answer text: docs/evaluation.md#math-answer-checking). "code": the response's
    program against the row's tests in the sandbox, scored by ``code`` (``CodeConfig``; its
    defaults when not given: docs/rewards.md#kind-code).
    """

    kind: RewardKind = "math"
    answer_field: str = "answer"
    pattern: str | None = None
    required_phrases: tuple[str, ...] = ()
    function: str | None = None
    rel_tol: float = 1e-6
    checker: Literal["math_verify", "normalizer"] = "normalizer"
    judge: JudgeConfig | None = None
    instructions: InstructionsConfig | None = None
    code: CodeConfig | None = None

    def __post_init__(self):
        if self.kind == "code" and self.code is None:
            object.__setattr__(self, "code", CodeConfig())
        if self.kind != "code" and self.code is not None:
            raise ValueError(f"code is set but kind={self.kind!r}; the code section belongs to kind='code'")
        if self.kind == "python" and not self.function:
            raise ValueError("kind='python' needs function='module:callable'")
        if self.kind == "format" and self.pattern is None and not self.required_phrases:
            raise ValueError("kind='format' needs pattern or required_phrases")
        if self.kind in JUDGE_KINDS and self.judge is None:
            raise ValueError(f"kind={self.kind!r} needs a judge section (judge.server at least)")
        if self.kind not in JUDGE_KINDS and self.judge is not None:
            raise ValueError(f"judge is set but kind={self.kind!r} asks no judge; judge kinds: {list(JUDGE_KINDS)}")
        if self.judge is not None:
            self.judge.check_templates(self.kind)
        if self.instructions is not None and self.kind != "instructions":
            raise ValueError(f"instructions is set but kind={self.kind!r}; it configures kind='instructions' only")
        if self.kind == "instructions" and (self.pattern is not None or self.required_phrases):
            raise ValueError("kind='instructions' takes no pattern or required_phrases: name a format "
                             "instruction in the rows (detectable_format:*, startend:*) or use kind='format'")


class _Gated:
    """A reward multiplied by a format gate."""

    def __init__(self, inner: RewardFn, gate: FormatReward):
        self.inner, self.gate = inner, gate

    def __call__(self, prompt, response, response_ids, row) -> RewardResult:
        result = self.inner(prompt, response, response_ids, row)
        if result.unparsable or self.gate.passes(response):
            return result
        return RewardResult(score=0.0, unparsable=False)


def load_callable(spec: str, what: str = "reward function"):
    """The object named by "package.module:attribute"; ``InputError`` (exit 2 at the command line)
    naming ``what`` and ``spec`` when it cannot be imported, including an error the module raises
    while it is imported (also used for user environments, ``jaxrl.env.config``)."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise InputError(f"{what} {spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is theirs to fix, named here
        raise InputError(f"{what} {spec!r} cannot be imported: {type(e).__name__}: {e}; check the module is on "
                         f"PYTHONPATH (or installed) and imports cleanly") from e
    if not hasattr(module, attr):
        raise InputError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def build_reward(task: TaskRewardConfig, key: str = "reward function") -> RewardFn:
    """The per-sample reward function of ``task``; ValueError for a kind of ``BATCH_KINDS`` (no such function).
    ``key``: how a ``kind: python`` function that cannot be imported is named in the error."""
    if task.kind in JUDGE_KINDS:
        raise ValueError(f"kind={task.kind!r} is scored by a judge over the whole batch, not by a per-sample "
                         f"function: build the router with jaxrl.reward.build_router(config, judges=...)")
    if task.kind == "code":
        raise ValueError("kind='code' runs the batch's programs side by side, not by a per-sample function: build "
                         "the router with jaxrl.reward.build_router(config)")
    if task.kind == "python":
        return load_callable(task.function, key)
    if task.kind == "format":
        return FormatReward(task.pattern, task.required_phrases)
    if task.kind == "instructions":
        return InstructionsReward(task.instructions or InstructionsConfig())
    math = MathAnswerReward(task.answer_field, task.rel_tol, task.checker)
    if task.pattern is not None or task.required_phrases:
        return _Gated(math, FormatReward(task.pattern, task.required_phrases))
    return math
