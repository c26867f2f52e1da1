"""The sandbox every execution of model output runs in (docs/agentic.md#the-python-sandbox).

``execute(argv, SandboxConfig(...), files)`` runs a command on model-written code: in a jail of
its own (``jail.py``: namespaces, its own uid, seccomp, an empty read-only root, a private
scratch) under CPU, memory, file, process and wall-clock limits, with every process it started
gone when it returns (``execute.py``). The python tool and the code reward run in it;
``probe()`` says what this machine allows, ``Jail.contain`` holds the reward workers.
"""

from jaxrl.sandbox.execution import (
    Execution, SandboxConfig, SandboxUnavailableError, check_seconds, contain, execute, jail_for,
)
from jaxrl.sandbox.jail import Jail, Probe, command_status, find_bwrap, probe

__all__ = ["Execution", "Jail", "Probe", "SandboxConfig", "SandboxUnavailableError", "check_seconds", "command_status",
           "contain", "execute", "find_bwrap", "jail_for", "probe"]
