"""Reward calls run in a worker process under reward.timeout_s: hangs and crashes cost a sample, not the run.

The reward functions below are referenced as f"{__name__}:name" (``kind: python``), so the
worker process imports this module: keep its imports light.
"""

import ctypes
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl.config import ConfigError, from_dict
from jaxrl.reward import RewardConfig, RewardResult, RewardRouter, TaskRewardConfig, build_router

TIMEOUT = 1.0


def length_reward(prompt, response, response_ids, row):
    """Score = len(response); "hang" sleeps forever, "spin" runs a regex that never ends (a C loop)."""
    if "hang" in response:
        time.sleep(3600)
    if "spin" in response:
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: a C loop holding the GIL
    if "raise" in response:
        raise KeyError("no such field")
    return RewardResult(float(len(response)))


def crashing_reward(prompt, response, response_ids, row):
    """ "exit" calls os._exit(1); "segv" dereferences NULL."""
    if "exit" in response:
        os._exit(1)
    if "segv" in response:
        ctypes.string_at(0)
    return RewardResult(float(len(response)))


def _router(function: str, **extra) -> RewardRouter:
    config = {"default_task": "t", "timeout_s": TIMEOUT,
              "tasks": {"t": {"kind": "python", "function": f"{__name__}:{function}"}}, **extra}
    return build_router(from_dict(RewardConfig, config))


def _score(router, responses, on_error=None):
    n = len(responses)
    return router.score([f"prompt {i}" for i in range(n)], responses, [[i] for i in range(n)], [{}] * n,
                        on_error=on_error)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def router():
    made = []
    yield lambda function, **extra: made.append(_router(function, **extra)) or made[-1]
    for r in made:
        r.close()


def test_a_hanging_reward_times_out_and_the_others_are_scored(router):
    """Before: a user reward that looped forever on one sample hung the run with no message; so did one
    stuck in a C loop (a catastrophic regex), which signal.alarm cannot interrupt."""
    r = router("length_reward")
    _score(r, ["warm"])  # the worker's first start is not part of the measured time
    errors = []
    t = time.perf_counter()
    out = _score(r, ["ok", "hang here", "good", "spin", "fine!"], on_error=errors.append)
    elapsed = time.perf_counter() - t
    np.testing.assert_array_equal(out.scores, [2, 0, 4, 0, 5])
    np.testing.assert_array_equal(out.timed_out, [False, True, False, True, False])
    np.testing.assert_array_equal(out.unparsable, out.timed_out)
    assert not out.raised.any()
    assert len(errors) == 2
    assert "sample 1" in errors[0] and "reward.timeout_s=1s" in errors[0] and "'hang here'" in errors[0]
    assert "'prompt 1'" in errors[0] and "task 't'" in errors[0] and "killed and restarted" in errors[0]
    assert "sample 3" in errors[1] and "'spin'" in errors[1]
    # Each hang costs the limit and one worker restart (about 0.5 s here), nothing more.
    assert 2 * TIMEOUT <= elapsed < 2 * TIMEOUT + 8, f"two timeouts and restarts took {elapsed:.1f}s"
    assert r.worker_starts == 3


def test_a_reward_that_kills_its_process_is_reported_and_the_others_scored(router):
    """Before: a reward calling os._exit (or segfaulting in C code) killed the trainer itself."""
    r = router("crashing_reward")
    errors = []
    out = _score(r, ["ok", "exit now", "good", "segv", "fine!"], on_error=errors.append)
    np.testing.assert_array_equal(out.scores, [2, 0, 4, 0, 5])
    np.testing.assert_array_equal(out.raised, [False, True, False, True, False])
    np.testing.assert_array_equal(out.unparsable, out.raised)
    assert not out.timed_out.any()
    assert len(errors) == 2
    assert "sample 1" in errors[0] and "exit code 1" in errors[0] and "'exit now'" in errors[0]
    assert "sample 3" in errors[1] and "SIGSEGV" in errors[1]
    assert r.worker_starts == 3


def test_the_worker_is_reused_and_raising_is_reported_as_in_process(router):
    """Before: each batch would have paid a process start (~0.3 s); a raise must still name its type."""
    r = router("length_reward")
    assert r.worker_pid is None  # started lazily
    first = _score(r, ["a", "bb"])
    pid = r.worker_pid
    errors = []
    second = _score(r, ["ccc", "raise it"], on_error=errors.append)
    assert r.worker_pid == pid and r.worker_starts == 1
    np.testing.assert_array_equal(first.scores, [1, 2])
    np.testing.assert_array_equal(second.scores, [3, 0])
    np.testing.assert_array_equal(second.raised, [False, True])
    assert len(errors) == 1 and "raised KeyError: 'no such field' on sample 1" in errors[0]


