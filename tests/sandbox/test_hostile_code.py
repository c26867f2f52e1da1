"""Hostile model code against the sandbox (docs/agentic.md#the-python-sandbox): the trainer lives,
its environment stays unread, its files unchanged, and nothing of the code is left running.

Each program runs through the call a trainer makes, ``jaxrl.env.execute_python``, inside a
separate "trainer" process started with a secret in its environment and a data file in its
working directory, exactly what model code would go after. Before the jail (plain process,
network namespace only) the first program killed the trainer, the second printed the secret,
the third overwrote the data, and the setsid child outlived the call.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxrl.sandbox import probe

pytestmark = pytest.mark.skipif(probe().jail is None, reason=f"no jail on this machine: {probe().describe()}")

SECRET = "jaxrl-test-secret-7f3a"
MARKER = "86399.4321"  # a sleep length no other process of the machine uses

# name -> code; {ppid_probe} lines try both the parent seen from inside and the trainer's real pid.
PROGRAMS = {
    "kill_parent": """
        import os, signal
        for pid in (os.getppid(), TRAINER, -1):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError as e:
                print(type(e).__name__)
    """,
    "read_environ": """
        for path in ("/proc/%d/environ" % TRAINER, "/proc/1/environ", "/proc/self/environ"):
            try:
                print(open(path, "rb").read())
            except OSError as e:
                print(type(e).__name__)
    """,
    "write_files": """
        for path in ("/proc/%d/cwd/data.jsonl" % TRAINER, DATA, "/proc/%d/root%s" % (TRAINER, DATA)):
            try:
                with open(path, "w") as f:
                    f.write("hacked")
                print("wrote", path)
            except OSError as e:
                print(type(e).__name__)
    """,
    "setsid_survivor": f"""
        import os, subprocess
        subprocess.Popen(["setsid", "sleep", "{MARKER}"])
        if os.fork() == 0:
            os.setsid()
            os.execvp("sleep", ["sleep", "{MARKER}"])
        print("started")
    """,
    "fork_loop": """
        import os, time
        children = 0
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                children += 1
            except OSError as e:
                print("refused after", children, "children:", e.strerror)
                break
    """,
    "connect_to_trainer_port": """
        import socket
        try:
            socket.create_connection(("127.0.0.1", PORT), timeout=2)
            print("connected")
        except OSError as e:
            print(type(e).__name__)
    """,
    "new_user_namespace": """
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))
        print(libc.ptrace(16, 1, 0, 0), os.strerror(ctypes.get_errno()))  # PTRACE_ATTACH to pid 1
        print(subprocess.run(["unshare", "--user", "true"]).returncode)
    """,
    "look_around": """
        import os
        print(sorted(os.listdir("/")))
        print(len([p for p in os.listdir("/proc") if p.isdigit()]))
        print(os.getuid(), os.uname().nodename)
    """,
}

TRAINER = textwrap.dedent("""
    import json, os, socket, sys, textwrap
    from jaxrl.env import PythonToolConfig, execute_python
    listener = socket.create_server(("127.0.0.1", 0))
    preamble = "TRAINER = %d\\nDATA = %r\\nPORT = %d\\n" % (os.getpid(), os.path.abspath("data.jsonl"),
                                                      listener.getsockname()[1])
    config = PythonToolConfig(timeout_s=5.0, cpu_s=3, memory_mb=512, processes=16)
    results = {}
    for name, code in json.loads(sys.argv[1]).items():
        run = execute_python(preamble + textwrap.dedent(code), config)
        results[name] = {"stdout": run.stdout, "stderr": run.stderr, "exit_code": run.exit_code,
                         "timed_out": run.timed_out, "jailed": run.jailed}
    print("RESULTS " + json.dumps(results))
""")


def _marked_processes() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if MARKER in cmdline and "python" not in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def attack(tmp_path_factory):
    """Runs every program in one trainer process and returns (its exit code, results, the data file)."""
    work = tmp_path_factory.mktemp("trainer")
    data = work / "data.jsonl"
    data.write_text('{"prompt": "1+1"}\n')
    env = {**os.environ, "JAXRL_TEST_SECRET": SECRET}
    done = subprocess.run([sys.executable, "-c", TRAINER, json.dumps(PROGRAMS)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULTS ")), None)
    results = json.loads(line[len("RESULTS "):]) if line else {}
    return done, results, data


def test_the_trainer_survives_every_program(attack):
    done, results, _ = attack
    assert done.returncode == 0, done.stderr[-2000:]
    assert set(results) == set(PROGRAMS)
    assert all(r["jailed"] for r in results.values())
    # Inside, the parent is the jail's own first process (another uid), the trainer is invisible.
    assert results["kill_parent"]["stdout"].split() == ["PermissionError", "ProcessLookupError",
                                                        "ProcessLookupError"], results["kill_parent"]


def test_the_trainers_environment_is_not_readable(attack):
    _, results, _ = attack
    out = results["read_environ"]["stdout"]
    assert SECRET not in out and SECRET not in results["read_environ"]["stderr"]
    assert out.splitlines()[0] == "FileNotFoundError"  # the trainer's pid does not exist in the jail


def test_the_trainers_files_are_unchanged(attack):
    _, results, data = attack
    assert data.read_text() == '{"prompt": "1+1"}\n'
    assert "wrote" not in results["write_files"]["stdout"], results["write_files"]


def test_nothing_is_left_running(attack):
    _, results, _ = attack
    assert results["setsid_survivor"]["stdout"].strip() == "started"
    assert _marked_processes() == []


def test_a_fork_loop_stops_at_the_process_bound(attack):
    _, results, _ = attack
    out = results["fork_loop"]["stdout"]
    assert "refused after" in out and "Resource temporarily unavailable" in out, results["fork_loop"]
    # processes=16 counts the program itself: at most 15 children.
    assert int(out.split("refused after ")[1].split()[0]) <= 15


def test_the_trainers_port_is_unreachable(attack):
    _, results, _ = attack
    assert results["connect_to_trainer_port"]["stdout"].strip() == "ConnectionRefusedError"


def test_no_new_namespaces_and_no_tracing(attack):
    _, results, _ = attack
    lines = results["new_user_namespace"]["stdout"].splitlines()
    assert lines[0] == "-1 Operation not permitted" and lines[1] == "-1 Operation not permitted"
    assert lines[2] != "0"


def test_the_view_is_the_interpreter_and_a_scratch(attack):
    _, results, _ = attack
    listing, processes, identity = results["look_around"]["stdout"].splitlines()
    visible = set(ast.literal_eval(listing))
    assert visible <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr",
                       *(p.split(os.sep)[1] for p in (sys.prefix, sys.base_prefix))}
    assert int(processes) <= 3  # the jail's first process, the program (and nothing of the host)
    uid, host = identity.split()
    assert int(uid) != 0 and host == "jaxrl-sandbox"

