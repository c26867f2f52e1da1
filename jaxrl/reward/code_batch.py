"""Scoring the samples of ``kind: code`` tasks as one batch: every execution in a pool, verdicts counted.

This path runs in the trainer's process, beside the judges' (``jaxrl.reward.judge_batch``), not
in the reward worker (``jaxrl.reward.sandbox``): the worker scores one sample at a time, and
a batch's executions must run side by side (HumanEval has one test program per problem, so the
parallelism spans samples). Nothing of the model's code runs here: each execution is a process
in the sandbox's jail (``jaxrl.sandbox.execute``), under its own CPU, memory, file, process and
wall-clock limits, with every process it started gone when it returns; this process only
extracts the code, starts the executions and compares their bounded output. A thread of the pool
waits on one execution, so ``workers`` executions run at once.

One ``CodeScorer.score``: each sample's code (``jaxrl.reward.code.extract_code``; none:
unparsable, score 0, counted ``no_code``), its row's tests and their executions
(``plan_runs``), all executions of the batch through one pool, then each sample's score from
its tests' verdicts: the fraction passed, or 1/0 (``scoring: all``; a sample's remaining cases
are not started after its first failure). Samples with the same code, tests and config (a
group's identical responses) share one set of executions; their verdicts count once per sample.

Metrics (``take_metrics``, summed over the ``score`` calls since the last take; the trainer logs
them as ``reward/code/...``): one count per verdict (``passed``, ``wrong_answer``, ``timeout``,
``cpu_limit``, ``memory``, ``output_limit``, ``runtime_error``, ``not_run``) over tests,
``samples``, ``no_code``, ``executions``, ``unjailed`` (executions in a plain process, under
``isolation: auto`` where the jail cannot start), ``seconds`` (wall time of the scoring) and
``executions_per_s``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

from jaxrl.reward.base import Outcome
from jaxrl.reward.code import VERDICTS, RowError, Run, extract_code, plan_runs, row_tests
from jaxrl.sandbox import execute, jail_for


@dataclasses.dataclass
class _Sample:
    """One sample's executions and, under ``scoring: all``, whether one already failed."""

    runs: list[Run]
    stop_at_failure: bool
    failed: bool = False


class CodeScorer:
    """The ``kind: code`` tasks of a reward router (``RewardRouter(scorers=...)``; module docstring).

    tasks: task name -> its ``TaskRewardConfig`` (kind code). Building one checks each task's
    ``code.sandbox.isolation`` against this machine: ``required`` without the jail raises
    ``SandboxUnavailableError`` naming the task, ``auto`` warns once, naming what is missing.
    """

    def __init__(self, tasks: Mapping):
        for name, task in tasks.items():
            jail_for(task.code.sandbox.isolation, f"reward.tasks.{name}.code.sandbox")
        self.tasks = dict(tasks)
        self.workers = max(task.code.pool_size() for task in self.tasks.values())
        self._counts: collections.Counter = collections.Counter()
        self._seconds = 0.0
        self._lock = threading.Lock()

    def row_problem(self, task: str, row: Mapping) -> tuple[str, str] | None:
        """Why ``row``'s tests cannot be read for ``task`` (a field missing or malformed), as (reason, message)."""
        try:
            row_tests(row, self.tasks[task].code)
        except RowError as e:
            return "bad_tests", f"row of task {task!r}: {e}"
        return None

    def score(self, tasks: Sequence[str], prompts: Sequence[str], responses: Sequence[str], rows: Sequence[Mapping],
              on_error: Callable[[str], None] | None = None) -> list[Outcome]:
        """One Outcome per sample: the score of its tests' verdicts, or unparsable without code.
        A row whose tests cannot be read raises ValueError naming the field (``row_problem`` first).
        ``on_error`` goes unused: a failed test is a verdict, counted, not an error of the reward."""
        start = time.perf_counter()
        planned: dict = {}
        samples = [self._plan(task, response, row, planned)
                   for task, response, row in zip(tasks, responses, rows, strict=True)]
        with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="code-reward") as pool:
            futures = {id(sample): [pool.submit(self._execute, sample, run) for run in sample.runs]
                       for sample in planned.values()}
        outcomes = []
        with self._lock:
            self._counts["samples"] += len(samples)
            for sample in samples:
                if sample is None:
                    self._counts["no_code"] += 1
                    outcomes.append(Outcome("ok", 0.0, unparsable=True))
                    continue
                found = [verdict for run in futures[id(sample)] for verdict in run.result()]
                self._counts.update(found)
                passed = found.count("passed") / len(found)
                outcomes.append(Outcome("ok", float(passed == 1.0) if sample.stop_at_failure else passed))
            self._seconds += time.perf_counter() - start
        return outcomes

    def _plan(self, task: str, response: str, row: Mapping, planned: dict) -> _Sample | None:
        """The sample's executions (None without code); the one already in ``planned`` for the same code and tests."""
        config = self.tasks[task].code
        try:
            tests = row_tests(row, config)
        except RowError as e:
            raise ValueError(f"row of task {task!r}: {e}") from e
        code = extract_code(response, config.block)
        if code is None:
            return None
        key = (config, code, tests)
        if key not in planned:
            planned[key] = _Sample(plan_runs(code, tests, config.sandbox), stop_at_failure=config.scoring == "all")
        return planned[key]

    def _execute(self, sample: _Sample, run: Run) -> list[str]:
        """The verdicts of one execution (``not_run`` after an earlier failure of the sample under ``all``)."""
        if sample.failed:
            return ["not_run"] * run.tests
        done = execute(list(run.argv), run.sandbox, run.files, what="kind: code", stdin=run.stdin)
        found = run.verdicts(done)
        with self._lock:
            self._counts["executions"] += 1
            self._counts["unjailed"] += not done.jailed
        if sample.stop_at_failure and any(v != "passed" for v in found):
            sample.failed = True
        return found

    def take_metrics(self) -> dict[str, float]:
        """The ``code/*`` metrics of the scoring since the last call (module docstring)."""
        with self._lock:
            counts, seconds = self._counts, self._seconds
            self._counts, self._seconds = collections.Counter(), 0.0
        names = (*VERDICTS, "samples", "no_code", "executions", "unjailed")
        metrics = {f"code/{name}": float(counts[name]) for name in names}
        metrics["code/seconds"] = seconds
        metrics["code/executions_per_s"] = counts["executions"] / seconds if seconds > 0 else 0.0
        return metrics

    def close(self) -> None:
        """Nothing to release: the pool lives for one ``score`` and every execution ends with it."""
