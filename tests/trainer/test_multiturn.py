"""Multi-turn RL through the trainer (config section ``env``): conversations with an environment,
the model's tokens alone in the loss, the engine's logprobs on them equal to the learner's
recompute, the turn metrics, and exact resume.

The environment is a user one plugged in by import path (``env.tasks.<task>.kind: python``):
after each model turn it answers "+1=" and ends the conversation after three model turns, so
every conversation has three model turns and two environment observations whatever the random
model writes. It rewards each turn it answers with TURN_REWARD and the conversation at its end
with 1 when the model's first token is even (0 otherwise), so the environment reward of a
conversation is known in closed form."""

import json

import jax
import numpy as np

from jaxrl.env import Environment, EnvLimits, StepResult
from jaxrl.rollout.base import Conversation
from jaxrl.trainer.stages import recompute as recompute_stage, reward as reward_stage
from jaxrl.trainer.stages.rollout import episodes
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.rl import RLTrainer
from jaxrl.cli import main

import test_loop
from test_loop import _comparable, _run, make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

TURNS = 3
TURN_REWARD = 0.125


def environment_reward(conversation) -> float:
    """What CountingEnvironment's steps give a conversation: TURN_REWARD per answered turn, then 1
    at the end when the model's first token is even."""
    first_model_token = int(conversation.token_ids[np.flatnonzero(conversation.model_mask)[0]])
    return (TURNS - 1) * TURN_REWARD + float(first_model_token % 2 == 0)


class CountingEnvironment(Environment):
    limits = EnvLimits(max_turns=TURNS, max_total_tokens=32)

    def __init__(self, tokenizer, task):
        self.tokenizer = tokenizer
        self.observation = tokenizer.encode("+1=", add_special_tokens=False)

    def reset(self, row):
        return Conversation.from_prompt(self.tokenizer.encode(row["prompt"], add_special_tokens=False))

    def step(self, conversation, model_turn):
        if conversation.num_model_turns >= TURNS:
            first_model_token = int(conversation.token_ids[np.flatnonzero(conversation.model_mask)[0]])
            return StepResult(done=True, reward=float(first_model_token % 2 == 0), info={"finish": "answered"})
        return StepResult(observation_ids=self.observation, reward=TURN_REWARD)


def counting_environment(tokenizer, task):
    return CountingEnvironment(tokenizer, task)


ENV = {"task_field": "none", "default_task": "count",
       "tasks": {"count": {"kind": "python", "environment": f"{__name__}:counting_environment",
                           # The environment's own limits; the trainer sizes its rows by the config's.
                           "limits": {"max_turns": TURNS, "max_total_tokens": 32}}}}


