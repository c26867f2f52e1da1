"""Evaluation and the pass-rate filter against figures counted by hand.

A constructed engine answers prompt ``i`` with ``n`` responses of which the first ``c_i`` are
right (its reference answer, boxed) and the rest wrong; the real math reward scores them in its
sandbox. So each prompt's pass rate is ``c_i / n``, avg@n is their mean, and pass@k is counted
here over every k-subset of the samples (no binomial formula)."""

import itertools
import json

import numpy as np
import pytest

from jaxrl.data import load_examples, load_tokenizer
from jaxrl.data.pipeline import DataConfig
from jaxrl.demo import write_demo_files
from jaxrl.evaluation import evaluate, pass_at_k
from jaxrl.evaluation.filter import FilterConfig, PassBand, run_filter
from jaxrl.reward import RewardConfig, TaskRewardConfig, build_router
from jaxrl.rollout.base import RolloutEngine, Sample, SamplingParams

N = 6
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_demo_files(str(tmp_path_factory.mktemp("demo")), max_operand=6, heldout=12)


@pytest.fixture(scope="module")
def tokenizer(files):
    return load_tokenizer(files["tokenizer"])


def _examples(files, tokenizer, name="heldout"):
    config = DataConfig(tokenizer=files["tokenizer"], use_chat_template=False, max_prompt_tokens=8)
    return load_examples([files[name]], config, tokenizer)[0]


def correct_count(example) -> int:
    """How many of a prompt's N samples the constructed engine gets right: a spread over 0..N."""
    a, b = (int(x) for x in example.prompt.rstrip("=").split("+"))
    return (3 * a + b) % (N + 1)


class CountingEngine(RolloutEngine):
    """For each prompt, ``correct_count`` right answers first, then wrong ones; raises on the
    ``fail_on``-th call (an interruption) when given."""

    def __init__(self, tokenizer, examples, fail_on=None):
        self.tokenizer, self.fail_on, self.calls = tokenizer, fail_on, 0
        self.by_prompt = {tuple(e.prompt_ids.tolist()): e for e in examples}

    def generate(self, prompts, params, n=1):
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt("interrupted")
        out = []
        for p in prompts:
            e = self.by_prompt[tuple(p)]
            right, answer = correct_count(e), int(e.row["answer"])
            texts = [f"\\boxed{{{answer if j < right else answer + 1}}}" for j in range(n)]
            out.append([Sample(np.asarray(p, np.int32), np.asarray(self.tokenizer.encode(t), np.int32),
                               np.zeros(0, np.float32), "stop", "0") for t in texts])
        return out

    def update_weights(self, model, version):
        return {}

    @property
    def weight_version(self):
        return "0"


