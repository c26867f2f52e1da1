"""Scoring the samples of judge tasks as one batch: concurrent judge calls, retries, masks, a cache, metrics.

This path runs in the trainer's process, not in the reward worker (``jaxrl.reward.sandbox``): a
judge reward executes no model text, only HTTP requests, and a batch's requests must all be in
flight at once (the worker scores one sample at a time, each under ``reward.timeout_s``). The
requests are the judge model's business (``JudgeModel``; ``jaxrl.rollout.sglang.judge`` serves
one from SGLang), so this layer holds no HTTP client.

One ``JudgeScorer.score``:

1. plan: each sample's judge prompts, by its task's kind (``jaxrl.reward.judge.JUDGE_KINDS``),
   each drawn ``judge.samples`` times (draw ``d``, with its own sampling seed); a prompt asked by
   several samples (a group's identical responses) is asked once per draw;
2. cache: a draw of a prompt the same judge (``JudgeModel.identity``: weights, version, sampling)
   already scored takes that score and sends nothing (``JudgeCache``);
3. rounds: every remaining prompt goes out at once, one ``judge`` call per judge model, the
   models side by side. A reply without a parsable score, or a request that failed for good
   (after the HTTP client's own retries), is asked again in the next round, at most
   ``judge.retries`` more times; each score is written to the cache as its round ends;
4. rewards: each judgement is its draws' scores combined by ``judge.combine``
   (``jaxrl.reward.judge_vote``), the draws without a score left out; a sample whose judgements
   all came back gets its kind's reward; one still missing a judgement (no draw scored) is
   masked (unparsable, score 0), counted (``judge/masked``) and reported with the judge's URLs
   through ``on_error``, never guessed. A judge that answered none of a batch's
   requests is dead or unreachable: ``JudgeUnavailableError`` names its URLs and stops the run
   rather than mask the whole batch.

Metrics (``take_metrics``, summed over the ``score`` calls since the last take; the trainer logs
them as ``reward/judge/...``): ``requests`` (sent, retries included), ``cache_hits``,
``failed_requests``, ``unparsable_replies``, ``failure_rate`` (the two over ``requests``),
``latency_mean_s`` and ``latency_max_s`` (per request), ``masked`` (samples), ``invalid_draws``
(draws left without a score), ``seconds`` (wall time of the judging), and the draws' agreement
(``jaxrl.reward.judge_vote.Agreement``: ``voted``, ``agreement_unanimous``, ``agreement_pairwise``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import threading
import time
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

from jaxrl.reward.base import HEAD, Outcome
from jaxrl.reward.format import FormatReward
from jaxrl.reward.judge import JUDGE_KINDS, JudgeInput, load_template, parse_judge_score, reference_score_problem
from jaxrl.reward.judge_vote import Agreement, combine_scores, draw_seed

log = logging.getLogger(__name__)


class JudgeReply(NamedTuple):
    """One judge request's end: the reply ``text``, or None and the ``error`` (naming the server's
    URL) when the request failed; ``seconds`` it took."""

    text: str | None
    error: str = ""
    seconds: float = 0.0


class JudgeModel(Protocol):
    """A served judge model (``jaxrl.rollout.sglang.judge.SGLangJudge``)."""

    @property
    def identity(self) -> str:
        """What its replies depend on besides the prompt (weights, their version, sampling): the
        cache key's judge part."""

    def judge(self, prompts: Sequence[str], seeds: Sequence[int] | None = None) -> list[JudgeReply]:
        """One reply per prompt, in order, prompt ``i`` sampled with ``seeds[i]`` when given; all
        requests in flight at once. Failed requests come back as replies with an error, they do not
        raise."""

    def describe(self) -> str:
        """Its servers' URLs, for messages."""

    def close(self) -> None: ...


class JudgeUnavailableError(RuntimeError):
    """A judge answered none of a batch's requests; the message names its URLs."""


class JudgeCache:
    """Judge scores by ``key(identity, prompt)``, in memory and, with ``path``, in a JSONL file.

    The file is read at first use (after ``--overwrite`` has cleared an earlier run's) and each
    new score is appended as its round ends, so a resumed run, or a step scored again, sends
    nothing for judgements already paid for. A torn last line (a crash mid-write) is skipped.
    """

    def __init__(self, path: str | None = None):
        self.path = path
        self._scores: dict[str, float] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def key(identity: str, prompt: str, draw: int) -> str:
        """SHA-256 of the judge's identity, the whole judge prompt (rubric, problem, response) and
        the draw's index (``judge.samples``)."""
        return hashlib.sha256(f"{identity}\0{prompt}\0draw {draw}".encode()).hexdigest()

    def _loaded(self) -> dict[str, float]:
        if self._scores is None:
            self._scores = {}
            if self.path is not None and os.path.isfile(self.path):
                with open(self.path, encoding="utf-8") as f:
                    for line in f:
                        try:
                            entry = json.loads(line)
                            self._scores[entry["key"]] = float(entry["score"])
                        except (ValueError, KeyError, TypeError):
                            continue
        return self._scores

    def get(self, key: str) -> float | None:
        with self._lock:
            return self._loaded().get(key)

    def put(self, scores: Mapping[str, float]) -> None:
        if not scores:
            return
        with self._lock:
            self._loaded().update(scores)
            if self.path is not None:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps({"key": k, "score": v}) + "\n" for k, v in scores.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._loaded())