def test_close_leaves_no_process():
    """Before: nothing owned the worker; a finished run must not leave one behind."""
    r = _router("length_reward")
    r.close()  # never started: fine
    _score(r, ["x"])
    pid = r.worker_pid
    assert pid is not None and _alive(pid)
    r.close()
    r.close()  # idempotent
    assert not _alive(pid) and r.worker_pid is None
    assert _score(r, ["xy"]).scores[0] == 2  # a later call starts a fresh worker
    r.close()


def test_interpreter_exit_without_close_leaves_no_process():
    """Before: a run that ended without close() (or crashed) could leave the worker running."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from jaxrl.reward import RewardConfig, TaskRewardConfig, build_router
        r = build_router(RewardConfig(default_task="t", tasks={{"t": TaskRewardConfig(kind="format", pattern="x")}}))
        r.score(["p"], ["x"], [[]], [{{}}])
        print(r.worker_pid, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not _alive(int(done.stdout.split()[-1]))


def test_the_worker_exits_when_the_trainer_is_killed():
    """Before: a trainer killed with SIGKILL (the OOM killer) mid-batch would leave its worker running the reward."""
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path[:0] = {sys.path!r}
        from jaxrl.reward import RewardConfig, TaskRewardConfig, build_router
        task = TaskRewardConfig(kind="python", function="{__name__}:length_reward")
        r = build_router(RewardConfig(default_task="t", timeout_s=60, tasks={{"t": task}}))
        def kill_self_while_the_worker_hangs():
            while r.worker_pid is None:
                time.sleep(0.02)
            time.sleep(0.3)
            print(r.worker_pid, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_self_while_the_worker_hangs, daemon=True).start()
        r.score(["p"], ["hang"], [[]], [{{}}])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_bad_timeouts_and_unimportable_functions_fail_at_build():
    """Before: there was no limit to configure; a bad spec must still fail before training, naming it."""
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"reward\.timeout_s"):
            RewardConfig(timeout_s=bad)
    with pytest.raises(ConfigError, match=r"reward\.timeout_s"):
        from_dict(RewardConfig, {"timeout_s": 0})
    with pytest.raises(ValueError, match="'no_such_module:f' cannot be imported"):
        _router("f", tasks={"t": {"kind": "python", "function": "no_such_module:f"}})
    with pytest.raises(ValueError, match="cannot import it"):
        main_task = TaskRewardConfig(kind="python", function="__main__:f")
        build_router(RewardConfig(default_task="t", tasks={"t": main_task}))


def test_row_problem():
    """Before: rows with an unknown task or no reference answer failed (or scored 0) only once sampled."""
    config = from_dict(RewardConfig, {
        "default_task": "math",
        "tasks": {"math": {"kind": "math", "answer_field": "solution"},
                  "ifeval": {"kind": "format", "required_phrases": ["Hi"]},
                  "code": {"kind": "python", "function": f"{__name__}:length_reward"}}})
    r = build_router(config)
    assert r.row_problem({"solution": "3"}) is None
    assert r.row_problem({"task": "math", "solution": 0}) is None
    assert r.row_problem({"task": "ifeval"}) is None
    assert r.row_problem({"task": "code"}) is None
    reason, message = r.row_problem({"task": "chess"})
    assert reason == "unknown_task" and "'chess'" in message and "known tasks" in message
    assert r.row_problem({"task": ["math"]})[0] == "unknown_task"
    reason, message = r.row_problem({"answer": "3"})
    assert reason == "missing_answer" and "'solution'" in message and "'math'" in message
    assert r.row_problem({"solution": None})[0] == "missing_answer"
    assert r.row_problem({"solution": "  "})[0] == "missing_answer"
    assert r.worker_pid is None  # row_problem never starts the worker

    plain = RewardRouter({"t": length_reward})  # no default task, no answer fields: the task check alone
    assert plain.row_problem({"task": "t"}) is None
    reason, message = plain.row_problem({})
    assert reason == "unknown_task" and "no 'task' field" in message
    assert RewardRouter({"t": length_reward}, answer_fields={"t": "ref"}).row_problem({"task": "t"})[0] == (
        "missing_answer")
