"""The RL loop end to end on a tiny random model: resume, accumulation, bad rows, raising rewards."""

import json
import logging

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, load_config
from jaxrl.demo import write_demo_files
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer
from toy_rewards import python_reward

ARCHITECTURE = {"vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                "num_kv_heads": 1, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 32}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_demo_files(str(tmp_path_factory.mktemp("demo")), max_operand=10, heldout=10)


DENSE_REWARD = python_reward("digit_reward")


def make_config(files, out, **sections):
    data = {
        "output_dir": str(out), "steps": 2, "seed": 3,
        "model": {"architecture": ARCHITECTURE, "init_seed": 1},
        "data": {"tokenizer": files["tokenizer"], "train_files": [files["train"]], "use_chat_template": False,
                 "max_prompt_tokens": 6},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
        "optimizer": {"lr": 1e-2, "clip_norm": 1.0},
        "reward": DENSE_REWARD,
        "logging": {"progress": False, "tensorboard": False, "plots": False},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    from jaxrl.config import from_dict

    return from_dict(TrainConfig, data)


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]


def _run(config, resume=False):
    """(parameters before, parameters after) the run."""
    trainer = RLTrainer(config, resume=resume)
    try:
        before = _params(trainer)
        trainer.run()
        return before, _params(trainer)
    finally:
        trainer.close()


class StageSpy:
    """Stands in the trainer's step for one of its stages (everything else is the stage's own):
    ``calls`` holds every call's (record in, record out, metrics)."""

    def __init__(self, stage):
        self.stage = stage
        self.calls = []

    def __call__(self, record, step):
        out, metrics = self.stage(record, step)
        self.calls.append((record, out, metrics))
        return out, metrics

    def __getattr__(self, name):
        return getattr(self.stage, name)


def spy(trainer, name: str) -> StageSpy:
    """Puts a :class:`StageSpy` in the place of ``trainer``'s stage ``name``."""
    index = [s.name for s in trainer.stages].index(name)
    trainer.stages[index] = StageSpy(trainer.stages[index])
    return trainer.stages[index]


def _comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def test_resume_reproduces_the_straight_run(files, tmp_path):
    """2N steps straight == N steps, stop, resume, N steps: identical float32 parameters and metrics."""
    checkpoint = {"every": 1, "keep": 2}
    straight = make_config(files, tmp_path / "a", steps=4,
                           checkpoint={**checkpoint, "directory": str(tmp_path / "a" / "ck")})
    initial, params_straight = _run(straight)
    first_half = make_config(files, tmp_path / "b", steps=2,
                             checkpoint={**checkpoint, "directory": str(tmp_path / "b" / "ck")})
    _, params_half = _run(first_half)
    # The same checkpoint restores onto another mesh (parameters sharded over fsdp=2).
    other_mesh = RLTrainer(make_config(files, tmp_path / "b", steps=4, mesh={"fsdp": 2},
                                       checkpoint={**checkpoint, "directory": str(tmp_path / "b" / "ck")}),
                           resume=True)
    assert other_mesh.step == 2
    assert any(len(x.sharding.device_set) == 2 for x in jax.tree.leaves(other_mesh.state["params"]))
    for a, b in zip(params_half, _params(other_mesh), strict=True):
        np.testing.assert_array_equal(a, b)
    other_mesh.close()
    _, params_resumed = _run(make_config(files, tmp_path / "b", steps=4,
                                      checkpoint={**checkpoint, "directory": str(tmp_path / "b" / "ck")}),
                          resume=True)
    for a, b in zip(params_straight, params_resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    rows_a = _comparable(read_jsonl(str(tmp_path / "a" / "metrics.jsonl")))
    rows_b = _comparable(read_jsonl(str(tmp_path / "b" / "metrics.jsonl")))
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    assert rows_a == rows_b
    # The parameters moved: a run that never updated would also "match".
    assert any(not np.array_equal(a, b) for a, b in zip(initial, params_straight, strict=True))


def test_micro_batch_accumulation_equals_one_big_batch(files, tmp_path):
    """One update with 4 micro-batches equals the update with the whole batch at once.

    Adam's first step is ``lr * g / (|g| + eps)``, which for ``eps`` >> ``|g|`` is ``lr * g / eps``:
    with ``eps = 1`` the parameter change is the gradient itself (scaled), so comparing changes
    compares gradients, instead of ``sign(g)`` which turns float rounding of tiny gradients
    into full-size differences.
    """
    deltas, logged = [], []
    for micro in (1, 4):
        config = make_config(files, tmp_path / f"m{micro}", steps=1, update={"micro_batches": micro},
                             objective={"aggregation": "seq-mean-token-mean"},
                             optimizer={"lr": 1.0, "eps": 1.0, "clip_norm": 0.0})
        initial, final = _run(config)
        deltas.append([b - a for a, b in zip(initial, final, strict=True)])
        logged.append(read_jsonl(str(tmp_path / f"m{micro}" / "metrics.jsonl"))[0])
    scale = max(float(np.max(np.abs(d))) for d in deltas[0])
    assert scale > 1e-4  # A real update, far above the tolerance below.
    for a, b in zip(*deltas, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)
    assert logged[1]["update/grad_norm"] == pytest.approx(logged[0]["update/grad_norm"], rel=1e-5)
    # ~0 on-policy: advantages sum to 0.
    assert logged[1]["update/loss"] == pytest.approx(logged[0]["update/loss"], abs=1e-6)


STAGE_PREFIXES = ("rollout/", "reward/", "recompute/", "mismatch/", "mismatch_bucket/", "advantage/", "filter/",
                  "update/", "push/", "time/", "data/", "heldout/")


def test_each_metric_names_its_stage_and_no_stage_overwrites_another(files, tmp_path):
    """Every logged key carries its stage's prefix, and keys two stages both measure stay apart:
    the policy entropy before the update (recompute) and in the loss (update), the batch filter's
    verdict (filter) and the loss's own report of it (update). Before, ``entropy`` and
    ``batch_filter_*`` were each written twice per step, the last writer winning."""
    config = make_config(files, tmp_path / "run", steps=1, update={"mini_batches": 2},
                         objective={"entropy_coef": 0.01, "batch_filter_threshold": 10.0})
    trainer = RLTrainer(config)
    spies = [spy(trainer, stage.name) for stage in list(trainer.stages)]
    try:
        trainer.run()
    finally:
        trainer.close()
    written = [set(metrics) for s in spies for _, _, metrics in s.calls]
    row = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))[0]
    assert all(key.startswith(STAGE_PREFIXES) for key in row if key != "step"), sorted(row)
    assert {"recompute/entropy", "update/entropy", "filter/skip", "update/batch_filter_skip"} <= set(row)
    assert row["recompute/entropy"] != row["update/entropy"]  # the loss's is the mean over 2 mini-batches
    assert all(not (a & b) for i, a in enumerate(written) for b in written[i + 1:]), written