def test_conversations_train_on_the_model_tokens_only(files, tmp_path, monkeypatch):
    recorded = []
    recompute = recompute_stage.recompute

    def recording(batch, *args, **kwargs):
        out = recompute(batch, *args, **kwargs)
        recorded.append(out[0])
        return out

    monkeypatch.setattr(recompute_stage, "recompute", recording)
    combined = []
    with_environment_rewards = reward_stage.with_environment_rewards
    monkeypatch.setattr(reward_stage, "with_environment_rewards",
                        lambda scored, samples: combined.append((scored, with_environment_rewards(scored, samples)))
                        or combined[-1][1])
    # The learner's own recompute (the default skips it here), so that the check below compares it with the engine's.
    trainer = RLTrainer(make_config(files, tmp_path, steps=1, env=ENV, update={"recompute_old_logp": "always"}))
    taken = []
    take = trainer.stage("rollout").queue.take
    trainer.stage("rollout").queue.take = lambda index: taken.append(take(index)) or taken[-1]
    try:
        row = trainer.train_step_once()
    finally:
        trainer.close()
    batch, samples = recorded[0], [s for group in taken[0].samples for s in group]
    observation = trainer.envs.make({}).observation
    for i, s in enumerate(samples):
        conversation = s.episode.conversation
        assert conversation.num_model_turns == TURNS
        # Token by token: the loss mask is 1 exactly on the model's tokens (column t scores token t + 1).
        tokens = conversation.token_ids
        m = len(tokens) - 1
        np.testing.assert_array_equal(np.asarray(batch.targets[i, :m]), tokens[1:])
        np.testing.assert_array_equal(np.asarray(batch.mask[i, :m]), conversation.model_mask[1:].astype(np.float32))
        assert not np.asarray(batch.mask[i, m:]).any()
        np.testing.assert_array_equal(np.asarray(batch.turn_ids[i, :m]), conversation.turn_ids[1:])
        # The environment's answers sit between the turns, outside the mask.
        env_tokens = tokens[conversation.model_mask == 0][len(s.prompt_ids):]
        assert env_tokens.tolist() == observation * (TURNS - 1)
    # The engine's logprobs on every model token of every turn equal the learner's recompute (the
    # float32 decode residual), and the later turns are measured apart from the first.
    generated = np.asarray(batch.generated)
    gap = np.abs(np.asarray(batch.old_logp) - np.asarray(batch.rollout_logp))[generated]
    assert gap.size == sum(int(s.output_mask.sum()) for s in samples) and gap.max() < 1e-4
    assert row["mismatch_turn/later_turns_num_tokens"] > 0 and row["mismatch_turn/first_turn_num_tokens"] > 0
    assert row["env/turns_per_conversation"] == TURNS and row["env/finished_answered"] == 1.0
    # Rewards: the task's score of the model's text plus the environment's per-turn and final rewards.
    (task, total), = combined
    want = np.asarray([environment_reward(s.episode.conversation) for s in samples], np.float32)
    assert 0 < want.min() < want.max()  # per-turn rewards in every conversation, the final one in some
    np.testing.assert_allclose(total.scores, np.asarray(task.scores) + want, rtol=1e-6)
    np.testing.assert_allclose(row["reward/mean"], float(np.mean(total.scores)), rtol=1e-5)


def test_multiturn_resume_reproduces_the_straight_run(files, tmp_path):
    def config(name, steps):
        out = tmp_path / name
        return make_config(files, out, steps=steps, env=ENV,
                           checkpoint={"every": 1, "keep": 2, "directory": str(out / "ck")})

    _, straight = _run(config("a", 2))
    _run(config("b", 1))
    _, resumed = _run(config("b", 2), resume=True)
    for a, b in zip(straight, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
    rows = {name: _comparable(read_jsonl(str(tmp_path / name / "metrics.jsonl"))) for name in ("a", "b")}
    assert rows["a"] == rows["b"]
    assert jax.tree.leaves(straight)  # the run has parameters to compare


def test_eval_and_filter_commands_play_conversations(files, tmp_path, capsys, monkeypatch):
    """``jaxrl eval`` / ``jaxrl filter`` on a config with an env section play each prompt as a
    conversation (three model turns here, whatever the model writes), as the trainer's held-out
    evaluation does; before, they scored single-turn answers without the environment."""
    config = {
        "output_dir": str(tmp_path / "out"), "seed": 3,
        "model": {"architecture": test_loop.ARCHITECTURE, "init_seed": 1},
        "data": {"tokenizer": files["tokenizer"], "train_files": [files["heldout"]], "eval_files": [files["heldout"]],
                 "use_chat_template": False, "max_prompt_tokens": 6},
        "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 6},
        "reward": test_loop.DENSE_REWARD, "env": ENV, "eval": {"samples": 2, "k": [1, 2]},
        "filter": {"output": str(tmp_path / "kept.jsonl"), "samples": 2, "bands": {"t": {"low": 0, "high": 1}}},
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "eval.json"
    assert main(["eval", str(path), "--json", str(out), "--max-prompts", "4"]) == 0
    result = json.loads(out.read_text())
    assert result["environment"]["env/turns_per_conversation"] == TURNS
    assert result["environment"]["env/finished_answered"] == 1.0
    assert "environment: env/turns_per_conversation=3" in capsys.readouterr().out
    played = []
    run_episodes = episodes.run_episodes
    monkeypatch.setattr(episodes, "run_episodes", lambda *a, **k: played.append(run_episodes(*a, **k)) or played[-1])
    assert main(["filter", str(path)]) == 0
    assert played and all(c.num_model_turns == TURNS for batch in played for c in batch.conversations)
