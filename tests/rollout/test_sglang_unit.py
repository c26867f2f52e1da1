"""SGLang client/engine pieces that need no real server: decoding, configs, bad input.

Bad-input cases a real server cannot be made to produce (a response without
logprobs, a push whose version does not change) are served by a small stub
HTTP server that answers like SGLang 0.5.23 but wrongly.
"""

from __future__ import annotations

import base64
import os
import http.server
import json
import socket
import threading

import numpy as np
import pytest

from jaxrl.models import ModelConfig
from jaxrl.rollout.base import LogprobKind, SamplingParams
from jaxrl.rollout.sglang import (
    ClientConfig,
    PushConfig,
    SGLangClient,
    SGLangEngine,
    SGLangRequestError,
    SGLangResponseError,
    ServerConfig,
    ServerManager,
    WeightPushError,
    decode_routed_experts,
)
from jaxrl.rollout.sglang.client import parse_samples
from jaxrl.rollout.sglang.testing import random_decoder, write_random_checkpoint

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=8, max_position_embeddings=64)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# A meta_info.routed_experts recorded from a real SGLang 0.5.23 CPU server (Qwen3-MoE,
# 2 layers, top-2, prompt of 4 tokens + 4 generated: 7 fed positions).
RECORDED_ROUTES = ("BwAAAAQAAAAFAAAAAAAAAAMAAAAFAAAABQAAAAQAAAADAAAABwAAAAUAAAAAAAAAAgAAAAYAAAAFAAAABwAAAAMAAAAG"
                   "AAAABAAAAAUAAAADAAAAAQAAAAUAAAAAAAAAAwAAAAQAAAADAAAAAQAAAA==")


def test_decode_routed_experts_recorded_response():
    routes = decode_routed_experts(RECORDED_ROUTES, num_positions=7, top_k=2)
    assert routes.shape == (7, 2, 2) and routes.dtype == np.int32
    # Hand-decoded: the first 16 bytes are little-endian int32 7, 4, 5, 0.
    np.testing.assert_array_equal(routes[0], [[7, 4], [5, 0]])
    np.testing.assert_array_equal(routes[-1], [[3, 4], [3, 1]])
    assert routes.min() >= 0 and routes.max() < 8


def test_recorded_routes_split_into_prompt_and_output_positions():
    """The recorded response's 7 positions: prompt positions 0..2, then the 4 that produced outputs."""
    outputs = [9, 8, 7, 6]
    response = {"output_ids": outputs, "meta_info": {
        "finish_reason": {"type": "length"}, "weight_version": "v1", "routed_experts": RECORDED_ROUTES,
        "output_token_logprobs": [[-0.5, token, None] for token in outputs]}}
    (sample,) = parse_samples(response, [1, 2, 3, 4], SamplingParams(), 1, moe_top_k=2, where="recorded")
    assert sample.prompt_routed_experts.shape == (3, 2, 2) and sample.routed_experts.shape == (4, 2, 2)
    np.testing.assert_array_equal(sample.prompt_routed_experts[0], [[7, 4], [5, 0]])  # hand-decoded, as above
    np.testing.assert_array_equal(sample.routed_experts[-1], [[3, 4], [3, 1]])
    np.testing.assert_array_equal(np.concatenate([sample.prompt_routed_experts, sample.routed_experts]),
                                  decode_routed_experts(RECORDED_ROUTES, num_positions=7, top_k=2))


def test_decode_routed_experts_roundtrip_and_bad_length():
    want = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    encoded = base64.b64encode(want.astype("<i4").tobytes()).decode()
    np.testing.assert_array_equal(decode_routed_experts(encoded, 5, 2), want)
    with pytest.raises(SGLangResponseError, match="not a multiple of 4 positions x top_k 2"):
        decode_routed_experts(encoded, 4, 2)