def test_loop_survives_bad_rows_and_a_raising_reward(files, tmp_path, caplog):
    rows = [json.loads(line) for line in open(files["train"])][:20]
    path = tmp_path / "mixed.jsonl"
    with open(path, "w") as f:
        for row in rows[:10]:
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"question": "no prompt field"}) + "\n")  # line 11 (1-based): bad
        for row in rows[10:]:
            f.write(json.dumps(row) + "\n")
    config = make_config(
        files, tmp_path / "out", steps=2, data={"train_files": [str(path)]},
        reward=python_reward("exploding_reward"))
    with caplog.at_level(logging.WARNING):
        _run(config)
    assert f"skipped 1 row of {path}: missing field 'prompt' (line 11" in caplog.text
    assert "RuntimeError: reward bug" in caplog.text
    logged = read_jsonl(str(tmp_path / "out" / "metrics.jsonl"))
    assert [r["step"] for r in logged] == [1, 2]
    assert all(r["data/bad_rows"] == 1 for r in logged)
    assert sum(r["reward/raised"] for r in logged) > 0
    # Raised samples count as unparsable and are masked out of the gradient.
    assert all(r["reward/unparsable_fraction"] >= r["reward/raised"] / 16 for r in logged)


def test_shipped_configs_load_and_errors_name_the_key():
    import glob
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    paths = sorted(glob.glob(os.path.join(root, "*.yaml")))
    assert len(paths) >= 5
    for path in paths:
        config = load_config(TrainConfig, path)
        assert config.hardware, f"{path} does not say what hardware it expects"
    demo = os.path.join(root, "demo.yaml")
    with pytest.raises(ConfigError, match=r"unknown key rollout.group_sizes .*allowed keys: .*'group_size'"):
        load_config(TrainConfig, demo, ["rollout.group_sizes=4"])
    with pytest.raises(ConfigError, match=r"objective.policy_loss: 'grpo' is not allowed; allowed values: "
                                          r"\['ppo', 'gspo', 'gspo-token', 'cispo', 'gmpo', 'reinforce', 'sapo'\]"):
        load_config(TrainConfig, demo, ["objective.policy_loss=grpo"])
    with pytest.raises(ConfigError, match=r"rollout.group_size: expected an integer, got 'eight'"):
        load_config(TrainConfig, demo, ["rollout.group_size=eight"])
    with pytest.raises(ConfigError, match=r"divisible by update.mini_batches \* update.micro_batches = 3"):
        load_config(TrainConfig, demo, ["update.micro_batches=3"])
    with pytest.raises(ConfigError, match=r"output_dir must be a local folder .*'gs://b/run'.*checkpoint.directory"):
        load_config(TrainConfig, demo, ["output_dir=gs://b/run"])
    # AdamW's fields: each bad value is refused at load, naming the key (eps = 0 and b1 = 1 were
    # once accepted: 0/0 on a zero gradient, a division by 1 - b1^t = 0).
    for override, message in [
        ("optimizer.lr=0", r"optimizer.lr=0.0 must be > 0"),
        ("optimizer.warmup_steps=-3", r"optimizer.warmup_steps=-3 must be >= 0"),
        ("optimizer.min_lr_ratio=2", r"optimizer.min_lr_ratio=2.0 must be in \[0, 1\]"),
        ("optimizer.b1=1", r"optimizer.b1=1.0 must be in \[0, 1\)"),
        ("optimizer.b2=-0.1", r"optimizer.b2=-0.1 must be in \[0, 1\)"),
        ("optimizer.eps=0", r"optimizer.eps=0.0 must be > 0 \(AdamW divides by sqrt\(v\) \+ eps\)"),
        ("optimizer.weight_decay=-1", r"optimizer.weight_decay=-1.0 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=r"section optimizer \(OptimizerConfig\): " + message):
            load_config(TrainConfig, demo, [override])


def test_a_push_that_does_not_load_the_weights_is_caught(files, tmp_path):
    """An engine that bumps its version but keeps sampling the old weights fails the spot check."""
    from jaxrl.rollout.sampler import JaxSampler
    from jaxrl.rollout.base import PushVerificationError

    class StaleSampler(JaxSampler):
        def update_weights(self, params, version):
            self._version = str(version)  # Claims the new version, keeps the old arrays.

    config = make_config(files, tmp_path / "stale", steps=2)
    trainer = RLTrainer(config, engine=None)
    from flax import nnx

    frozen = jax.tree.map(lambda x: x.copy(), trainer.state["params"])  # The train step donates the live arrays.
    stale = StaleSampler(nnx.merge(trainer.learner.train_step.graphdef, frozen), max_batch=16)
    stale.update_weights(None, "0")
    trainer.engine = stale
    trainer.train_step_once()  # Step 1 samples the initial weights, which the learner still has.
    with pytest.raises(PushVerificationError, match="weight version 1 .* differ from the learner's"):
        trainer.train_step_once()
    trainer.close()


def test_sft_length_curriculum_and_response_only_loss(files, tmp_path):
    from jaxrl.trainer.sft import SFTTrainer

    config = make_config(files, tmp_path / "sft", data={"max_response_tokens": 8},
                         sft={"batch_size": 8,
                              "stages": [{"steps": 3, "max_length": 8}, {"steps": 3, "max_length": 16}]},
                         optimizer={"lr": 1e-2})
    trainer = SFTTrainer(config)
    try:
        trainer._enter_stage(0)
        # Stage 0 only sees pairs of at most 8 tokens: one-digit sums ("3+4=" + "\boxed{", "7", "}", eos).
        lengths = [len(e.prompt_ids) + len(e.response_ids) for e in trainer.iterator.examples]
        assert max(lengths) == 8 and len(trainer.iterator.examples) < len(trainer.examples)
        trainer.run()
    finally:
        trainer.close()
    rows = read_jsonl(str(tmp_path / "sft" / "metrics.jsonl"))
    assert [r["sft/stage"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert [r["sft/max_length"] for r in rows] == [8, 8, 8, 16, 16, 16]
    # The loss is the mean NLL of response tokens only: it equals the logged response NLL.
    assert all(r["update/loss"] == pytest.approx(r["update/nll"], rel=1e-6) for r in rows)
    assert rows[-1]["update/loss"] < rows[0]["update/loss"]


def test_sft_resume_across_a_stage_boundary(files, tmp_path):
    """SFT: 4 steps straight == 2 steps (end of stage 0), resume, 2 steps (stage 1): identical parameters."""
    from jaxrl.trainer.sft import SFTTrainer

    def sft(name, resume=False):
        config = make_config(files, tmp_path / name, data={"max_response_tokens": 8},
                             sft={"batch_size": 4, "stages": [{"steps": 2, "max_length": 9},
                                                              {"steps": 2, "max_length": 16}]},
                             checkpoint={"directory": str(tmp_path / name / "ck"), "every": 1})
        trainer = SFTTrainer(config, resume=resume)
        try:
            if not resume and name == "half":
                trainer.total_steps = 2  # Stop after stage 0, as a crash would.
            trainer.run()
            return _params(trainer)
        finally:
            trainer.close()

    straight = sft("straight")
    sft("half")
    resumed = sft("half", resume=True)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["sft/stage"] for r in read_jsonl(str(tmp_path / "half" / "metrics.jsonl"))] == [0, 0, 1, 1]


def test_the_embedded_sampler_stops_at_the_models_own_eos_ids(files, tmp_path):
    """A model folder whose generation_config.json lists another end-of-sequence id beside the
    tokenizer's (as Qwen3's lists <|endoftext|> beside <|im_end|>): the trainer's rollouts stop
    at either, as SGLang would on the same folder."""
    from jaxrl.data import load_tokenizer
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint

    tokenizer = load_tokenizer(files["tokenizer"])
    digit = tokenizer.convert_tokens_to_ids("5")
    path = tmp_path / "hf"
    write_random_checkpoint(str(path), ModelConfig(**ARCHITECTURE), seed=0, matrix_scale=1.0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, digit]}))
    trainer = RLTrainer(make_config(files, tmp_path / "run", steps=1, model={"hf_path": str(path)}))
    try:
        assert trainer.stage("rollout").sampling(seed=0).stop_token_ids == (tokenizer.eos_token_id, digit)
        samples = trainer.stage("rollout").rollout(trainer.examples[:4], seed=0, n=4)
    finally:
        trainer.close()
    outputs = [s.output_ids.tolist() for group in samples for s in group]
    assert all(digit not in out[:-1] for out in outputs)
    assert any(out[-1] == digit for out in outputs)
