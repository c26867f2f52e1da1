"""Generative verifier rewards (DeepSeekMath-V2; docs/training.md#generative-verifier-rewards).

Plain unit tests of the score parser, the template slots, the reward formulas, the configs and the
cache; then the judge against a real CPU SGLang server (``.venv-sglang``) serving a constructed
judge whose replies are known: a Qwen3 checkpoint whose greedy decoding is a bigram program
(``write_bigram_checkpoint``), with a character tokenizer in which each verdict is one token. The
token last in the judge's prompt decides the reply, and every template puts the graded text last,
so a response ending in ``A`` gets ``\\boxed{1}``, ``B`` ``\\boxed{0}``, ``C`` ``\\boxed{0.5}``, ``D`` a
reply without a box; any other character gets ``VERDICTS[ord(c) % 4]``; after ``E`` the four verdicts
tie, so a judge sampled at temperature 1 draws one of them at random (scaled verification). Requests
are counted and recorded by an HTTP proxy in front of the server (closing it makes a dead judge).
Last, one RL step of the trainer with a judge task.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import re
import socket
import string
import threading

import numpy as np
import pytest
import requests

from jaxrl.config import ConfigError, from_dict
from jaxrl.data import make_char_tokenizer
from jaxrl.demo import write_demo_files
from jaxrl.models import ModelConfig
from jaxrl.reward import (JudgeCache, JudgeConfig, JudgeScorer, JudgeUnavailableError, RewardRouter, TaskRewardConfig,
                          parse_judge_score)
from jaxrl.reward.base import Outcome
from jaxrl.reward.judge import render, score_reward, self_verification_reward, verifier_reward
from jaxrl.reward.judge_vote import Agreement, combine_scores
from jaxrl.rollout.sglang import ClientConfig, ServerConfig
from jaxrl.rollout.sglang.judge import JudgeServerConfig, SGLangJudge
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from jaxrl.rollout.sglang.testing import write_bigram_checkpoint
from jaxrl.trainer.config import TrainConfig
from server_ports import free_base_port

VERDICTS = ("\\boxed{1}", "\\boxed{0}", "\\boxed{0.5}", "score: 1")  # the judge's replies, one token each
MARKERS = {"A": "\\boxed{1}", "B": "\\boxed{0}", "C": "\\boxed{0.5}", "D": "score: 1"}
TIED = "E"  # its successors: all four verdicts, equally likely at temperature 1
VERDICT_SCORES = {"\\boxed{1}": 1.0, "\\boxed{0}": 0.0, "\\boxed{0.5}": 0.5, "score: 1": None}  # by the rubric
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"
EVALUATION = "Here is my evaluation of the solution:"  # the verifier tasks' required phrase


def needs_sglang(test):
    """Marks a test that runs the real judge server (the module's other tests need no server)."""
    skip = pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first")
    return pytest.mark.sglang(skip(test))


# ------------------------------------------------------------------------------- plain unit tests
@pytest.mark.parametrize("text, score", [
    ("so \\boxed{1}", 1.0), ("\\boxed{0}", 0.0), ("\\boxed{0.5}", 0.5), ("\\boxed{ 0.50 }", 0.5), ("\\boxed{.5}", 0.5),
    ("\\boxed{1.0}", 1.0), ("first \\boxed{0} then \\boxed{1}", 1.0), ("\\boxed{2}", None), ("\\boxed{0.7}", None),
    ("\\boxed{}", None), ("\\boxed{1/2}", None), ("\\boxed{one}", None), ("score: 1", None), ("", None),
    ("\\boxed{1", None)])
def test_the_parser_reads_only_the_rubric_scores(text, score):
    assert parse_judge_score(text) == score


def test_slots_are_filled_in_one_pass_and_other_braces_are_kept():
    text = render("\\boxed{...} {problem} / {proof} / {other}", problem="x^{2} {proof}", proof="p")
    assert text == "\\boxed{...} x^{2} {proof} / p / {other}"


def test_the_formulas_on_hand_derived_values():
    assert score_reward(0.5, 1.0) == 0.5 and score_reward(0.0, 1.0) == 0.0 and score_reward(1.0, 1.0) == 1.0
    assert verifier_reward(True, 0.5, 1.0, 0.5) == 0.25          # 1 * (1 - 0.5) * 0.5
    assert verifier_reward(False, 1.0, 1.0, 1.0) == 0.0          # R_format = 0
    assert self_verification_reward(True, 1.0, 1.0, 0.5, 0.76, 0.24) == pytest.approx(0.88)   # .76 + .24 * 1 * .5
    assert self_verification_reward(True, 0.5, 1.0, 1.0, 0.76, 0.24) == pytest.approx(0.50)   # .38 + .24 * .5 * 1
    assert self_verification_reward(True, 0.0, 1.0, 1.0, 0.76, 0.24) == 0.0   # claimed 1 for a proof scored 0
    assert self_verification_reward(True, 0.0, 0.0, 1.0, 0.76, 0.24) == pytest.approx(0.24)   # honest about 0


@pytest.mark.parametrize("draws, majority, mean, lowest", [
    ([1.0, 0.5, 1.0], 1.0, 2.5 / 3, 0.5),
    ([1.0, 0.0, 0.5, 0.0, 1.0], 0.0, 0.5, 0.0),      # a 2-2 tie goes to the lower score
    ([None, 0.5, None, 1.0, 0.5], 0.5, 2 / 3, 0.5),  # draws without a score are left out
    ([None, 1.0], 1.0, 1.0, 1.0),
    ([None, None], None, None, None)])                # no draw scored: the judgement is missing
def test_the_combinations_on_hand_derived_values(draws, majority, mean, lowest):
    combined = [combine_scores(how, draws) for how in ("majority", "mean", "min")]
    assert combined == [majority, pytest.approx(mean) if mean is not None else None, lowest]


def test_agreement_counts_the_judgements_with_two_scored_draws():
    agreement = Agreement()
    for draws in ([1.0, 1.0, None], [1.0, 0.0, 1.0], [0.5, None], [None, None]):
        agreement.add(draws)
    # Two judgements count: one unanimous (1 of 1 pairs agrees), one with 1 of 3 pairs agreeing.
    assert agreement.metrics() == {"judge/voted": 2.0, "judge/agreement_unanimous": 0.5,
                                   "judge/agreement_pairwise": pytest.approx((1 + 1 / 3) / 2)}
    assert Agreement().metrics() == {"judge/voted": 0.0}


def _task(kind, **judge):
    """A task of a judge kind on the judge "grader"; the verifier kinds require the rubric's phrase."""
    return TaskRewardConfig(kind=kind, judge=JudgeConfig(server="grader", **judge),
                            required_phrases=(EVALUATION,) if kind != "judge" else ())


def test_a_broken_format_or_a_zero_score_reward_asks_no_judge():
    """R_format = 0 (a missing phrase, no parsable s', no self-analysis) or R_score = 0 give 0 without a call."""
    scorer = JudgeScorer({"v": _task("verifier"), "s": _task("self_verification")}, {"grader": None})
    row = {"proof": "p", "score": 1}
    for task, response in (("v", f"{EVALUATION} \\boxed{{0}}"), ("v", "no phrase \\boxed{1}"),
                           ("v", f"{EVALUATION} no score"), ("s", f"proof only {EVALUATION} \\boxed{{1}}"),
                           ("s", f"## Self Evaluation\n{EVALUATION} \\boxed{{1}}")):
        assert scorer.score([task], ["q"], [response], [row]) == [Outcome("ok", 0.0)]
    assert scorer.take_metrics()["judge/requests"] == 0


def test_config_errors_name_the_key(tmp_path):
    files = write_demo_files(str(tmp_path), max_operand=3, heldout=2)
    base = {"output_dir": str(tmp_path / "run"), "model": {"hf_path": "x"},
            "data": {"tokenizer": files["tokenizer"], "train_files": [files["train"]]},
            "reward": {"default_task": "p", "tasks": {"p": {"kind": "judge", "judge": {"server": "grader"}}}}}
    with pytest.raises(ConfigError, match=r"reward.tasks.p.judge.server='grader' is not a key of judges \[\]"):
        from_dict(TrainConfig, base)
    with pytest.raises(ConfigError, match=r"judges.grader \(JudgeServerConfig\).*exactly one of server .* and urls"):
        from_dict(TrainConfig, {**base, "judges": {"grader": {"tokenizer": "t"}}})
    with pytest.raises(ConfigError, match=r"reward.tasks.p .*judge.template='missing.txt' is neither a built-in"):
        from_dict(TrainConfig, {**base, "reward": {"default_task": "p", "tasks": {"p": {
            "kind": "judge", "judge": {"server": "grader", "template": "missing.txt"}}}}})
    with pytest.raises(ConfigError, match=r"judges.grader.temperature: expected a number"):
        from_dict(TrainConfig, {**base, "judges": {"grader": {"tokenizer": "t", "urls": ["u"], "temperature": "hot"}}})
    judges = {"grader": {"tokenizer": "t", "urls": ["u"]}}
    for judge, message in (({"samples": 0}, r"judge.samples=0 must be >= 1"),
                           ({"combine": "max"}, r"judge.combine: 'max' is not allowed; allowed values: "
                                               r"\['majority', 'mean', 'min'\]"),
                           ({"samples": 3}, r"reward.tasks.p.judge.samples=3 draws the same judgement from a greedy "
                                            r"judge \(judges.grader.temperature=0\)")):
        with pytest.raises(ConfigError, match=message):
            from_dict(TrainConfig, {**base, "judges": judges, "reward": {"default_task": "p", "tasks": {"p": {
                "kind": "judge", "judge": {"server": "grader", **judge}}}}})


def test_rows_a_verifier_cannot_grade_are_named():
    router = RewardRouter({}, default_task="v", scorers=[JudgeScorer({"v": _task("verifier")}, {"grader": None})])
    assert router.row_problem({"proof": "p", "score": 0.5}) is None
    assert router.row_problem({"score": 1})[0] == "missing_field"
    assert router.row_problem({"proof": "p", "score": 2})[:2] == (
        "bad_reference_score", "'score' of a task 'v' row must be 0, 0.5 or 1")


def test_the_cache_file_is_read_back_and_a_torn_line_skipped(tmp_path):
    path = str(tmp_path / "cache" / "process-0.jsonl")
    JudgeCache(path).put({JudgeCache.key("judge v1", "prompt", 0): 0.5})
    with open(path, "a") as f:
        f.write('{"key": "torn')
    reopened = JudgeCache(path)
    assert reopened.get(JudgeCache.key("judge v1", "prompt", 0)) == 0.5 and len(reopened) == 1
    assert reopened.get(JudgeCache.key("judge v2", "prompt", 0)) is None  # another judge version: not a hit
    assert reopened.get(JudgeCache.key("judge v1", "prompt", 1)) is None  # another draw: not a hit


# ------------------------------------------------------------------------------- a real judge
class CountingProxy:
    """An HTTP proxy in front of ``upstream`` that counts the ``/generate`` requests it forwards and
    keeps each one's body and answer, as JSON (``exchanges``); ``close()`` shuts its port, so the
    judge behind it is dead to its clients."""

    def __init__(self, upstream: str):
        self.generate_requests, self.exchanges = 0, []
        lock, proxy = threading.Lock(), self

        class Forward(http.server.BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = requests.request(self.command, upstream + self.path, data=body, timeout=120,
                                          headers={"Content-Type": "application/json"})
                if self.path == "/generate":
                    with lock:
                        proxy.generate_requests += 1
                        proxy.exchanges.append((json.loads(body), answer.json()))
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("Content-Type", "application/json"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            do_GET = do_POST = _forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class Judge:
    """The constructed judge: ``model`` on a fleet jaxrl started, its ``next_token`` program, its tokenizer."""

    model: SGLangJudge
    next_token: list[int]
    tokenizer: str

    def external(self, url: str, temperature: float = 0.0, **client) -> SGLangJudge:
        """The judge on servers started elsewhere (``judges.<name>.urls``): here, ``url``, the proxy."""
        return SGLangJudge(JudgeServerConfig(tokenizer=self.tokenizer, urls=(url,), use_chat_template=False,
                                             temperature=temperature,
                                             client=ClientConfig(**{"max_tries": 2, "backoff_s": 0.05, **client})))


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    """The constructed judge, served by a fleet jaxrl starts (``judges.<name>.server``)."""
    tmp = tmp_path_factory.mktemp("judge")
    tokenizer = make_char_tokenizer(str(tmp / "tokenizer"), ALPHABET, words=VERDICTS)
    config = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=8192)
    next_token = [tokenizer.eos_token_id] * config.vocab_size
    for char in ALPHABET:
        verdict = MARKERS.get(char, VERDICTS[ord(char) % len(VERDICTS)])
        next_token[tokenizer.convert_tokens_to_ids(char)] = tokenizer.convert_tokens_to_ids(verdict)
    next_token[tokenizer.convert_tokens_to_ids(TIED)] = tuple(tokenizer.convert_tokens_to_ids(VERDICTS))
    write_bigram_checkpoint(str(tmp / "model"), config, next_token)
    server = ServerConfig(model_path=str(tmp / "model"), base_port=free_base_port(), log_dir=str(tmp / "logs"),
                          max_total_tokens=65536, startup_timeout_s=300, stop_timeout_s=2)
    managed = SGLangJudge(JudgeServerConfig(tokenizer=str(tmp / "tokenizer"), server=server, use_chat_template=False))
    yield Judge(managed, next_token, str(tmp / "tokenizer"))
    managed.close()


@pytest.fixture
def proxy(judge):
    proxy = CountingProxy(judge.model.fleet.urls[0])
    yield proxy
    proxy.close()


def _scorer(model, tasks, cache=None) -> JudgeScorer:
    return JudgeScorer(tasks, {"grader": model}, cache)


@needs_sglang
def test_the_judges_replies_and_scores_are_the_forced_ones(judge, tmp_path):
    replies = judge.model.judge(["a proof A", "a proof B", "a proof C", "a proof D"])
    assert [r.text for r in replies] == list(MARKERS.values())
    assert all(r.error == "" and r.seconds > 0 for r in replies)
    (tmp_path / "rubric.txt").write_text("Grade it.\n{problem}\n{proof}")
    scorer = _scorer(judge.model, {"p": _task("judge", template=str(tmp_path / "rubric.txt"), retries=0)})
    outcomes = scorer.score(["p"] * 4, ["q"] * 4, ["x A", "x B", "x C", "x D"], [{}] * 4)
    assert [(o.score, o.unparsable) for o in outcomes] == [(1.0, False), (0.0, False), (0.5, False), (0.0, True)]


@needs_sglang
def test_verifier_and_self_verification_rewards_follow_the_formulas(judge, proxy):
    """The built-in rubrics; each expected reward derived by hand from the forced judgements."""
    scorer = _scorer(judge.external(proxy.url), {"v": _task("verifier", retries=0),
                                                   "s": _task("self_verification", retries=0)})
    row = {"proof": "the proof", "score": 1}
    cases = [  # (task, response, reward, masked)
        ("v", f"{EVALUATION} fine. \\boxed{{0.5}} A", 0.5, False),       # (1 - |0.5 - 1|) * meta 1
        ("v", f"{EVALUATION} fine. \\boxed{{1}} C", 0.5, False),         # (1 - 0) * meta 0.5
        ("v", f"{EVALUATION} wrong. \\boxed{{0}} A", 0.0, False),        # R_score = 0: no call
        ("v", f"{EVALUATION} fine. \\boxed{{1}} D", 0.0, True),          # meta unparsable: masked
        ("s", f"Y A\n## Self Evaluation\n{EVALUATION} \\boxed{{1}} C", 0.88, False),  # .76 * 1 + .24 * 1 * .5
        ("s", f"Y B\n## Self Evaluation\n{EVALUATION} \\boxed{{1}} A", 0.0, False),   # s = 0, s' = 1
        ("s", f"Y C\n## Self Evaluation\n{EVALUATION} \\boxed{{0.5}} A", 0.62, False),  # .38 + .24 * 1 * 1
    ]
    outcomes = scorer.score([c[0] for c in cases], ["q"] * len(cases), [c[1] for c in cases], [row] * len(cases))
    assert [(pytest.approx(o.score), o.unparsable) for o in outcomes] == [(c[2], c[3]) for c in cases]
    assert proxy.generate_requests == 3 + 2 * 3  # verifier: 3 meta passes; self_verification: 3 x (verify, meta)
    metrics = scorer.take_metrics()
    assert (metrics["judge/requests"], metrics["judge/masked"], metrics["judge/unparsable_replies"]) == (9, 1, 1)


@needs_sglang
@pytest.mark.parametrize("retries", [0, 2])
def test_a_malformed_judgement_is_retried_then_masked_and_counted(judge, proxy, retries):
    errors = []
    scorer = _scorer(judge.external(proxy.url), {"p": _task("judge", retries=retries)})
    outcomes = scorer.score(["p", "p"], ["q", "q"], ["a proof D", "a proof A"], [{}, {}], on_error=errors.append)
    assert [(o.score, o.unparsable) for o in outcomes] == [(0.0, True), (1.0, False)]
    assert proxy.generate_requests == 1 + (1 + retries)
    metrics = scorer.take_metrics()
    assert metrics["judge/requests"] == 2 + retries and metrics["judge/unparsable_replies"] == 1 + retries
    assert metrics["judge/masked"] == 1 and metrics["judge/failure_rate"] == (1 + retries) / (2 + retries)
    assert len(errors) == 1 and proxy.url in errors[0] and "1 sample(s) masked" in errors[0]
    assert scorer.take_metrics()["judge/requests"] == 0  # taken: the next step starts from zero


@needs_sglang
def test_the_cache_spares_a_second_scoring_and_a_resumed_run(judge, proxy, tmp_path):
    path = str(tmp_path / "judge_cache" / "process-0.jsonl")
    responses = ["p A", "p B", "p A", "p C"]  # the repeated response is asked once
    batch = (["p"] * 4, ["q"] * 4, responses, [{}] * 4)
    scorer = _scorer(judge.external(proxy.url), {"p": _task("judge")}, JudgeCache(path))
    first = scorer.score(*batch)
    assert proxy.generate_requests == 3
    assert scorer.score(*batch) == first and proxy.generate_requests == 3
    assert scorer.take_metrics()["judge/cache_hits"] == 3
    resumed = _scorer(judge.external(proxy.url), {"p": _task("judge")}, JudgeCache(path))
    assert resumed.score(*batch) == first and proxy.generate_requests == 3
    assert [o.score for o in first] == [1.0, 0.0, 1.0, 0.5]


def _hand_majority(scores):
    """The most frequent score, a tie to the lowest (how ``judge.combine: majority`` is documented)."""
    counts = collections.Counter(scores)
    return min(score for score in counts if counts[score] == max(counts.values()))


@needs_sglang
def test_n_verifications_combine_to_the_hand_computed_majority_and_minimum(judge, proxy):
    """Five draws per judgement at temperature 1, each with its own seed; the expected scores are
    computed here from the raw verdicts the server sent back (recorded by the proxy)."""
    combines = ("majority", "min", "mean")
    scorer = _scorer(judge.external(proxy.url, temperature=1.0),
                     {how: _task("judge", samples=5, combine=how, retries=0) for how in combines})
    responses = [f"proof {i} {TIED}" for i in range(6)] + ["proof A"]
    batch = ([how for how in combines for _ in responses], ["q"] * 21, responses * 3, [{}] * 21)
    outcomes = scorer.score(*batch)
    # The judgements of the three tasks are the same prompts, so each prompt's five draws serve all three.
    assert proxy.generate_requests == 7 * 5
    tokenizer, raw, seeds = judge.model.tokenizer, collections.defaultdict(list), collections.defaultdict(list)
    for body, answer in proxy.exchanges:
        graded = tokenizer.decode(body["input_ids"]).rpartition("\n")[2]  # the response, last in the rubric
        raw[graded].append(VERDICT_SCORES[tokenizer.decode(answer["output_ids"], skip_special_tokens=True)])
        seeds[graded].append(body["sampling_params"]["sampling_seed"])
    assert sorted(raw) == sorted(responses) and all(len(set(s)) == 5 for s in seeds.values())
    assert raw["proof A"] == [1.0] * 5
    assert any(len(set(raw[r])) > 1 for r in responses)  # the tied verdicts were drawn differently
    valid = {r: [s for s in raw[r] if s is not None] for r in responses}
    expected = {"majority": {r: _hand_majority(v) if v else None for r, v in valid.items()},
                "min": {r: min(v) if v else None for r, v in valid.items()},
                "mean": {r: sum(v) / len(v) if v else None for r, v in valid.items()}}
    got = [(o.score, o.unparsable) for o in outcomes]
    assert got == [(pytest.approx(expected[how][r] or 0.0), expected[how][r] is None)
                   for how in combines for r in responses]
    voted = [v for v in valid.values() if len(v) >= 2]
    metrics = scorer.take_metrics()
    assert metrics["judge/invalid_draws"] == sum(s is None for r in responses for s in raw[r])
    assert metrics["judge/masked"] == 3 * sum(not v for v in valid.values())
    assert metrics["judge/voted"] == len(voted)
    assert metrics["judge/agreement_unanimous"] == pytest.approx(sum(len(set(v)) == 1 for v in voted) / len(voted))
    pairs = [sum(a == b for i, a in enumerate(v) for b in v[i + 1:]) / (len(v) * (len(v) - 1) / 2) for v in voted]
    assert metrics["judge/agreement_pairwise"] == pytest.approx(sum(pairs) / len(pairs))
    # A second scorer (no cache) sends each draw the same seed again: the draws are reproducible
    # wherever the server honours seeds (SGLang with --enable-deterministic-inference, on GPUs).
    again = _scorer(judge.external(proxy.url, temperature=1.0),
                    {"min": _task("judge", samples=5, combine="min", retries=0)})
    again.score(["min"] * 7, ["q"] * 7, responses, [{}] * 7)
    resent = collections.defaultdict(list)
    for body, _ in proxy.exchanges[35:]:
        resent[tokenizer.decode(body["input_ids"]).rpartition("\n")[2]].append(body["sampling_params"]["sampling_seed"])
    assert {r: sorted(s) for r, s in resent.items()} == {r: sorted(s) for r, s in seeds.items()}


@needs_sglang
def test_a_dead_judge_is_reported_by_its_url(judge):
    closed = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ValueError, match=re.escape(f"{closed}: no SGLang server answers")):
        judge.external(closed)
    proxy = CountingProxy(judge.model.fleet.urls[0])
    model = judge.external(proxy.url)  # alive when the run starts, dead by the next batch
    proxy.close()
    named = f"judge 'grader' .*{re.escape(proxy.url)}.* answered none of the 2"
    with pytest.raises(JudgeUnavailableError, match=named):
        _scorer(model, {"p": _task("judge", retries=1)}).score(["p", "p"], ["q", "q"], ["a A", "a B"], [{}, {}])


@needs_sglang
def test_the_trainer_trains_on_the_judges_rewards_and_logs_its_metrics(judge, proxy, tmp_path, monkeypatch):
    from jaxrl.trainer.stages import advantage as advantage_stage
    from jaxrl.trainer.metrics import read_jsonl
    from jaxrl.trainer.rl import RLTrainer

    files = write_demo_files(str(tmp_path / "demo"), max_operand=10, heldout=10)
    (tmp_path / "rubric.txt").write_text("Grade it.\n{problem}\n{proof}")
    config = from_dict(TrainConfig, {
        "output_dir": str(tmp_path / "run"), "steps": 1, "seed": 3,
        "model": {"architecture": {"vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1,
                                   "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 32}},
        "data": {"tokenizer": files["tokenizer"], "train_files": [files["train"]], "use_chat_template": False,
                 "max_prompt_tokens": 6},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
        "reward": {"default_task": "proof", "task_field": "none", "tasks": {"proof": {
            "kind": "judge", "judge": {"server": "grader", "template": str(tmp_path / "rubric.txt"), "retries": 1,
                                       "samples": 2, "combine": "min"}}}},
        "judges": {"grader": {"tokenizer": judge.tokenizer, "urls": [proxy.url], "use_chat_template": False,
                              "temperature": 1.0}},
        "logging": {"progress": False, "tensorboard": False, "plots": False}})
    seen, scored = {}, []
    real_advantages = advantage_stage.advantages

    def advantages(batch, scores, valid, *args, **kwargs):
        seen.update(scores=np.asarray(scores), valid=np.asarray(valid))
        return real_advantages(batch, scores, valid, *args, **kwargs)

    monkeypatch.setattr(advantage_stage, "advantages", advantages)
    trainer = RLTrainer(config)
    real_score = trainer.router.score

    def score(prompts, responses, *args, **kwargs):
        scored.append((prompts, responses, real_score(prompts, responses, *args, **kwargs)))
        return scored[-1][2]

    trainer.router.score = score
    try:
        trainer.run()
    finally:
        trainer.close()
    (prompts, responses, batch), = scored
    # What the judge must have answered: the successor of the last token of the prompt it was sent.
    judge_prompts = [f"Grade it.\n{prompt}\n{response}" for prompt, response in zip(prompts, responses, strict=True)]
    tokenizer = judge.model.tokenizer
    last = [tokenizer.encode(p, add_special_tokens=False)[-1] for p in judge_prompts]
    expected = [parse_judge_score(tokenizer.decode([judge.next_token[t]], skip_special_tokens=True)) for t in last]
    assert len({e for e in expected}) > 1  # the batch holds different verdicts
    np.testing.assert_array_equal(seen["valid"], [e is not None for e in expected])
    np.testing.assert_array_equal(seen["scores"], [0.0 if e is None else e for e in expected])
    np.testing.assert_array_equal(seen["scores"], batch.scores)
    row = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))[0]
    malformed = {p for p, e in zip(judge_prompts, expected, strict=True) if e is None}
    distinct, malformed = len(set(judge_prompts)), len(malformed)
    # Two draws of each distinct prompt (the verdicts here are not tied: both draws agree); a
    # malformed one is asked twice per draw (retries=1).
    assert row["reward/judge/requests"] == proxy.generate_requests == 2 * (distinct + malformed)
    assert row["reward/judge/masked"] == sum(e is None for e in expected)
    assert row["reward/judge/voted"] == distinct - malformed and row["reward/judge/agreement_unanimous"] == 1.0
    assert row["reward/judge/latency_max_s"] > 0 and "reward/judge/failure_rate" in row
    assert (tmp_path / "run" / "judge_cache" / "process-0.jsonl").is_file()
