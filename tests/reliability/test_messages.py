"""Bad inputs that used to end in a traceback (exit 1) or a misleading message: each now ends with
one line naming what to fix, exit 2, or is taken as a user would expect.

The reward functions below are referenced as f"{__name__}:name" (``kind: python``), so the reward
worker imports this module: keep its imports light.
"""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from cli_checks import one_line_exit_2, write_config
from jaxrl.cli import main
from jaxrl.data import DataConfig, load_examples, load_tokenizer
from jaxrl.reward.base import call_reward
from jaxrl.reward.sandbox import MAX_OUTPUT_CHARS

PRINTED = 100_000


def loud_number(prompt, response, response_ids, row):
    """Prints a flood and returns a bare number (most reward code returns one)."""
    print("x" * PRINTED)
    return 1


def a_string(prompt, response, response_ids, row):
    return "1.0"


def test_fewer_rows_than_a_batch(tmp_path, run_config, capfd):
    """Before: a ValueError traceback from the batch iterator, naming ``batch_size`` (no such key)."""
    config = write_config(tmp_path, run_config(tmp_path / "out", rollout={"prompts_per_step": 1000}))
    one_line_exit_2(capfd, ["train", config], "a batch of 1000 prompts (rollout.prompts_per_step; sft.batch_size "
                                               "in SFT) exceeds the ")


@pytest.mark.parametrize("section, expected", [
    ({"reward": {"tasks": {"t": {"kind": "python", "function": "no_such_module:f"}}}},
     "reward.tasks.t.function 'no_such_module:f' cannot be imported: ModuleNotFoundError: No module named "
     "'no_such_module'; check the module is on PYTHONPATH"),
    ({"reward": {"tasks": {"t": {"kind": "python", "function": f"{__name__}:no_such_function"}}}},
     f"reward.tasks.t.function '{__name__}:no_such_function': module '{__name__}' has no attribute"),
    ({"env": {"default_task": "t", "tasks": {"t": {"kind": "python", "environment": "no_such_module:Env",
                                                    "limits": {"max_total_tokens": 32}}}}},
     "env.tasks.t.environment 'no_such_module:Env' cannot be imported: ModuleNotFoundError"),
])
def test_an_unimportable_reward_or_environment(tmp_path, run_config, capfd, section, expected):
    """Before: a ValueError traceback (exit 1)."""
    one_line_exit_2(capfd, ["train", write_config(tmp_path, run_config(tmp_path / "out", **section))], expected)


class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the handler's name)
        body = b"[1, 2]"  # JSON, but not SGLang's /model_info object
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def garbage_server():
    server = HTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_a_judge_url_that_is_down_or_answers_garbage(tmp_path, run_config, demo_files, capfd, garbage_server):
    """Before: a ValueError traceback for a URL nobody answers, an AttributeError traceback for a
    reply that is JSON but not an object."""
    down = HTTPServer(("127.0.0.1", 0), _Garbage)
    closed = f"http://127.0.0.1:{down.server_port}"
    down.server_close()  # nothing listens there now
    not_an_object = "ValueError: the reply is list '[1, 2]', not a JSON object"
    for url, why in ((closed, "ConnectionError"), (garbage_server, not_an_object)):
        config = run_config(tmp_path / "out", reward={"tasks": {"t": {"kind": "judge", "judge": {"server": "g"}}}},
                            judges={"g": {"tokenizer": demo_files["tokenizer"], "urls": [url],
                                          "use_chat_template": False}})
        one_line_exit_2(capfd, ["train", write_config(tmp_path, config)],
                         f"judges.g: {url}: no SGLang server answers GET {url}/model_info ({why}")


def test_a_reward_may_return_a_number_and_its_output_is_capped(tmp_path, run_config, capfd):
    """Before: a bare number was 'float' object has no attribute 'score' on every sample (all
    scored 0), and each call's 100,000 printed characters reached the trainer's stdout, where its
    JSON summary goes. Now the number is the score, and a sample's output reaches stderr cut at
    MAX_OUTPUT_CHARS with one line saying how much was dropped."""
    config = run_config(tmp_path / "out", steps=1,
                        reward={"tasks": {"t": {"kind": "python", "function": f"{__name__}:loud_number"}}})
    assert main(["train", write_config(tmp_path, config)]) == 0
    out, err = capfd.readouterr()
    samples = config["rollout"]["prompts_per_step"] * config["rollout"]["group_size"]
    assert "x" not in out.replace("max", "")  # the summary alone (its keys hold no other x)
    assert err.count("x" * MAX_OUTPUT_CHARS) == samples and "x" * (MAX_OUTPUT_CHARS + 1) not in err
    # print() adds a newline: PRINTED + 1 characters per sample
    assert err.count(f"{PRINTED + 1 - MAX_OUTPUT_CHARS:,} more characters of a reward's output dropped") == samples
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    assert step["reward/mean"] == 1.0 and step["reward/raised"] == 0.0


def test_a_reward_returning_something_else_is_named():
    outcome = call_reward(a_string, "p", "r", [1], {})
    assert outcome.kind == "raised" and outcome.error == (
        "TypeError: the reward function returned str '1.0'; return a number or jaxrl.reward.RewardResult(score=...)")


def test_a_null_prompt_is_an_empty_field_not_a_missing_one(tmp_path, demo_files, caplog):
    """Before: ``{"prompt": null}`` was reported as "missing field 'prompt'", beside a list of
    fields that holds 'prompt'."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": null}\n{"prompt": "1+1="}\n{"answer": "2"}\n')
    with caplog.at_level(logging.WARNING):
        _, report = load_examples([str(path)], DataConfig(use_chat_template=False),
                                  load_tokenizer(demo_files["tokenizer"]))
    assert report.bad_by_reason == {"empty_prompt": 1, "missing_field": 1}
    assert "empty or non-text field 'prompt' (line 1: is null)" in caplog.text


def test_an_env_config_error_names_the_key_without_the_section(tmp_path, run_config, capfd):
    """Before: "env: {'tasks': {...the whole section...}} matches none of EnvConfig | None (...)"."""
    config = run_config(tmp_path / "out", env={"tasks": {"t": {"kind": "tools", "tools": ["nosuch"]}}})
    one_line_exit_2(capfd, ["train", write_config(tmp_path, config)],
                     "jaxrl train: config error: section env.tasks.t (EnvTaskConfig): env task tools ['nosuch'] are "
                     "not built-in tools")
    assert "matches none" not in capfd.readouterr().err