@dataclasses.dataclass
class _Stats:
    requests: int = 0
    cache_hits: int = 0
    failed_requests: int = 0
    unparsable_replies: int = 0
    masked: int = 0
    invalid_draws: int = 0
    latency_sum: float = 0.0
    latency_max: float = 0.0
    seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        failures = self.failed_requests + self.unparsable_replies
        return {f"judge/{k}": float(v) for k, v in (
            ("requests", self.requests), ("cache_hits", self.cache_hits), ("failed_requests", self.failed_requests),
            ("unparsable_replies", self.unparsable_replies), ("failure_rate", failures / max(self.requests, 1)),
            ("latency_mean_s", self.latency_sum / max(self.requests, 1)), ("latency_max_s", self.latency_max),
            ("masked", self.masked), ("invalid_draws", self.invalid_draws), ("seconds", self.seconds))}


@dataclasses.dataclass
class _Request:
    """A draw of a distinct judge prompt of the batch: its ``judge`` (a key of the models), cache
    ``key`` (which names the draw), and how many times it may be asked in all."""

    judge: str
    prompt: str
    key: str
    tries: int
    error: str = ""


class JudgeScorer:
    """The judge tasks of a reward router (``RewardRouter(judge=...)``; module docstring).

    tasks: task name -> its ``TaskRewardConfig`` (a judge kind); models: judge name -> the
    ``JudgeModel`` serving it (every ``judge.server`` the tasks name); cache: shared by all. The
    scorer owns the models: ``close()`` closes them.
    """

    def __init__(self, tasks: Mapping, models: Mapping[str, JudgeModel], cache: JudgeCache | None = None):
        for name, task in tasks.items():
            if task.judge.server not in models:
                raise ValueError(f"reward.tasks.{name}.judge.server={task.judge.server!r} names no judge; judges: "
                                 f"{sorted(models)}")
        self.tasks, self.models = dict(tasks), dict(models)
        self.cache = cache if cache is not None else JudgeCache()
        self.templates = {name: {key: load_template(getattr(task.judge, key), f"reward.tasks.{name}.judge.{key}")
                                 for key in JUDGE_KINDS[task.kind].templates} for name, task in tasks.items()}
        self.gates = {name: FormatReward(task.pattern, task.required_phrases)
                      if task.pattern is not None or task.required_phrases else None for name, task in tasks.items()}
        self._stats, self._agreement = _Stats(), Agreement()

    def row_problem(self, task: str, row: Mapping) -> tuple[str, str] | tuple[str, str, str] | None:
        """Why the judge of ``task`` cannot grade ``row`` (a field it reads is missing or blank, a
        reference score is not 0, 0.5 or 1), as (reason, message[, detail]), or None."""
        config, kind = self.tasks[task].judge, JUDGE_KINDS[self.tasks[task].kind]
        fields = ((config.problem_field,) if config.problem_field else ()) + (
            (config.proof_field, config.score_field) if kind.graded_proof_in_row else ())
        for field in fields:
            value = row.get(field)
            if value is None or (isinstance(value, str) and not value.strip()):
                return "missing_field", (f"row of task {task!r} has no (or a blank) {field!r} field, which its "
                                         f"judge reads; fields: {sorted(map(str, row))}")
        if kind.graded_proof_in_row and (why := reference_score_problem(row[config.score_field])) is not None:
            return "bad_reference_score", f"{config.score_field!r} of a task {task!r} row must be 0, 0.5 or 1", why
        return None

    def score(self, tasks: Sequence[str], prompts: Sequence[str], responses: Sequence[str], rows: Sequence[Mapping],
              on_error: Callable[[str], None] | None = None) -> list[Outcome]:
        """One Outcome per sample: its kind's reward, or unparsable (masked) when a judgement is missing."""
        start = time.perf_counter()
        plans, requests = self._plan(tasks, prompts, responses, rows)
        scores = self._judge(list(requests.values()))
        outcomes, missing = self._outcomes(plans, requests, scores)
        self._stats.invalid_draws += sum(r.key not in scores for r in requests.values())
        self._stats.masked += sum(missing.values())
        self._stats.seconds += time.perf_counter() - start
        for judge, samples in sorted(missing.items()):
            self._report(judge, samples, [r for r in requests.values() if r.judge == judge and r.key not in scores],
                         on_error)
        return outcomes

    def _plan(self, tasks, prompts, responses, rows) -> tuple[list, dict[tuple[str, str, int], _Request]]:
        """Each sample's (judge config, ``Plan``), and the batch's distinct requests by (judge, prompt, draw)."""
        plans, requests = [], {}
        for task, prompt, response, row in zip(tasks, prompts, responses, rows, strict=True):
            config, gate = self.tasks[task].judge, self.gates[task]
            problem = prompt if config.problem_field is None else str(row[config.problem_field])
            sample = JudgeInput(problem, response, row, gate is None or gate.passes(response))
            plan = JUDGE_KINDS[self.tasks[task].kind].plan(config, self.templates[task], sample)
            plans.append((config, plan))
            for text, draw in itertools.product(plan.prompts.values(), range(config.samples)):
                request = requests.setdefault((config.server, text, draw), _Request(
                    config.server, text, JudgeCache.key(self.models[config.server].identity, text, draw), 0))
                request.tries = max(request.tries, 1 + config.retries)
        return plans, requests

    def _outcomes(self, plans, requests, scores: Mapping[str, float]) -> tuple[list[Outcome], dict[str, int]]:
        """Each sample's Outcome from its judgements (each its draws' ``combine``), the masked samples
        per judge; the draws' agreement is added to the metrics once per distinct judgement."""
        outcomes, missing, votes = [], {}, {}
        for config, plan in plans:
            passes = {}
            for name, text in plan.prompts.items():
                draws = [scores.get(requests[config.server, text, d].key) for d in range(config.samples)]
                votes[config.server, text, config.samples] = draws
                passes[name] = combine_scores(config.combine, draws)
            if any(score is None for score in passes.values()):
                missing[config.server] = missing.get(config.server, 0) + 1
                outcomes.append(Outcome("ok", 0.0, unparsable=True))
            else:
                outcomes.append(Outcome("ok", float(plan.reward(passes))))
        for draws in votes.values():
            self._agreement.add(draws)
        return outcomes, missing

    def _judge(self, requests: list[_Request]) -> dict[str, float]:
        """Scores by cache key: from the cache, then from rounds of judge calls (module docstring)."""
        scores, pending = {}, []
        for request in requests:
            cached = self.cache.get(request.key)
            if cached is None:
                pending.append(request)
            else:
                scores[request.key] = cached
                self._stats.cache_hits += 1
        asked = {r.judge for r in pending}
        answered, attempt = set(), 0
        while pending:
            replies = self._ask(pending, attempt)
            fresh, retry = {}, []
            for request, reply in zip(pending, replies, strict=True):
                score = None if reply.text is None else parse_judge_score(reply.text)
                self._count(reply, score)
                if reply.text is not None:
                    answered.add(request.judge)
                if score is not None:
                    fresh[request.key] = score
                    continue
                request.error = reply.error or f"no \\boxed{{}} score 0, 0.5 or 1 in the reply {reply.text[:HEAD]!r}"
                if attempt + 1 < request.tries:
                    retry.append(request)
            self.cache.put(fresh)
            scores.update(fresh)
            pending, attempt = retry, attempt + 1
        for judge in sorted(asked - answered):
            errors = [r.error for r in requests if r.judge == judge and r.error]
            raise JudgeUnavailableError(
                f"judge {judge!r} ({self.models[judge].describe()}) answered none of the "
                f"{sum(r.judge == judge for r in requests)} judgement requests of this batch; last error: "
                f"{errors[-1]}. Check that its servers run and that judges.{judge} points at them")
        return scores

    def _ask(self, pending: list[_Request], attempt: int) -> list[JudgeReply]:
        """The replies to try ``attempt`` of ``pending``, in order: one ``judge`` call per model, the
        models side by side, each draw sampled with its seed (``draw_seed``)."""
        judges = sorted({r.judge for r in pending})
        mine = {judge: [r for r in pending if r.judge == judge] for judge in judges}
        with concurrent.futures.ThreadPoolExecutor(len(judges), thread_name_prefix="judge") as pool:
            futures = {judge: pool.submit(self.models[judge].judge, [r.prompt for r in mine[judge]],
                                          [draw_seed(r.key, attempt) for r in mine[judge]]) for judge in judges}
            replies = {judge: iter(future.result()) for judge, future in futures.items()}
        return [next(replies[r.judge]) for r in pending]

    def _count(self, reply: JudgeReply, score: float | None) -> None:
        s = self._stats
        s.requests += 1
        s.latency_sum += reply.seconds
        s.latency_max = max(s.latency_max, reply.seconds)
        if reply.text is None:
            s.failed_requests += 1
        elif score is None:
            s.unparsable_replies += 1

    def _report(self, judge: str, samples: int, failed: list[_Request], on_error) -> None:
        message = (f"judge {judge!r} ({self.models[judge].describe()}): {len(failed)} judgement draw(s) still failed "
                   f"after {failed[0].tries} tries; {samples} sample(s) masked as unparsable; last failure: "
                   f"{failed[-1].error}")
        log.warning(message)
        if on_error is not None:
            on_error(message)

    def take_metrics(self) -> dict[str, float]:
        """The ``judge/*`` metrics of the judging since the last call (module docstring)."""
        metrics = {**self._stats.metrics(), **self._agreement.metrics()}
        self._stats, self._agreement = _Stats(), Agreement()
        return metrics

    def close(self) -> None:
        for model in self.models.values():
            model.close()