def test_server_config_validation_names_the_field():
    with pytest.raises(ValueError, match="ServerConfig.dtype"):
        ServerConfig(model_path="m", dtype="fp8")
    with pytest.raises(ValueError, match="ServerConfig.num_servers"):
        ServerConfig(model_path="m", num_servers=0)
    with pytest.raises(ValueError, match="ServerConfig.logprob_kind"):
        ServerConfig(model_path="m", logprob_kind="tempered")
    with pytest.raises(ValueError, match="ClientConfig.max_tries"):
        ClientConfig(max_tries=0)
    with pytest.raises(ValueError, match="PushConfig.probe_ids"):
        PushConfig(probe_ids=(3,))


def test_server_command_and_environment_follow_the_cpu_recipe():
    config = ServerConfig(model_path="/m", base_port=31000, num_servers=2, return_routed_experts=True,
                          extra_args=("--mem-fraction-static", "0.5"))
    assert config.urls == ("http://127.0.0.1:31000", "http://127.0.0.1:31001")
    argv = config.command(31001, "/m", "v3")
    for flag in ("--skip-tokenizer-init", "--enable-return-routed-experts", "--disable-cuda-graph",
                 "--sleep-on-idle"):
        assert flag in argv
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--weight-version") + 1] == "v3"
    assert argv[-2:] == ["--mem-fraction-static", "0.5"]
    env = config.environment()
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(":")[0].endswith("scripts/sglang_cpu")
    processed = ServerConfig(model_path="/m", logprob_kind=LogprobKind.PROCESSED, device="cuda")
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in processed.environment()
    assert "--attention-backend" not in processed.command(30000, "/m", "default")


def test_missing_model_path_names_the_path(tmp_path):
    manager = ServerManager(ServerConfig(model_path=str(tmp_path / "nope"), base_port=free_port()))
    with pytest.raises(FileNotFoundError, match=r"ServerConfig.model_path: .*nope.*folder does not exist"):
        manager.start()
    assert not manager.is_running(0)


def test_unreachable_server_fails_after_n_tries_naming_server_and_request():
    port = free_port()
    failures = []
    client = SGLangClient([f"http://127.0.0.1:{port}"], ClientConfig(max_tries=3, backoff_s=0.01),
                          on_failure=failures.append)
    with pytest.raises(SGLangRequestError) as err:
        client.request(0, "POST", "/generate", {"input_ids": [1]}, "request 7 of batch 1")
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "request 7 of batch 1" in message
    assert "failed after 3 tries" in message and "Check that the server is running" in message
    assert failures == [0, 0]  # the manager hook ran between tries, not after the last one
    client.close()


class _Stub(http.server.BaseHTTPRequestHandler):
    """Answers like SGLang, but /generate leaves out logprobs and pushes never change the version."""

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"weight_version": "default"})

    def do_POST(self):
        json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/generate":
            self._reply({"output_ids": [3, 4], "meta_info": {"finish_reason": {"type": "length"},
                                                            "weight_version": "default"}})
        else:
            self._reply({"success": True, "message": "ok"})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stub_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stub")
    model = write_random_checkpoint(str(folder / "model"), ModelConfig(**TINY))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = ServerConfig(model_path=str(folder / "model"), base_port=server.server_address[1])
    engine = SGLangEngine(ServerManager(config), push=PushConfig(checkpoint_dir=str(folder / "pushed")),
                          client=ClientConfig(max_tries=1))
    yield engine, model
    engine.close()
    server.shutdown()


def test_response_without_logprobs_names_server_request_and_cause(stub_engine):
    engine, _ = stub_engine
    with pytest.raises(SGLangResponseError) as err:
        engine.generate([[1, 2], [5]], SamplingParams(max_new_tokens=2))
    message = str(err.value)
    assert engine.manager.urls[0] in message and "request 0 of batch" in message
    assert "no output_token_logprobs for 2 output tokens" in message


def test_push_whose_version_does_not_change_is_an_error(stub_engine):
    engine, model = stub_engine
    with pytest.raises(WeightPushError) as err:
        engine.update_weights(model, "v1")
    message = str(err.value)
    assert engine.manager.urls[0] in message
    assert "reports weight_version 'default' after the push of 'v1'" in message
    assert engine.weight_version == "default"
    with pytest.raises(ValueError, match="version 'default' is the current one"):
        engine.update_weights(model, "default")