def counted_pass_at_k(c: int, n: int, k: int) -> float:
    """The fraction of k-subsets of n samples (c right) that hold a right one, by enumeration."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(j < c for j in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_subset_fraction():
    for n, c, k in itertools.product(range(1, 7), range(7), range(1, 7)):
        if c <= n and k <= n:
            assert pass_at_k(n, c, k) == pytest.approx(counted_pass_at_k(c, n, k))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)


def test_evaluate_reports_the_counted_avg_and_pass_at_k(files, tokenizer):
    examples = _examples(files, tokenizer)
    counts = [correct_count(e) for e in examples]
    assert len(set(counts)) > 3  # a real spread of pass rates
    with build_router(RewardConfig()) as router:
        result = evaluate(CountingEngine(tokenizer, examples), router, tokenizer, examples, PARAMS, N, (1, 2, 5),
                          chunk_prompts=5)
    overall = result.overall
    assert overall.prompts == len(examples) and overall.n == N
    assert overall.avg_at_n == pytest.approx(np.mean([c / N for c in counts]))
    for k in (1, 2, 5):
        assert overall.pass_at_k[k] == pytest.approx(np.mean([counted_pass_at_k(c, N, k) for c in counts]))
    assert overall.unparsable == 0.0
    assert result.sampling == {"n": N, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8, "seed": 3}
    metrics = result.metrics("heldout")
    assert metrics["heldout/reward"] == overall.avg_at_n and metrics["heldout/pass@5"] == overall.pass_at_k[5]
    table = result.table()
    assert "pass@5" in table and "math" in table and "temperature=1.0" in table
    assert json.loads(json.dumps(result.to_json()))["overall"][f"avg@{N}"] == pytest.approx(overall.avg_at_n)


CRITICAL = "\\boxed{0}"  # an analysis that finds the proof wrong


class SelfVerifyingEngine(CountingEngine):
    """``CountingEngine``, which also verifies and refines its samples. A verification prompt (the
    template ``{problem}{proof}``, e.g. ``3+4=\\boxed{8}``) gets ``n`` analyses by ``verdicts``; a
    refinement prompt (``=={problem}{proof}{analysis}``) gets the right answer when the analysis
    is ``\\boxed{0}`` and the same proof otherwise."""

    def generate(self, prompts, params, n=1):
        texts = [self.tokenizer.decode(p) for p in prompts]
        if not any("\\boxed{" in t for t in texts):
            return super().generate(prompts, params, n)
        out = []
        for p, text in zip(prompts, texts, strict=True):
            refine = text.startswith("==")
            problem, _, rest = text.removeprefix("==").partition("\\boxed{")
            a, b = (int(x) for x in problem.rstrip("=").split("+"))
            value, _, analysis = rest.partition("}")
            if refine:
                rewrite = a + b if analysis == CRITICAL else value
                replies = [f"\\boxed{{{rewrite}}}"] * n
            else:
                replies = [f"\\boxed{{{v}}}" if v is not None else "7" for v in verdicts(a + b, int(value), n)]
            out.append([Sample(np.asarray(p, np.int32), np.asarray(self.tokenizer.encode(t), np.int32),
                               np.zeros(0, np.float32), "stop", "0") for t in replies])
        return out


def verdicts(answer: int, value: int, n: int) -> list:
    """The engine's ``n`` analyses of a proof of ``value`` (``answer`` is right): where the answer is
    even it grades truly, where odd it is fooled (it calls the wrong proof right and the right one
    wrong); its first analysis is unreadable where the answer is a multiple of 3, both where of 5."""
    honest = answer % 2 == 0
    grade = int((value == answer) == honest)
    return [None if (k == 0 and answer % 3 == 0) or answer % 5 == 0 else grade for k in range(n)]


def refined_correctness(answer: int, value: int, rounds: int) -> list[bool]:
    """Whether a sample of ``value`` is right after each round, by the engine's rules: a sample whose
    readable analyses all give 1 is kept; else it is rewritten, right when an analysis gave 0."""
    out = [value == answer]
    for _ in range(rounds):
        grades = [g for g in verdicts(answer, value, 2) if g is not None]
        if not (grades and min(grades) == 1) and 0 in grades:
            value = answer
        out.append(value == answer)
    return out


def test_self_verification_gives_the_hand_counted_best_at_n_accuracy_and_refinement(files, tokenizer, tmp_path):
    from jaxrl.evaluation.self_verify import SelfVerifier, SelfVerifyConfig

    (tmp_path / "verify.txt").write_text("{problem}{proof}")
    (tmp_path / "refine.txt").write_text("=={problem}{proof}{analysis}")
    examples = _examples(files, tokenizer)
    config = SelfVerifyConfig(template=str(tmp_path / "verify.txt"), samples=2, refine_rounds=2,
                              refine_template=str(tmp_path / "refine.txt"))
    verifier = SelfVerifier(config, lambda text: tokenizer.encode(text, add_special_tokens=False))
    with build_router(RewardConfig()) as router:
        result = evaluate(SelfVerifyingEngine(tokenizer, examples), router, tokenizer, examples, PARAMS, N, (1,),
                          chunk_prompts=5, self_verifier=verifier)
    picked, matches, graded, rounds = [], [], 0, []
    for e in examples:
        answer, c = int(e.row["answer"]), correct_count(e)
        values = [answer if j < c else answer + 1 for j in range(N)]
        # Each sample's self-score: the grade of its readable analyses (they agree), or none.
        scores = [verdicts(answer, v, 2)[-1] for v in values]
        ranked = [-1 if s is None else s for s in scores]
        picked.append(ranked.index(max(ranked)) < c)  # the first sample with the top self-score
        for j, score in enumerate(scores):
            if score is not None:
                graded += 1
                matches.append((score == 1) == (j < c))
        rounds.extend(refined_correctness(answer, v, 2) for v in values)
    assert 0 < sum(picked) < len(examples) and 0 < sum(matches) < len(matches)  # both figures are informative
    overall = result.overall
    assert overall.best_at_n == pytest.approx(np.mean(picked))
    assert overall.verifier_accuracy == pytest.approx(np.mean(matches))
    assert overall.self_verified == pytest.approx(graded / (N * len(examples)))
    assert overall.avg_at_n == pytest.approx(np.mean([correct_count(e) / N for e in examples]))  # unchanged
    pass_by_round = np.mean(rounds, axis=0)
    assert pass_by_round[0] < pass_by_round[1]  # refinement fixed some samples
    assert result.refinement == pytest.approx(pass_by_round.tolist())
    assert result.refinement[0] == pytest.approx(overall.avg_at_n)  # round 0: the samples as drawn
    assert result.to_json()["overall"][f"best@{N}"] == overall.best_at_n
    assert result.to_json()["refinement"] == {"pass@1": list(result.refinement)}
    table = result.table()
    assert f"best@{N}" in table and "verifier_accuracy" in table and "self-refinement pass@1: round 0" in table


def test_evaluate_refuses_k_above_n(files, tokenizer):
    examples = _examples(files, tokenizer)
    with build_router(RewardConfig()) as router, pytest.raises(ValueError, match="k <= n"):
        evaluate(CountingEngine(tokenizer, examples), router, tokenizer, examples, PARAMS, 2, (4,))


def calls_file_reward(prompt, response, response_ids, row):
    """The math reward, logging each call to the file the row names (the sandbox is another process)."""
    with open(row["calls_file"], "a") as f:
        f.write(prompt + "\n")
    from jaxrl.reward import MathAnswerReward

    return MathAnswerReward()(prompt, response, response_ids, row)


def _filter_setup(files, tokenizer, tmp_path):
    rows = [json.loads(line) for line in open(files["heldout"])]
    calls = tmp_path / "calls.txt"
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({**r, "calls_file": str(calls), "extra": i}) + "\n" for i, r in enumerate(rows)))
    config = DataConfig(tokenizer=files["tokenizer"], use_chat_template=False, max_prompt_tokens=8)
    examples = load_examples([str(path)], config, tokenizer)[0]
    reward = RewardConfig(tasks={"math": TaskRewardConfig(kind="python", function=f"{__name__}:calls_file_reward")})
    return examples, reward, calls


def test_filter_keeps_exactly_the_band_and_resumes_without_rescoring(files, tokenizer, tmp_path):
    examples, reward, calls = _filter_setup(files, tokenizer, tmp_path)
    band = PassBand(low=1 / N, high=4 / N)  # kept: 1/6 < p <= 4/6
    config = FilterConfig(output=str(tmp_path / "kept.jsonl"), samples=N, bands={"math": band}, chunk_prompts=4)
    with build_router(reward) as router:
        with pytest.raises(KeyboardInterrupt):  # stopped during the second chunk
            run_filter(config, examples, CountingEngine(tokenizer, examples, fail_on=2), router, tokenizer, PARAMS,
                       seed_of_chunk=lambda c: c, log=lambda _: None)
        assert len(calls.read_text().splitlines()) == 4 * N  # the first chunk was scored and recorded
        summary = run_filter(config, examples, CountingEngine(tokenizer, examples), router, tokenizer, PARAMS,
                             seed_of_chunk=lambda c: c, log=lambda _: None)
    assert len(calls.read_text().splitlines()) == len(examples) * N  # every prompt scored exactly once
    kept = [json.loads(line) for line in open(config.output)]
    expected = [e for e in examples if 1 < correct_count(e) <= 4]
    assert [r["extra"] for r in kept] == [e.row["extra"] for e in expected]  # exactly the band, in input order
    for r, e in zip(kept, expected, strict=True):
        assert r["pass_rate"] == correct_count(e) / N
        assert {k: v for k, v in r.items() if k != "pass_rate"} == e.row  # every input field kept
    math = summary["tasks"]["math"]
    assert (math["in"], math["kept"]) == (len(examples), len(expected))
    assert math["histogram"] == {f"{c}/{N}": sum(correct_count(e) == c for e in examples) for c in range(N + 1)}
    assert (tmp_path / "kept.jsonl.hist.png").stat().st_size > 0
    assert json.loads((tmp_path / "kept.jsonl.summary.json").read_text())["kept"] == len(expected)


def test_filter_writes_parquet_and_refuses_other_settings(files, tokenizer, tmp_path):
    import pyarrow.parquet as pq

    examples, reward, _ = _filter_setup(files, tokenizer, tmp_path)
    config = FilterConfig(output=str(tmp_path / "kept.parquet"), samples=N, bands={"math": PassBand(0.0, 1.0)})
    with build_router(reward) as router:
        run_filter(config, examples, CountingEngine(tokenizer, examples), router, tokenizer, PARAMS,
                   seed_of_chunk=lambda c: c, log=lambda _: None)
        table = pq.read_table(config.output).to_pylist()
        assert len(table) == sum(correct_count(e) > 0 for e in examples) and "pass_rate" in table[0]
        hotter = SamplingParams(temperature=0.5, max_new_tokens=8, seed=3)
        with pytest.raises(ValueError, match="was written with"):
            run_filter(config, examples, CountingEngine(tokenizer, examples), router, tokenizer, hotter,
                       seed_of_chunk=lambda c: c, log=lambda _: None)


def test_filter_config_names_the_bad_key():
    from jaxrl.config import ConfigError, from_dict
    from jaxrl.trainer.config import TrainConfig

    base = {"output_dir": "x", "model": {"hf_path": "m"}, "data": {}}
    with pytest.raises(ConfigError, match="filter.bands.math"):
        from_dict(TrainConfig, {**base, "filter": {"bands": {"math": {"low": 0.9, "high": 0.1}}}})
    with pytest.raises(ConfigError, match="filter"):
        from_dict(TrainConfig, {**base, "filter": {"output": "kept.csv"}})
    with pytest.raises(ValueError, match="no pass band"):
        FilterConfig().band("code")
