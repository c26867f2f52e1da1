"""The tool-call parser, the calculator, and the python sandbox's limits (docs/agentic.md#tools)."""

import os
import signal
import time

import pytest

from jaxrl.env.python_tool import describe_execution
from jaxrl.env import (
    Calculator, PythonToolConfig, ToolCall, call_tool, evaluate_arithmetic, execute_python,
    network_isolation, parse_tool_calls,
)

TOOLS = {"calculator": Calculator()}
LIMITS = PythonToolConfig(timeout_s=3.0, cpu_s=1, memory_mb=256)


def test_parser_reads_well_formed_calls_in_order():
    text = ('first <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> then '
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    calls = parse_tool_calls(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("python", {"code": "print(1)"}, None)]


def test_parser_reports_malformed_calls_instead_of_raising():
    text = ("<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
            '<tool_call>{"name": "calculator"')
    errors = [c.error for c in parse_tool_calls(text)]
    assert len(errors) == 5 and all(errors)
    assert "not valid JSON" in errors[0] and "JSON object" in errors[1] and '"name"' in errors[2]
    assert '"arguments"' in errors[3] and "never closed" in errors[4]
    assert parse_tool_calls("no calls here, ```python\nprint(1)\n```") == []


def test_parser_reads_fenced_code_blocks_when_asked():
    calls = parse_tool_calls("look:\n```python\nprint(6 * 7)\n```\nand ```py\nx = 1\n```", code_blocks=True)
    assert [(c.name, c.arguments["code"]) for c in calls] == [("python", "print(6 * 7)\n"), ("python", "x = 1\n")]


def test_bad_calls_become_error_results():
    results = [call_tool(TOOLS, call) for call in (
        ToolCall(error="broken"), ToolCall(name="search", arguments={"q": "x"}),
        ToolCall(name="calculator", arguments={"expr": "1"}),
        ToolCall(name="calculator", arguments={"expression": 5}),
        ToolCall(name="calculator", arguments={"expression": "1/0"}))]
    assert all(r.error for r in results)
    assert "unknown tool 'search'" in results[1].text and "missing ['expression']" in results[2].text
    assert "must be a string" in results[3].text and "ZeroDivisionError" in results[4].text


def test_calculator_is_arithmetic_only_and_bounded():
    assert evaluate_arithmetic("2 * (3 + 4) - 10 // 3") == 11
    assert evaluate_arithmetic("2 ** -1") == 0.5
    for bad in ("__import__('os').system('true')", "10 ** 10 ** 10", "x + 1", "-" * 2000 + "1", "[1, 2]"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)


def _group_alive(pgid: int, within_s: float = 5.0) -> bool:
    """Any non-zombie process left in process group ``pgid`` (zombies hold nothing but a pid) once
    ``within_s`` has passed. SIGKILL reaches the group at once, but a member dies when the kernel
    next runs it: on a loaded machine the sandbox's orphaned ``sleep`` was seen still on its way
    out right after ``execute_python`` returned, so the check allows the kernel that long."""
    deadline = time.monotonic() + within_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _group_members(pgid)


def _group_members(pgid: int) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _tool_dirs() -> set[str]:
    import tempfile
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("jaxrl-python-tool-")}


@pytest.fixture
def private_tempdir(tmp_path, monkeypatch):
    """This test's own temporary root: the suite runs sandboxes in other workers at the same time,
    and their folders in the shared /tmp were read as this sandbox's leftovers (seen in CI)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_sandbox_runs_code_and_captures_output(private_tempdir):
    run = execute_python("import os, sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nprint(os.getcwd())", LIMITS)
    assert run.exit_code == 0 and run.stdout.splitlines()[0] == "42" and run.stderr == "oops\n"
    workdir = run.stdout.splitlines()[1]
    assert workdir.startswith(str(private_tempdir) + "/jaxrl-python-tool-") and not os.path.exists(workdir)
    assert not _tool_dirs()


@pytest.mark.parametrize("code, what", [
    ("while True:\n    pass", "cpu"),
    ("import subprocess, time\nsubprocess.Popen(['sleep', '60'])\ntime.sleep(60)", "wall"),
    ("x = bytearray(8 * 1024 ** 3)", "memory"),
    ("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 20))", "memory"),
], ids=["cpu-loop", "sleep-with-child", "one-huge-allocation", "growing-allocations"])
def test_sandbox_kills_runaways_and_leaves_nothing_behind(code, what, private_tempdir):
    start = time.perf_counter()
    run = execute_python(code, LIMITS)
    elapsed = time.perf_counter() - start
    result = describe_execution(run, LIMITS)
    assert result.error
    # What ended each run is in its exit status; the time bound only shows it ended long before the
    # code would have on its own (60 s, or never), with room for a loaded CI machine's start-up.
    assert elapsed < 30
    if what == "cpu":
        assert run.cpu_limit and run.exit_code == -signal.SIGXCPU and not run.timed_out
    elif what == "wall":
        assert run.timed_out and result.timed_out
    else:
        assert "MemoryError" in run.stderr and not run.timed_out
    assert not _group_alive(run.pid), "a process of the sandbox's group is still running"
    assert not _tool_dirs(), "the sandbox's temporary directory was not removed"


def test_output_flood_is_cut_with_a_marker():
    run = execute_python("print('x' * 100000)", LIMITS)
    assert run.stdout.endswith(f"[... output truncated at {LIMITS.max_output_chars} characters]")
    assert len(run.stdout) < LIMITS.max_output_chars + 100


def test_network_is_unreachable_when_isolated():
    code = "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('connected')\n" \
           "except OSError as e:\n    print('no network', e.errno)"
    run = execute_python(code, LIMITS)
    if network_isolation() is None:
        pytest.skip("this machine cannot create a network namespace (documented in docs/agentic.md)")
    assert run.network_isolated and run.stdout.startswith("no network")
