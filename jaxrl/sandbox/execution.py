"""One execution of model-written code: a fresh jailed process, its limits, its output, nothing left.

``execute(argv, config, files)`` runs ``argv`` and returns an ``Execution``; it never raises for
anything the command does. Each execution is its own process tree, so nothing survives from one
call to the next:

- in the jail of ``jail.py`` (namespaces, its own uid, seccomp, an empty read-only root, a
  private tmpfs ``/tmp`` of ``scratch_mb`` holding ``files`` as its working directory), started
  with ``subprocess`` (exec of bubblewrap, never a ``fork`` of the multithreaded trainer);
- under limits the command cannot raise (soft = hard, set by the jail's boot before the command
  starts): CPU seconds (SIGXCPU, then SIGKILL a second later), address space (a memory bomb
  gets MemoryError), file size (which also caps the captured output), ``processes`` processes
  and threads for the whole execution (a fork loop fails with EAGAIN), no core files;
- under a wall-clock limit: past it the namespace's first process is killed, and with it, by
  the kernel, every process of the execution. After a normal exit the same happens, so a
  background or ``setsid`` child never outlives the call; ``execute`` returns only once the
  namespace is empty;
- with ``stdin`` (text, empty by default) read from a memory file, and stdout and stderr written
  to memory files (a flood cannot fill the trainer's memory), each read back cut to
  ``max_output_chars`` with a visible marker.

``isolation``: "auto" runs in the jail when it starts here and otherwise in a plain process
(limits, its own session and a temporary working directory, as jaxrl did before the jail),
after one warning naming what is missing (``jail.probe``); "required" raises
``SandboxUnavailableError`` with the same list instead; "off" always runs a plain process.
A plain process is a guard against runaway code, not a boundary: it runs as the trainer's
user, sees its files, network and processes, and its ``setsid`` children escape the kill.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import select
import signal
import subprocess
import tempfile
import time
from typing import Literal, Mapping

from jaxrl.errors import InputError
from jaxrl.process_groups import kill_group
from jaxrl.sandbox import seccomp
from jaxrl.sandbox.jail import Jail, Limits, boot_argv, command_status, jail_uid, probe

log = logging.getLogger(__name__)
_warned: set[str] = set()


def check_seconds(name: str, value) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one execution (module docstring).

    timeout_s: wall clock; cpu_s: CPU seconds (whole seconds); memory_mb: address space of each
    process (the interpreter itself takes about 30 MB, numpy about 100 MB more); file_size_mb:
    largest file the code may write, its captured output included; processes: processes and
    threads the execution may run at once, itself included; scratch_mb: size of its private
    /tmp (in memory); max_output_chars: stdout and stderr each cut to this many characters;
    isolation: "auto", "required" or "off" (module docstring).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    processes: int = 16
    scratch_mb: int = 64
    max_output_chars: int = 4000
    isolation: Literal["auto", "required", "off"] = "auto"

    def __post_init__(self):
        check_seconds("sandbox timeout_s", self.timeout_s)
        for name in ("cpu_s", "memory_mb", "file_size_mb", "processes", "scratch_mb", "max_output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"sandbox {name} must be an integer >= 1, got {value!r}")
        if self.isolation not in ("auto", "required", "off"):
            raise ValueError(f"sandbox isolation must be 'auto', 'required' or 'off', got {self.isolation!r}")


class SandboxUnavailableError(InputError):
    """``isolation: required`` and the jail cannot start on this machine; the message names the
    key and what is missing (an ``InputError``: the CLIs print it in one line and exit 2)."""


@dataclasses.dataclass(frozen=True)
class Execution:
    """What one execution came to. exit_code: the command's (negative: killed by that signal; a
    jailed command's exit code above 128 reads as a signal, as in a shell); timed_out: killed at
    the wall-clock limit; cpu_limit: killed at the CPU limit; jailed: ran in the jail (False: a
    plain process, see ``isolation``); pid: the process started (bubblewrap's in the jail), gone
    with all of the execution's processes when this is returned."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    cpu_limit: bool
    jailed: bool
    pid: int
    seconds: float


def jail_for(isolation: str, what: str) -> Jail | None:
    """The jail ``isolation`` asks for (None: a plain process); ``what`` names the caller in the
    warning (auto) or the error (required) that says what this machine lacks."""
    if isolation == "off":
        return None
    found = probe()
    if found.missing and isolation == "required":
        raise SandboxUnavailableError(f"{what} has isolation: required, but this machine lacks {found.describe()}; "
                                      f"provide it, or set isolation: auto to run with less")
    if found.missing and "jail" not in _warned:  # once per process: the first caller's name stands for all
        _warned.add("jail")
        fallback = "in a plain process (limits only: it can reach the trainer's files, network and processes)" \
            if found.jail is None else "in a jail without it"
        log.warning("%s runs model code %s: this machine lacks %s", what, fallback, found.describe())
    return found.jail


def contain(argv: list[str], what: str) -> tuple[list[str], bool]:
    """``argv`` in a PID namespace of its own (``Jail.contain``: the host's files, network and
    identity), so that every process it starts ends with it, and True; ``argv`` itself and False,
    after one warning naming ``what`` and what is missing, where the machine allows no jail."""
    found = probe()
    if found.jail is not None:
        return found.jail.contain(argv), True
    if "contain" not in _warned:
        _warned.add("contain")
        log.warning("%s runs without a PID namespace of its own: a process it starts in a new session can outlive "
                    "it (this machine lacks %s)", what, found.describe())
    return argv, False


def _memory_file(name: str, content: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if content:
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_cut(fd: int, limit: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 4 * limit + 4)  # utf-8 is at most 4 bytes a character
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        return text[:limit] + f"\n[... output truncated at {limit} characters]"
    return text


def _namespace_pid(info_fd: int, deadline: float) -> int | None:
    """The pid of the namespace's first process, from bwrap's --info-fd JSON (None: bwrap failed)."""
    data, decoder = b"", json.JSONDecoder()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(info_fd, 4096)
        if not chunk:
            return None
        data += chunk
        try:
            return int(decoder.raw_decode(data.decode().lstrip())[0]["child-pid"])
        except ValueError:
            continue
    return None


def _end_namespace(pidfd: int) -> None:
    """Kills the namespace's first process (the kernel then kills the rest) and waits until it
    is gone, which the kernel allows only once every other process of the namespace is."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    select.select([pidfd], [], [], 10.0)


def _environment(home: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def execute(argv: list[str], config: SandboxConfig = SandboxConfig(), files: Mapping[str, str] = {},
            what: str = "the sandbox", stdin: str = "") -> Execution:
    """Runs ``argv`` (its working directory holds ``files``: name -> text; ``stdin`` its input)
    under ``config`` (module docstring); ``what`` names the caller in the isolation warning or error."""
    jail = jail_for(config.isolation, what)
    limits = Limits(cpu_s=config.cpu_s, memory_bytes=config.memory_mb << 20, file_bytes=config.file_size_mb << 20,
                    processes=config.processes if jail is not None else Limits.processes)
    start = time.perf_counter()
    stdout, stderr = _memory_file("stdout"), _memory_file("stderr")
    streams = (_memory_file("stdin", stdin.encode()) if stdin else subprocess.DEVNULL, stdout, stderr)
    try:
        if jail is None:
            status, timed_out, pid = _run_plain(argv, config, limits, files, streams)
        else:
            status, timed_out, pid = _run_jailed(jail, argv, config, limits, files, streams)
        return Execution(
            stdout=_read_cut(stdout, config.max_output_chars), stderr=_read_cut(stderr, config.max_output_chars),
            exit_code=status, timed_out=timed_out,
            cpu_limit=status in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out,
            jailed=jail is not None, pid=pid, seconds=time.perf_counter() - start)
    finally:
        for fd in streams:
            if fd != subprocess.DEVNULL:
                os.close(fd)


def _run_jailed(jail: Jail, argv, config, limits, files, streams) -> tuple[int, bool, int]:
    file_fds = {name: _memory_file(name, text.encode()) for name, text in files.items()}
    seccomp_fd = seccomp.filter_fd(jail.seccomp) if jail.seccomp else None
    info_read, info_write = os.pipe()
    passed = [info_write, *file_fds.values(), *([seccomp_fd] if seccomp_fd is not None else [])]
    command = jail.command(boot_argv(argv, limits, jail_uid() if jail.privileged else -1), config.scratch_mb << 20,
                           info_write, seccomp_fd, file_fds)
    pidfd = None
    try:
        proc = subprocess.Popen(command, env=_environment("/tmp"), stdin=streams[0], stdout=streams[1],
                                stderr=streams[2], pass_fds=passed, start_new_session=True)
        os.close(info_write)
        passed.remove(info_write)
        deadline = time.monotonic() + config.timeout_s
        pid = _namespace_pid(info_read, deadline)
        if pid is not None:
            pidfd = os.pidfd_open(pid)
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        if pidfd is not None:
            _end_namespace(pidfd)
        kill_group(proc)
    finally:
        for fd in (info_read, *passed, *([pidfd] if pidfd is not None else [])):
            os.close(fd)
    status = command_status(proc.returncode) if proc.returncode is not None else -signal.SIGKILL
    return status, timed_out, proc.pid


def _run_plain(argv, config, limits, files, streams) -> tuple[int, bool, int]:
    with tempfile.TemporaryDirectory(prefix="jaxrl-sandbox-") as work:
        for name, text in files.items():
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        proc = subprocess.Popen(boot_argv(argv, limits), cwd=work, env=_environment(work), stdin=streams[0],
                                stdout=streams[1], stderr=streams[2], start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        kill_group(proc)  # always: the code's own subprocesses die with it, even after a clean exit
    status = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    return status, timed_out, proc.pid
