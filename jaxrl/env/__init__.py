"""Agentic multi-turn RL: environments, tool calling, the python sandbox, the multi-turn driver.

docs/agentic.md walks through it. ``EnvRouter(EnvConfig, tokenizer).make(row)`` gives each row its
environment (``env.tasks``, by a row field, like reward functions); ``run_episodes(engine, envs,
rows, params)`` rolls the conversations out together, turn by turn.
"""

from __future__ import annotations

from jaxrl.errors import needs_extra

with needs_extra("jaxrl.env"):
    from jaxrl.env.base import FINISH_REASONS, Environment, EnvLimits, StepResult, truncate_tokens
    from jaxrl.env.config import BUILTIN_TOOLS, EnvConfig, EnvRouter, EnvTaskConfig
    from jaxrl.env.python_tool import Execution, PythonTool, PythonToolConfig, execute_python
    from jaxrl.env.rollout import Episode, EpisodeBatch, episode_metrics, run_episodes
    from jaxrl.env.tool_env import ObservationEncoder, ToolEnvironment
    from jaxrl.env.tools import Calculator, Tool, ToolCall, ToolResult, call_tool, evaluate_arithmetic, parse_tool_calls

__all__ = [
    "BUILTIN_TOOLS", "Calculator", "EnvConfig", "EnvLimits", "EnvRouter", "EnvTaskConfig", "Environment", "Episode",
    "EpisodeBatch", "Execution", "FINISH_REASONS", "ObservationEncoder", "PythonTool", "PythonToolConfig",
    "StepResult", "Tool", "ToolCall", "ToolEnvironment", "ToolResult", "call_tool", "episode_metrics",
    "evaluate_arithmetic", "execute_python", "parse_tool_calls", "run_episodes",
    "truncate_tokens",
]
