"""The multi-turn driver: masks token by token, limits, routing, and the learner recompute across
turns (docs/agentic.md#the-multi-turn-driver)."""

import json
import string

import numpy as np
import pytest

from jaxrl.data.tokenizer import make_char_tokenizer
from jaxrl.env import (
    EnvConfig, Environment, EnvLimits, EnvRouter, EnvTaskConfig, StepResult, ToolEnvironment, Calculator,
    run_episodes,
)
from jaxrl.rollout.base import Conversation, RolloutEngine, Sample, SamplingParams

WORDS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_start|>"]
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function.name') | join(',') }}<eos>\n"
            "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
            "{{ m.content }}\n</tool_response><eos>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<eos>\n"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    alphabet = string.ascii_letters + string.digits + string.punctuation + " \n"
    return make_char_tokenizer(str(tmp_path_factory.mktemp("tok")), alphabet, WORDS, chat_template=TEMPLATE)


def _call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Answers each conversation with its script's next turn (text, then eos; the last one repeats);
    logprob of token j is -j/100."""

    def __init__(self, tokenizer, scripts: dict[tuple[int, ...], list[str]]):
        self.tokenizer, self.scripts, self.calls, self.turns = tokenizer, scripts, [], {}

    def generate(self, prompts, params, n=1):
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            key = next(k for k in self.scripts if tuple(prompt[:len(k)]) == k)
            self.turns[key] = self.turns.get(key, -1) + 1
            script = self.scripts[key]
            ids = self.tokenizer.encode(script[min(self.turns[key], len(script) - 1)], add_special_tokens=False)
            ids = (ids + [self.tokenizer.eos_token_id])[:params.max_new_tokens]
            finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
            out.append([Sample(np.asarray(prompt), np.asarray(ids), -np.arange(len(ids)) / 100.0, finish, "0")])
        return out

    def update_weights(self, params, version):
        return None

    @property
    def weight_version(self):
        return "0"


def _tool_env(tokenizer, **limits):
    return ToolEnvironment(tokenizer, {"calculator": Calculator()}, EnvLimits(**limits))


def test_conversation_mask_is_one_exactly_on_model_tokens(tokenizer):
    env = _tool_env(tokenizer)
    prompt = env.reset({"prompt": "What is 3+4?"}).token_ids.tolist()
    engine = ScriptedEngine(tokenizer, {tuple(prompt): [_call("3+4"), "It is 7."]})
    batch = run_episodes(engine, [env], [{"prompt": "What is 3+4?"}], SamplingParams(max_new_tokens=64))
    (episode,) = batch.episodes
    eos = tokenizer.eos_token_id
    turn1 = tokenizer.encode(_call("3+4"), add_special_tokens=False) + [eos]
    observation = tokenizer.encode("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><eos>\n"
                                   "<|im_start|>assistant\n", add_special_tokens=False)
    turn2 = tokenizer.encode("It is 7.", add_special_tokens=False) + [eos]
    conv = episode.conversation
    assert conv.token_ids.tolist() == prompt + turn1 + observation + turn2
    expected_mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    for t, (got, want) in enumerate(zip(conv.model_mask.tolist(), expected_mask, strict=True)):
        assert got == want, f"token {t} ({tokenizer.decode([int(conv.token_ids[t])])!r}): mask {got}, want {want}"
    assert conv.turn_ids.tolist() == ([-1] * len(prompt) + [0] * len(turn1) + [-1] * len(observation)
                                      + [1] * len(turn2))
    np.testing.assert_allclose(conv.rollout_logprobs[conv.turn_ids == 1], -np.arange(len(turn2)) / 100.0)
    assert not conv.rollout_logprobs[conv.model_mask == 0].any()
    assert episode.finish == "answered" and episode.counts["tool_calls"] == 1 and episode.counts["tool_errors"] == 0
    assert conv.finish_reasons == ("stop", "stop")
    assert "Tools: calculator" in tokenizer.decode(prompt)


def test_limits_errors_and_metrics(tokenizer):
    rows = [{"prompt": p} for p in ("loop", "long", "bad", "many", "ends")]
    envs = [_tool_env(tokenizer, max_turns=3), _tool_env(tokenizer, max_observation_tokens=40),
            _tool_env(tokenizer), _tool_env(tokenizer, max_tool_calls_per_turn=2),
            _tool_env(tokenizer, max_total_tokens=60)]
    prompts = [tuple(env.reset(row).token_ids.tolist()) for env, row in zip(envs, rows, strict=True)]
    scripts = {prompts[0]: [_call("1+1")], prompts[1]: [_call("9" * 200), "done"],
               prompts[2]: ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{oops", "ok"],
               prompts[3]: [_call("1") * 3, "ok"], prompts[4]: [_call("2*3")]}
    engine = ScriptedEngine(tokenizer, scripts)
    batch = run_episodes(engine, envs, rows, SamplingParams(max_new_tokens=256))
    loop, long, bad, many, ends = batch.episodes
    assert loop.finish == "max_turns" and loop.conversation.num_model_turns == 3
    assert long.finish == "answered" and long.counts["truncations"] == 1
    observation = long.conversation.token_ids[(long.conversation.model_mask == 0)][len(prompts[1]):]
    assert len(observation) <= 40 and "[... truncated" in tokenizer.decode(observation.tolist())
    assert bad.counts == {"tool_calls": 2, "tool_errors": 2, "tool_timeouts": 0, "truncations": 0}
    assert "unknown tool 'nope'" in tokenizer.decode(bad.conversation.token_ids.tolist())
    assert many.counts["tool_calls"] == 3 and many.counts["tool_errors"] == 1
    assert "at most 2 tool calls per turn; the other 1 were not run" in tokenizer.decode(
        many.conversation.token_ids.tolist())
    assert ends.finish == "max_tokens" and len(ends.conversation.token_ids) <= 60
    # turn 1: "ends" has its own token budget (one call), the other four share one; then the batch shrinks
    assert engine.calls[:2] == [1, 4] and engine.calls[-1] < 4
    m = batch.metrics
    assert m["env/finished_max_turns"] == m["env/finished_max_tokens"] == 0.2
    assert m["env/finished_answered"] == 0.6 and m["env/finished_by_limit"] == 0.4
    errors, calls = (sum(e.counts[k] for e in batch.episodes) for k in ("tool_errors", "tool_calls"))
    assert m["env/tool_error_rate"] == pytest.approx(errors / calls) and errors >= 3


class CountingEnv(Environment):
    """Appends a fixed observation after every model turn; never ends by itself."""

    def __init__(self, limits=None, observation=(3, 4, 5), fail=False):
        self.limits = limits or EnvLimits(max_turns=3, max_total_tokens=120)
        self.observation, self.fail = observation, fail

    def reset(self, row):
        return Conversation.from_prompt(row["ids"])

    def step(self, conversation, model_turn):
        if self.fail:
            raise RuntimeError("broken environment")
        return StepResult(observation_ids=self.observation)


def make_counting_env(tokenizer, task):
    return CountingEnv(fail=task.options.get("fail", False))


def test_router_picks_environments_by_row_field(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text("from test_driver import make_counting_env\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    config = EnvConfig(tasks={"tools": EnvTaskConfig(tools=("calculator",)),
                              "mine": EnvTaskConfig(kind="python", environment="my_envs:make_counting_env",
                                                    options={"fail": True})})
    router = EnvRouter(config, tokenizer)
    assert isinstance(router.make({"prompt": "x"}), ToolEnvironment)
    broken = router.make({"task": "mine", "ids": [1, 2]})
    assert isinstance(broken, CountingEnv) and broken.fail
    with pytest.raises(ValueError, match="has no environment"):
        router.make({"task": "other"})
    with pytest.raises(ValueError, match="env.tasks.x.environment 'no_such_module:f' cannot be imported"):
        missing = EnvTaskConfig(kind="python", environment="no_such_module:f")
        EnvRouter(EnvConfig(default_task=None, tasks={"x": missing}), tokenizer)
    with pytest.raises(ValueError, match="not built-in tools"):
        EnvTaskConfig(tools=("browser",))
    engine = ScriptedEngine(tokenizer, {(1, 2): ["12"]})
    batch = run_episodes(engine, [broken], [{"ids": [1, 2]}], SamplingParams(max_new_tokens=8))
    assert batch.episodes[0].finish == "env_error" and "broken environment" in batch.episodes[0].error


def test_routes_concatenate_across_turns():
    routes = lambda n, v: np.full((n, 2, 1), v, np.int32)  # noqa: E731
    conv = Conversation.from_prompt([5, 6, 7])
    conv = conv.add_model_turn(Sample(np.array([5, 6, 7]), np.array([8, 9]), np.zeros(2), "stop", "0",
                                      routed_experts=routes(2, 1), prompt_routed_experts=routes(2, 0)))
    conv = conv.add_environment_tokens([3, 3])
    conv = conv.add_model_turn(Sample(conv.token_ids, np.array([4]), np.zeros(1), "length", "0",
                                      routed_experts=routes(1, 3), prompt_routed_experts=routes(6, 2)))
    # positions 0-1 prompt prefill, 2-3 turn 0 decode, 4-5 next prefill (last model token, first tool token), 6 decode
    assert conv.routed_experts[:, 0, 0].tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert len(conv.routed_experts) == len(conv.token_ids) - 1 and conv.finish_reasons == ("stop", "length")