def test_raw_request_on_a_processed_fleet_is_refused(stub_engine, tmp_path):
    engine, _ = stub_engine
    config = ServerConfig(model_path=engine.manager.model_path, base_port=free_port(),
                          logprob_kind=LogprobKind.PROCESSED)
    processed = SGLangEngine(ServerManager(config))
    with pytest.raises(ValueError, match="logprob_kind is RAW but the servers were started with"):
        processed.generate([[1, 2]], SamplingParams(logprob_kind=LogprobKind.RAW))
    processed.close()


def test_prompt_outside_the_vocabulary_names_the_prompt(stub_engine):
    engine, _ = stub_engine
    with pytest.raises(ValueError, match=r"prompt 1 has token ids \[64\] outside \[0, 64\)"):
        engine.generate([[1], [64]], SamplingParams())
    with pytest.raises(ValueError, match=r"PushConfig.probe_ids has ids up to 99, outside the vocabulary \[0, 64\)"):
        SGLangEngine(engine.manager, push=PushConfig(probe_ids=(1, 99)))


def test_checkpoint_export_is_atomic(tmp_path, stub_engine):
    """A failing export leaves neither a final nor a partial folder behind."""
    engine, model = stub_engine

    def crashing_export(params, path):
        random_decoder(ModelConfig(**TINY))  # some work, then a crash mid-write
        (tmp_path / "marker").write_text(path)
        raise OSError("disk full")

    broken = SGLangEngine(engine.manager, export_fn=crashing_export,
                          push=PushConfig(checkpoint_dir=str(tmp_path / "pushed")))
    with pytest.raises(OSError, match="disk full"):
        broken.update_weights(model, "v9")
    assert list((tmp_path / "pushed").iterdir()) == []
    broken.close()


FAKE_LAUNCH_SERVER = '''
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like SGLang's scheduler
with open(os.environ["FAKE_PIDS"], "a") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''

FAKE_TRAINER = '''
import os, signal, sys, time
from jaxrl.rollout.sglang.server import ServerConfig, ServerManager
model, port, fake_path, pids, logs, mode = sys.argv[1:]
config = ServerConfig(model_path=model, base_port=int(port), num_servers=2, python=sys.executable,
                      env={"PYTHONPATH": fake_path, "FAKE_PIDS": pids}, log_dir=logs, startup_timeout_s=60)
ServerManager(config).start()
if mode == "exception":
    raise RuntimeError("the trainer crashed")
os.kill(os.getpid(), signal.SIGTERM if mode == "sigterm" else signal.SIGKILL)
time.sleep(60)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode", ["exception", "sigterm", "sigkill"])
def test_no_server_outlives_a_crashed_trainer(tmp_path, mode):
    """The trainer dies three ways; its servers (a stand-in for sglang.launch_server that
    answers /health and starts a child like SGLang's scheduler) must die with it."""
    import subprocess
    import sys
    import time

    (tmp_path / "fake" / "sglang").mkdir(parents=True)
    (tmp_path / "fake" / "sglang" / "__init__.py").write_text("")
    (tmp_path / "fake" / "sglang" / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    pids_file = tmp_path / "pids"
    base = free_port()
    while True:  # two consecutive free ports
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", base + 1))
            break
        except OSError:
            base = free_port()
    result = subprocess.run(
        [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "model"), str(base), str(tmp_path / "fake"),
         str(pids_file), str(tmp_path / "logs"), mode],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stderr
    launchers, children = zip(*(map(int, line.split()) for line in pids_file.read_text().split("\n") if line))
    assert len(launchers) == 2
    # SIGKILL leaves no chance to clean up: the kernel kills the launchers (PR_SET_PDEATHSIG);
    # their children are then SGLang's job (its subprocesses set the same flag), not ours.
    watched = launchers if mode == "sigkill" else launchers + children
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in watched) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in watched if _alive(p)]
    for p in launchers + children:  # clean up what this test started, by pid, pass or fail
        if _alive(p):
            os.kill(p, 9)
    assert not survivors, (mode, survivors)
