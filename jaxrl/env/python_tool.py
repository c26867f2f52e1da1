"""The ``python`` tool: model-written code in a fresh, limited process (docs/agentic.md#the-python-sandbox).

Each execution is its own process, so nothing survives from one call to the next:
- started with ``subprocess`` (exec of a fresh interpreter, never ``fork`` of the multithreaded
  trainer, and no ``preexec_fn``, which is unsafe with threads: the limits are set by a small
  boot script in the child before the model's code is read), in a new session, so a kill of its
  process group takes the subprocesses the code started;
- under ``resource`` limits set soft = hard so the code cannot raise them: CPU time
  (RLIMIT_CPU; SIGXCPU, then SIGKILL a second later), address space (RLIMIT_AS, so a memory
  bomb gets MemoryError), file size (RLIMIT_FSIZE, which also caps the captured output, written
  to files rather than pipes so a flood cannot fill the parent's memory) and no core dumps;
- under a wall-clock limit: past it the whole process group is killed (SIGKILL);
- in a fresh ``tempfile.TemporaryDirectory`` as working directory and HOME, deleted afterwards;
- with ``python -I`` (no user site, no PYTHONPATH) and a minimal environment;
- without network where the machine allows it: in a new network namespace (``unshare --net``
  as root, ``unshare --user --map-root-user --net`` otherwise), which has only a down loopback.
  ``network_isolation()`` probes once which works; when neither does, ``PythonToolConfig.network``
  "auto" runs without isolation (reported as ``network_isolated=False``) and "required" refuses.

Not guaranteed: a process that leaves the session (``setsid``) escapes the group kill; the
limits are per process, so code that forks N children may use N times them until the wall
limit; files written outside the working directory (e.g. /tmp) are not removed. This is a
guard against runaway model code, not a security boundary against a hostile one: run
untrusted code inside a container or VM as well.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Literal, Mapping

from jaxrl.env.tools import ToolResult
from jaxrl.reward.sandbox import check_seconds, kill_process_group

# Runs in the child before the model's code: the limits first, then main.py from the working directory.
_BOOT = (
    "import resource, sys\n"
    "cpu, memory, fsize = (int(v) for v in sys.argv[1:4])\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (memory, memory))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "sys.argv = ['main.py']\n"
    "source = open('main.py').read()\n"
    "del cpu, memory, fsize, resource\n"
    "exec(compile(source, 'main.py', 'exec'), {'__name__': '__main__'})\n"
)
_ISOLATION_COMMANDS = (("unshare", "--net", "--"), ("unshare", "--user", "--map-root-user", "--net", "--"))


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[str, ...] | None:
    """The command prefix that runs a program in a new network namespace here, or None when the
    machine allows none (no ``unshare``, no privileges, user namespaces disabled). Probed once."""
    if shutil.which("unshare") is None:
        return None
    for prefix in _ISOLATION_COMMANDS:
        try:
            probe = subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return None


@dataclasses.dataclass(frozen=True)
class PythonToolConfig:
    """Limits of one code execution.

    timeout_s: wall clock; cpu_s: CPU seconds (RLIMIT_CPU, whole seconds); memory_mb: address
    space (RLIMIT_AS; the interpreter itself takes about 30 MB, numpy about 100 MB more);
    file_size_mb: largest file the code may write, its captured output included;
    max_output_chars: stdout and stderr each cut to this many characters (with a marker);
    network: "auto" (isolate when the machine allows it), "required" (refuse to run otherwise),
    "off" (never isolate).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_chars: int = 4000
    network: Literal["auto", "required", "off"] = "auto"

    def __post_init__(self):
        check_seconds("python tool timeout_s", self.timeout_s)
        for name in ("cpu_s", "memory_mb", "file_size_mb", "max_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"python tool {name} must be an integer >= 1, got {value!r}")
        if self.network not in ("auto", "required", "off"):
            raise ValueError(f"python tool network must be 'auto', 'required' or 'off', got {self.network!r}")


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one execution came to. exit_code: the process's (negative: killed by that signal);
    timed_out: killed at the wall-clock limit; cpu_limit: killed at the CPU limit;
    pid: the process (and process group) id, gone when this is returned."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    cpu_limit: bool
    network_isolated: bool
    pid: int
    seconds: float


def _read_cut(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)  # utf-8 is at most 4 bytes a character
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        return text[:limit] + f"\n[... output truncated at {limit} characters]"
    return text


def execute_python(code: str, config: PythonToolConfig = PythonToolConfig()) -> Execution:
    """Runs ``code`` under ``config``'s limits (module doc) and returns its output; never raises
    for anything the code does (RuntimeError only when network isolation is required and absent)."""
    isolation = () if config.network == "off" else network_isolation()
    if isolation is None and config.network == "required":
        raise RuntimeError("python tool network='required' but this machine cannot create a network namespace "
                           "(unshare --net and unshare --user --net both failed); set network: auto to run "
                           "without isolation")
    isolation = isolation or ()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxrl-python-tool-") as root:
        work, out = os.path.join(root, "work"), os.path.join(root, "out")
        os.mkdir(work)
        os.mkdir(out)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        stdout_path, stderr_path = os.path.join(out, "stdout"), os.path.join(out, "stderr")
        limits = (config.cpu_s, config.memory_mb << 20, config.file_size_mb << 20)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                [*isolation, sys.executable, "-I", "-c", _BOOT, *map(str, limits)], cwd=work, env=env,
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Always: the code's own subprocesses die with it, even when it exited normally.
            kill_process_group(proc)
        status = proc.returncode if proc.returncode is not None else -signal.SIGKILL
        return Execution(
            stdout=_read_cut(stdout_path, config.max_output_chars),
            stderr=_read_cut(stderr_path, config.max_output_chars),
            exit_code=status, timed_out=timed_out, cpu_limit=status in (-signal.SIGXCPU, -signal.SIGKILL) and not
            timed_out, network_isolated=bool(isolation), pid=proc.pid, seconds=time.perf_counter() - start)


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
        parts.append(f"Error: the code was killed by signal {signal.Signals(-run.exit_code).name}")
    elif run.exit_code != 0:
        parts.append(f"Error: exit code {run.exit_code}")
    return ToolResult("\n".join(parts) if parts else "(no output)", error=failed, timed_out=run.timed_out)


class PythonTool:
    """The ``python`` tool: ``{"code": "..."}`` runs in ``execute_python``; its stdout, stderr and
    how it ended are the observation."""

    name = "python"
    description = "Runs Python 3 code in a fresh sandboxed process and returns its stdout and stderr."
    parameters = {"code": "string"}

    def __init__(self, config: PythonToolConfig = PythonToolConfig()):
        self.config = config

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        return describe_execution(execute_python(arguments["code"], self.config), self.config)
