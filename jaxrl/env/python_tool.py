"""The ``python`` tool: model-written code in the sandbox (docs/agentic.md#the-python-sandbox).

Each call runs ``python -I main.py`` through ``jaxrl.sandbox.execute`` with the call's code as
``main.py``: a fresh process in a jail of its own (namespaces, its own uid, seccomp, an empty
read-only root with the interpreter, a private scratch), under CPU, memory, file, process and
wall-clock limits, and nothing it started left running when the call returns. The tool's
limits are the sandbox's (``PythonToolConfig`` is ``SandboxConfig``; ``isolation`` says what
happens on a machine that cannot build the jail).
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Mapping

from jaxrl.env.tools import ToolResult
from jaxrl.sandbox import Execution, SandboxConfig, execute

# The python tool's limits are the sandbox's: one config, one set of checks.
PythonToolConfig = SandboxConfig


def execute_python(code: str, config: SandboxConfig = SandboxConfig()) -> Execution:
    """Runs ``code`` as ``main.py`` in the sandbox under ``config``; never raises for anything the
    code does (``SandboxUnavailableError`` only for ``isolation: required`` on a machine without the jail)."""
    return execute([sys.executable, "-I", "main.py"], config, {"main.py": code}, what="the python tool")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def describe_execution(run: Execution, config: PythonToolConfig) -> ToolResult:
    """The observation text of an execution: its output, and how it ended when not cleanly."""
    parts = [run.stdout.rstrip("\n")] if run.stdout.strip() else []
    if run.stderr.strip():
        parts.append(f"[stderr]\n{run.stderr.rstrip()}")
    failed = run.timed_out or run.exit_code != 0
    if run.timed_out:
        parts.append(f"Error: the code ran past the {config.timeout_s:g} s time limit and was killed")
    elif run.cpu_limit:
        parts.append(f"Error: the code used more than {config.cpu_s} s of CPU time and was killed")
    elif run.exit_code == -signal.SIGXFSZ:
        parts.append(f"Error: the code wrote more than {config.file_size_mb} MB to one file and was killed")
    elif run.exit_code < 0:
        parts.append(f"Error: the code was killed by signal {_signal_name(-run.exit_code)}")
    elif run.exit_code != 0:
        parts.append(f"Error: exit code {run.exit_code}")
    return ToolResult("\n".join(parts) if parts else "(no output)", error=failed, timed_out=run.timed_out)


class PythonTool:
    """The ``python`` tool: ``{"code": "..."}`` runs in ``execute_python``; its stdout, stderr and
    how it ended are the observation."""

    name = "python"
    description = "Runs Python 3 code in a fresh sandboxed process and returns its stdout and stderr."
    parameters = {"code": "string"}

    def __init__(self, config: SandboxConfig = SandboxConfig()):
        self.config = config

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        return describe_execution(execute_python(arguments["code"], self.config), self.config)
