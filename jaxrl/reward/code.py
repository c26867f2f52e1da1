"""``kind: code``: the model's program against a row's tests, one test's verdict at a time (docs/rewards.md#kind-code).

This module holds what one sample needs, without running anything: the config (``CodeConfig``),
the code taken from the response (``extract_code``), the row's tests (``row_tests``), the
sandboxed executions that run them (``plan_runs``) and each test's verdict from an execution
(``Run.verdicts``). ``jaxrl.reward.code_batch`` runs the executions of a whole batch in a pool.

The code: the last fenced block of the response tagged ``python`` (``py``, ``python3``) or not
tagged at all (``block: first`` takes the first); a block must be closed. A response without one
has no code: unparsable, score 0.

The tests, from the row, in the two formats datasets use:

- stdin/stdout cases (APPS, CodeContests, LiveCodeBench): ``cases_field`` holds a list of
  ``{"input", "output"}`` (or the column form ``{"input": [...], "output": [...]}``, APPS's
  ``inputs``/``outputs``, or either as a JSON string). Each case is one execution of the
  program as ``main.py`` with the input on stdin; it passes when it exits 0 and its stdout
  equals the output, line by line, trailing whitespace of each line and trailing blank lines
  ignored (what those benchmarks' checkers forgive).
- assertions against a function (HumanEval, MBPP): ``test_field`` with ``entry_point_field``
  (HumanEval: code defining ``check(candidate)``, called with the entry point; the row's
  ``prompt_field``, the function's signature, imports and helpers, is put before the code, so
  a response holding a body or a whole function both run) or ``test_list_field`` (MBPP: a list
  of assert statements, each its own test, after ``setup_field``). One execution per sample:
  a harness runs the program and then each test in its namespace, and reports each test's
  verdict on a channel of its own, signed with a random token the program is not given, so a
  program that exits early (``sys.exit(0)``, ``os._exit(0)``) passes nothing.

Verdicts (``VERDICTS``): passed, wrong_answer (other output, a failed assert), timeout (wall
clock), cpu_limit, memory (``MemoryError``), output_limit (a file or the output past
``file_size_mb``), runtime_error (an exception, a crash, an early exit), not_run (``scoring:
all`` stops a sample at its first failed case).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import signal
import sys
from typing import Literal, Mapping, NamedTuple

from jaxrl.sandbox import Execution, SandboxConfig

VERDICTS = ("passed", "wrong_answer", "timeout", "cpu_limit", "memory", "output_limit", "runtime_error", "not_run")
_PYTHON_TAGS = ("", "python", "py", "python3", "py3")
_BLOCK = re.compile(r"^[ \t]*```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class CodeConfig:
    """The ``code`` section of a ``kind: code`` task (module docstring for the formats).

    scoring: "fraction" (tests passed / tests) or "all" (1 when every test passes, else 0; a
    sample's remaining cases are not run after its first failure). block: "last" or "first"
    fenced python block. cases_field, test_field, entry_point_field, prompt_field (None: nothing
    put before the code), test_list_field, setup_field: the row fields of the two formats.
    workers: executions in flight at once (0: one per core of this machine); the code tasks of
    a router share one pool, as large as the largest. sandbox: the limits of each execution
    (``jaxrl.sandbox.SandboxConfig``); its ``timeout_s`` may not exceed ``reward.timeout_s``.
    """

    scoring: Literal["fraction", "all"] = "fraction"
    block: Literal["last", "first"] = "last"
    cases_field: str = "test_cases"
    test_field: str = "test"
    entry_point_field: str = "entry_point"
    prompt_field: str | None = "prompt"
    test_list_field: str = "test_list"
    setup_field: str = "test_setup_code"
    workers: int = 0
    sandbox: SandboxConfig = SandboxConfig()

    def __post_init__(self):
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ValueError(f"code.workers must be an integer >= 0 (0: one per core), got {self.workers!r}")

    def pool_size(self) -> int:
        return self.workers or len(os.sched_getaffinity(0))


def extract_code(response: str, block: str = "last") -> str | None:
    """The code of the ``block`` ("last" or "first") closed fenced block tagged python or untagged; None without one."""
    found = [m.group(2) for m in _BLOCK.finditer(response) if m.group(1).lower() in _PYTHON_TAGS]
    if not found:
        return None
    return found[-1] if block == "last" else found[0]


class RowError(ValueError):
    """A row whose tests cannot be read; the message names the field."""


class StdioCase(NamedTuple):
    input: str
    output: str


class AssertTests(NamedTuple):
    """The program's ``before`` and ``after`` (the prompt, the setup) and its tests (code, each)."""

    before: str
    after: str
    tests: tuple[str, ...]


def row_tests(row: Mapping, config: CodeConfig) -> tuple[StdioCase, ...] | AssertTests:
    """The row's tests in the first format it holds (cases, then ``test``, then ``test_list``); RowError otherwise."""
    if row.get(config.cases_field) is not None:
        return _stdio_cases(row[config.cases_field], config.cases_field)
    if row.get(config.test_field) is not None:
        test, entry = _text(row, config.test_field), _text(row, config.entry_point_field)
        if not entry.isidentifier():
            raise RowError(f"row field {config.entry_point_field!r} must name the function under test, got {entry!r}")
        before = _text(row, config.prompt_field) if config.prompt_field and row.get(config.prompt_field) else ""
        return AssertTests(before, "", (f"{test}\n\ncheck({entry})\n",))
    if row.get(config.test_list_field) is not None:
        tests = row[config.test_list_field]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
            raise RowError(f"row field {config.test_list_field!r} must be a non-empty list of assert statements "
                           f"(text), got {str(tests)[:200]!r}")
        setup = row.get(config.setup_field) or ""
        return AssertTests("", "\n".join(setup) if isinstance(setup, list) else str(setup), tuple(tests))
    raise RowError(f"row has none of the test fields of kind: code ({config.cases_field!r}, {config.test_field!r} "
                   f"with {config.entry_point_field!r}, {config.test_list_field!r}); fields: {sorted(map(str, row))}")


def _text(row: Mapping, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"row field {field!r} must be non-blank text, got {str(value)[:200]!r}")
    return value


def _stdio_cases(value, field: str) -> tuple[StdioCase, ...]:
    """A list of {"input", "output"}, or the column form, either maybe as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise RowError(f"row field {field!r} is text but not JSON ({e})") from e
    if isinstance(value, Mapping):
        inputs, outputs = value.get("input", value.get("inputs")), value.get("output", value.get("outputs"))
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise RowError(f"row field {field!r} in column form needs equally long 'input' and 'output' lists")
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(value, list) or not value:
        raise RowError(f"row field {field!r} must be a non-empty list of {{'input', 'output'}} cases")
    return tuple(_case(case, field, n) for n, case in enumerate(value))


def _case(case, field: str, n: int) -> StdioCase:
    if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
        raise RowError(f"row field {field!r}: case {n} must hold 'input' and 'output', got {str(case)[:200]!r}")
    parts = [case["input"], case["output"]]
    for i, part in enumerate(parts):
        if isinstance(part, list) and all(isinstance(line, str) for line in part):
            parts[i] = "\n".join(part)  # APPS writes some outputs as a list of lines
        elif not isinstance(part, str):
            raise RowError(f"row field {field!r}: case {n}'s {('input', 'output')[i]} must be text, got {part!r:.200}")
    return StdioCase(*parts)


def same_output(actual: str, expected: str) -> bool:
    """Equal line by line, trailing whitespace of each line and trailing blank lines ignored."""
    def lines(text: str) -> list[str]:
        kept = [line.rstrip() for line in text.splitlines()]
        while kept and not kept[-1]:
            kept.pop()
        return kept
    return lines(actual) == lines(expected)


# The assertion harness (run as ``python -I -c``): reads its token from stdin and closes it, keeps
# the real stdout for its reports and points the program's own output at stderr, runs the
# program and then each test in one namespace, one signed line per test, and leaves with
# os._exit so that no atexit hook or thread of the program runs after the verdicts. Its state
# lives in main()'s locals, not in __main__, where the program would find the token by name.
_HARNESS = """\
import errno, json, os, sys
def verdict(error):
    if isinstance(error, AssertionError):
        return "wrong_answer"
    if isinstance(error, MemoryError):
        return "memory"
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return "output_limit"
    return "runtime_error"
def main():
    token = sys.stdin.readline().strip()
    sys.stdin = open(os.devnull)
    os.dup2(sys.stdin.fileno(), 0)
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with open("tests.json") as f:
        spec = json.load(f)
    namespace = {"__name__": "solution"}
    try:
        exec(compile(spec["program"], "solution.py", "exec"), namespace)
        failed = None
    except BaseException as error:
        failed = verdict(error)
    for i, test in enumerate(spec["tests"]):
        outcome = failed
        if failed is None:
            try:
                exec(compile(test, "test_%d.py" % i, "exec"), namespace)
                outcome = "passed"
            except BaseException as error:
                outcome = verdict(error)
        report.write("%s %d %s\\n" % (token, i, outcome))
        report.flush()
main()
os._exit(0)
"""


@dataclasses.dataclass(frozen=True)
class Run:
    """One sandboxed execution and how to read it: ``tests`` verdicts, from the stdout ``expected``
    (a stdin/stdout case) or from the harness's lines signed ``token`` (assertions)."""

    argv: tuple[str, ...]
    files: Mapping[str, str]
    stdin: str
    sandbox: SandboxConfig
    tests: int
    expected: str | None = None
    token: str | None = None

    def verdicts(self, run: Execution) -> list[str]:
        """One verdict per test of this execution (``VERDICTS``)."""
        if self.expected is not None:
            if not run.timed_out and run.exit_code == 0:
                return ["passed" if same_output(run.stdout, self.expected) else "wrong_answer"]
            return [_failure(run)]
        found: dict[int, str] = {}
        for line in run.stdout.splitlines():
            token, _, rest = line.partition(" ")
            index, _, outcome = rest.partition(" ")
            if token == self.token and index.isdigit() and outcome in VERDICTS:
                found.setdefault(int(index), outcome)
        # A test without its line never finished: the execution's end says why.
        return [found.get(i) or _failure(run) for i in range(self.tests)]


def _failure(run: Execution) -> str:
    """Why an execution that did not finish normally failed."""
    if run.timed_out:
        return "timeout"
    if run.cpu_limit:
        return "cpu_limit"
    if run.exit_code == -signal.SIGXFSZ or "File too large" in run.stderr:
        return "output_limit"
    if "MemoryError" in run.stderr:
        return "memory"
    return "runtime_error"


def plan_runs(code: str, tests: tuple[StdioCase, ...] | AssertTests, sandbox: SandboxConfig) -> list[Run]:
    """The executions that run ``tests`` on ``code``: one per stdin/stdout case, or one for all assertions.

    Each captures enough output to hold its expected text twice over (``max_output_chars`` at
    least), so a long right answer is not cut into a wrong one."""
    if isinstance(tests, AssertTests):
        program = f"{tests.before}\n{code}\n{tests.after}\n"
        token = secrets.token_hex(16)
        cut = dataclasses.replace(sandbox, max_output_chars=max(sandbox.max_output_chars, 64 * len(tests.tests)))
        return [Run((sys.executable, "-I", "-c", _HARNESS), {"tests.json": json.dumps(
            {"program": program, "tests": list(tests.tests)})}, token + "\n", cut, len(tests.tests), token=token)]
    return [Run((sys.executable, "-I", "main.py"), {"main.py": code}, case.input,
                dataclasses.replace(sandbox, max_output_chars=max(sandbox.max_output_chars, 2 * len(case.output))), 1,
                expected=case.output) for case in tests]
