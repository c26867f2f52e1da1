"""``env.tasks``: which environment each dataset row gets, like ``reward.tasks`` (docs/agentic.md#configuration).

A row's task is its ``env.task_field`` value (default ``task``, the field the reward router
reads too); rows without it use ``env.default_task``. A task's environment is the built-in
tool environment (``kind: tools``, with the tools it names) or a user's, ``kind: python`` with
``environment: "package.module:factory"``, called as ``factory(tokenizer, task_config)`` and
returning a ``jaxrl.env.Environment``. The factory is imported when the config is built, so a
bad path fails before training, naming it. Every row gets a fresh environment (they keep
per-conversation state).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping

from jaxrl.env.base import Environment, EnvLimits
from jaxrl.env.python_tool import PythonTool, PythonToolConfig
from jaxrl.env.tool_env import ToolEnvironment
from jaxrl.env.tools import Calculator, Tool
from jaxrl.reward.tasks import load_callable
from jaxrl.sandbox import jail_for

BUILTIN_TOOLS: Mapping[str, Callable[["EnvTaskConfig"], Tool]] = {
    "python": lambda task: PythonTool(task.python),
    "calculator": lambda task: Calculator(),
}


@dataclasses.dataclass(frozen=True)
class EnvTaskConfig:
    """One task's environment.

    kind: "tools" (``ToolEnvironment`` over ``tools``, built-in names: python, calculator) or
    "python" (``environment`` = "module:factory"). code_blocks: fenced ```python blocks run too.
    prompt_field: the row field with the prompt text. options: free-form settings a user
    factory may read.
    """

    kind: Literal["tools", "python"] = "tools"
    tools: tuple[str, ...] = ("python", "calculator")
    environment: str | None = None
    code_blocks: bool = False
    prompt_field: str = "prompt"
    system_prompt: str | None = None
    limits: EnvLimits = EnvLimits()
    python: PythonToolConfig = PythonToolConfig()
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("tools", "python"):
            raise ValueError(f"env task kind must be 'tools' or 'python', got {self.kind!r}")
        object.__setattr__(self, "tools", tuple(self.tools))
        unknown = sorted(set(self.tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise ValueError(f"env task tools {unknown} are not built-in tools {sorted(BUILTIN_TOOLS)}")
        if self.kind == "python" and not self.environment:
            raise ValueError("env task kind='python' needs environment='package.module:factory'")
        if self.code_blocks and "python" not in self.tools and self.kind == "tools":
            raise ValueError("env task code_blocks=true runs code blocks with the python tool; add 'python' to tools")


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """task_field: the row field naming each row's task; tasks: task -> its environment;
    default_task: for rows without the field (None: such rows are an error);
    use_chat_template: render prompts and observations with the tokenizer's template when it has one;
    tool_workers: threads that run environment steps (tool calls) between turns."""

    task_field: str = "task"
    default_task: str | None = "tools"
    tasks: dict[str, EnvTaskConfig] = dataclasses.field(default_factory=lambda: {"tools": EnvTaskConfig()})
    use_chat_template: bool = True
    tool_workers: int = 8

    def __post_init__(self):
        if not self.tasks:
            raise ValueError("env.tasks is empty; give at least one task, e.g. {tools: {kind: tools}}")
        for name, task in self.tasks.items():
            if not isinstance(task, EnvTaskConfig):
                raise TypeError(f"env.tasks.{name} must be an EnvTaskConfig, got {type(task).__name__}")
        if self.default_task is not None and self.default_task not in self.tasks:
            raise ValueError(f"env.default_task={self.default_task!r} is not in env.tasks {sorted(self.tasks)}")
        if isinstance(self.tool_workers, bool) or not isinstance(self.tool_workers, int) or self.tool_workers < 1:
            raise ValueError(f"env.tool_workers must be an integer >= 1, got {self.tool_workers!r}")


class EnvRouter:
    """A fresh environment for each row, chosen by its task (module doc)."""

    def __init__(self, config: EnvConfig, tokenizer):
        self.config, self.tokenizer = config, tokenizer
        self.factories = {name: self._factory(name, task) for name, task in config.tasks.items()}
        for name, task in config.tasks.items():
            if task.kind == "tools" and "python" in task.tools:  # refused or warned about now, not mid-rollout
                jail_for(task.python.isolation, f"env.tasks.{name}.python")

    def _factory(self, name: str, task: EnvTaskConfig) -> Callable[[], Environment]:
        if task.kind == "python":
            factory = load_callable(task.environment, what=f"env.tasks.{name}.environment")
            return lambda: self._checked(name, factory(self.tokenizer, task))
        return lambda: ToolEnvironment(
            self.tokenizer, {tool: BUILTIN_TOOLS[tool](task) for tool in task.tools}, task.limits,
            prompt_field=task.prompt_field, use_chat_template=self.config.use_chat_template,
            system_prompt=task.system_prompt, code_blocks=task.code_blocks)

    @staticmethod
    def _checked(name: str, env: Any) -> Environment:
        if not isinstance(env, Environment):
            raise TypeError(f"env.tasks.{name}.environment returned {type(env).__name__}, not a jaxrl.env.Environment")
        return env

    def task_of(self, row: Mapping) -> str:
        task = row.get(self.config.task_field, self.config.default_task)
        if task is None:
            raise ValueError(f"row has no {self.config.task_field!r} field and env.default_task is not set; known "
                             f"tasks: {sorted(self.factories)}")
        if not isinstance(task, str) or task not in self.factories:
            raise ValueError(f"row task {task!r} (field {self.config.task_field!r}) has no environment; known tasks: "
                             f"{sorted(self.factories)}")
        return task

    def make(self, row: Mapping) -> Environment:
        """A new environment for ``row`` (not yet reset)."""
        return self.factories[self.task_of(row)]()
