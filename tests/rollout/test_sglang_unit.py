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
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from jaxrl.models import ModelConfig
from jaxrl.rollout.base import LogprobKind, SamplingParams
from jaxrl.rollout.sglang import (
    ClientConfig,
    PushConfig,
    PushVerificationError,
    SGLangClient,
    SGLangEngine,
    SGLangRequestError,
    SGLangResponseError,
    ServerConfig,
    ServerManager,
    decode_routed_experts,
)
from jaxrl.rollout.sglang.client import parse_samples
from jaxrl.rollout.sglang.testing import random_decoder, write_random_checkpoint
from server_ports import free_base_port

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=8, max_position_embeddings=64)


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
    with pytest.raises(ValueError, match="PushConfig.chunk_mib: got 0"):
        PushConfig(method="tensor", chunk_mib=0)


def test_server_command_and_environment_follow_the_cpu_recipe():
    config = ServerConfig(model_path="/m", base_port=31000, num_servers=2, return_routed_experts=True,
                          extra_args=("--chunked-prefill-size", "512"))
    assert config.urls == ("http://127.0.0.1:31000", "http://127.0.0.1:31001")
    argv = config.command(31001, "/m", "v3")
    for flag in ("--skip-tokenizer-init", "--enable-return-routed-experts", "--disable-cuda-graph",
                 "--sleep-on-idle"):
        assert flag in argv
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--weight-version") + 1] == "v3"
    assert argv[-2:] == ["--chunked-prefill-size", "512"]
    assert "--tp-size" not in argv and "--mem-fraction-static" not in argv  # SGLang's defaults unless set
    env = config.environment()
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert env["PYTHONPATH"].split(":")[0].endswith("scripts/sglang_cpu")
    processed = ServerConfig(model_path="/m", logprob_kind=LogprobKind.PROCESSED, device="cuda")
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in processed.environment()
    assert "--attention-backend" not in processed.command(30000, "/m", "default")


# Stands in for SGLang's entry point: parses --api-key as SGLang's server_args does (one value).
_ARGPARSE_SERVER = """
import argparse, json
parser = argparse.ArgumentParser()
parser.add_argument("--port", type=int)
parser.add_argument("--api-key", type=str, default=None)
print(json.dumps(vars(parser.parse_args())))
"""


def _launch_stand_in(tmp_path, server_source: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    """``processes.LAUNCHER`` with ``env`` and ``args``, running ``server_source`` as ``sglang.launch_server``."""
    from jaxrl.rollout.sglang.processes import LAUNCHER

    (tmp_path / "sglang").mkdir(exist_ok=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(server_source)
    return subprocess.run([sys.executable, "-c", LAUNCHER, *args], env={**env, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("key", ["-starts-with-a-dash", "plain_key", ""])
def test_the_launcher_hands_any_api_key_to_the_server(tmp_path, key):
    """Before: ``--api-key KEY`` as two arguments, so a key starting with "-" (1 in 64 of
    ``secrets.token_urlsafe``'s) read as a missing value: "argument --api-key: expected one argument",
    and the suite's keyed fleet failed to start, every SGLang test with it."""
    from jaxrl.rollout.sglang.processes import LAUNCH_API_KEY_ENV

    env = {**os.environ, "JAXRL_SGLANG_PARENT_PID": str(os.getpid()), LAUNCH_API_KEY_ENV: key}
    done = _launch_stand_in(tmp_path, _ARGPARSE_SERVER, env, "--port", "30000")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"port": 30000, "api_key": key or None}


# Stands in for SGLang's entry point: forces "spawn" as SGLang does, then reports how a child starts.
_START_METHOD_SERVER = """
import multiprocessing
multiprocessing.set_start_method("spawn", force=True)
print(multiprocessing.get_start_method())
"""


def test_the_launcher_forks_the_children_of_a_cpu_server_and_spawns_those_of_a_gpu_server(tmp_path):
    for device, method in (("cpu", "fork"), ("cuda", "spawn")):
        environment = ServerConfig(model_path="/m", device=device).environment()
        done = _launch_stand_in(tmp_path, _START_METHOD_SERVER, environment)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == method, device


def test_tensor_parallel_memory_and_gpus_are_fields_and_reach_each_server():
    config = ServerConfig(model_path="/m", device="cuda", num_servers=2, tensor_parallel=2, mem_fraction_static=0.7,
                          devices=((4, 5), (6, 7)))
    argv = config.command(30000, "/m", "default")
    assert argv[argv.index("--tp-size") + 1] == "2" and argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert config.environment(index=1, base={})["CUDA_VISIBLE_DEVICES"] == "6,7"
    # A scheduler's CUDA_VISIBLE_DEVICES numbers the host's GPUs for this job: local id i is its i-th entry.
    given = {"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"}
    assert config.environment(index=0, base=given)["CUDA_VISIBLE_DEVICES"] == "12,13"
    for flag, field in (("--tp", "tensor_parallel"), ("--tp-size=2", "tensor_parallel"),
                        ("--mem-fraction-static", "mem_fraction_static"), ("--base-gpu-id", "devices")):
        with pytest.raises(ValueError, match=f"extra_args: {flag.split('=')[0]} is set by ServerConfig.{field}"):
            ServerConfig(model_path="/m", extra_args=(flag,))
    with pytest.raises(ValueError, match=r"ServerConfig.devices: .* num_servers=2 tuples of tensor_parallel=2"):
        ServerConfig(model_path="/m", num_servers=2, tensor_parallel=2, devices=((4, 5),))


def test_missing_model_path_names_the_path(tmp_path):
    manager = ServerManager(ServerConfig(model_path=str(tmp_path / "nope"), base_port=free_base_port()))
    with pytest.raises(FileNotFoundError, match=r"ServerConfig.model_path: .*nope.*folder does not exist"):
        manager.start()
    assert not manager.is_running(0)


def test_unreachable_server_fails_after_n_tries_naming_server_and_request():
    port = free_base_port()
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
    engine = SGLangEngine(ServerManager(config), push=PushConfig(method="disk", checkpoint_dir=str(folder / "pushed")),
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
    with pytest.raises(PushVerificationError) as err:
        engine.update_weights(model, "v1")
    message = str(err.value)
    assert engine.manager.urls[0] in message
    assert "reports weight_version 'default' after the push of 'v1'" in message
    assert engine.weight_version == "default"
    with pytest.raises(ValueError, match="version 'default' is the current one"):
        engine.update_weights(model, "default")


def test_raw_request_on_a_processed_fleet_is_refused(stub_engine, tmp_path):
    engine, _ = stub_engine
    config = ServerConfig(model_path=engine.manager.model_path, base_port=free_base_port(),
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
                          push=PushConfig(method="disk", checkpoint_dir=str(tmp_path / "pushed")))
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
from jaxrl.rollout.sglang.launch import ServerConfig
from jaxrl.rollout.sglang.server import ServerManager
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
    base = free_base_port(2)
    result = subprocess.run(
        [sys.executable, "-c", FAKE_TRAINER, str(tmp_path / "model"), str(base), str(tmp_path / "fake"),
         str(pids_file), str(tmp_path / "logs"), mode],
        capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stderr
    pids = [tuple(map(int, line.split())) for line in pids_file.read_text().split("\n") if line]
    launchers, children = zip(*pids, strict=True)
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


# ----- API keys (servers off loopback require one) ------------------------------------------

def test_loopback_is_127_8_ipv6_one_and_localhost_only():
    from jaxrl.rollout.sglang.access import is_loopback

    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "myhost.example", "128.0.0.1"):
        assert not is_loopback(host), host
    assert ServerConfig(model_path="m", host="::1", base_port=31000).urls == ("http://[::1]:31000",)


def test_host_and_api_key_validation_name_the_field():
    with pytest.raises(ValueError, match="ServerConfig.host: got ''"):
        ServerConfig(model_path="m", host="")
    with pytest.raises(ValueError, match="ServerConfig.host"):
        ServerConfig(model_path="m", host="0.0.0.0 ")
    with pytest.raises(ValueError, match="ServerConfig.api_key: expected printable") as err:
        ServerConfig(model_path="m", api_key="two words")
    assert "two words" not in str(err.value)
    with pytest.raises(ValueError, match="ServerConfig.extra_args: --api-key is set by ServerConfig.api_key"):
        ServerConfig(model_path="m", extra_args=("--api-key=abc",))


def test_off_loopback_without_a_key_generates_one_for_the_launch_only(monkeypatch):
    from jaxrl.rollout.sglang.access import EXTERNAL_API_KEY_ENV
    from jaxrl.rollout.sglang.processes import LAUNCH_API_KEY_ENV

    monkeypatch.setenv(LAUNCH_API_KEY_ENV, "stale")  # from some outer process: never forwarded as is
    monkeypatch.setenv(EXTERNAL_API_KEY_ENV, "an-external-fleets-key")
    config = ServerConfig(model_path="/m", host="0.0.0.0", base_port=31000)
    manager, other = ServerManager(config), ServerManager(config)
    key = manager.api_key
    assert len(key) >= 32 and key != other.api_key  # random, per manager
    argv = config.command(31000, "/m", "default")
    env = config.environment(key)
    assert env[LAUNCH_API_KEY_ENV] == key and EXTERNAL_API_KEY_ENV not in env
    shown = [" ".join(argv), repr(config), manager.describe(0), str(config.urls)]
    assert not any(key in text for text in shown)
    # loopback, no key: none is made, none reaches the launcher
    local = ServerManager(ServerConfig(model_path="/m", base_port=31000))
    assert local.api_key == ""
    assert LAUNCH_API_KEY_ENV not in local.config.environment(local.api_key)
    # a key given is used on loopback too, and never shown
    keyed = ServerConfig(model_path="/m", api_key="given-key", base_port=31000)
    assert ServerManager(keyed).api_key == "given-key" and "given-key" not in repr(keyed)


FAKE_KEYED_LAUNCH_SERVER = '''
import argparse, http.server, json, os, sys
argv = sys.argv[1:]
parser = argparse.ArgumentParser()  # the three options as SGLang's server_args parses them
for flag, kind in (("--host", str), ("--port", int), ("--api-key", str)):
    parser.add_argument(flag, type=kind)
args = parser.parse_known_args(argv)[0]
host, port, key = args.host, args.port, args.api_key
with open(os.environ["FAKE_RECORD"], "w") as f:
    json.dump({"argv": argv, "env_keys": sorted(k for k in os.environ if "API_KEY" in k),
               "cmdline": open("/proc/self/cmdline").read(), "api_key": key}, f)
print(f"server_args=ServerArgs(host={host!r}, api_key={key!r})", flush=True)  # as SGLang logs it
if os.environ.get("FAKE_MODE") == "crash":
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, port), Health).serve_forever()
'''


def _fake_sglang(tmp_path) -> str:
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(FAKE_KEYED_LAUNCH_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(fake)


def test_generated_key_reaches_sglang_as_api_key_but_no_command_line_or_log(tmp_path, caplog):
    """Through the real launcher: SGLang's argv ends with --api-key=KEY, the process's command
    line (what ps shows) and environment do not hold it, the warning names the host, not the key,
    and the server log (SGLang prints its server_args, key included) is private."""
    import logging
    import stat
    import sys

    import requests

    from jaxrl.rollout.sglang.access import EXTERNAL_API_KEY_ENV

    record = tmp_path / "record.json"
    config = ServerConfig(model_path=str(tmp_path / "model"), host="0.0.0.0", base_port=free_base_port(),
                          python=sys.executable, log_dir=str(tmp_path / "logs"), startup_timeout_s=60,
                          env={"PYTHONPATH": _fake_sglang(tmp_path), "FAKE_RECORD": str(record)})
    manager = ServerManager(config)
    key = manager.api_key
    with caplog.at_level(logging.WARNING, logger="jaxrl.rollout.sglang.server"), manager:
        assert requests.get(manager.urls[0] + "/health", timeout=5).status_code == 200
    seen = json.loads(record.read_text())
    assert seen["argv"][-1] == f"--api-key={key}" and seen["api_key"] == key
    python, dash_c, launcher, *arguments = seen["cmdline"].split("\0")
    assert key not in seen["cmdline"] and not any(a.startswith("--api-key") for a in arguments)
    assert EXTERNAL_API_KEY_ENV not in seen["env_keys"] and not seen["env_keys"], seen["env_keys"]
    warning = caplog.text
    assert "listen on 0.0.0.0" in warning and "require an API key" in warning and key not in warning
    assert stat.S_IMODE(os.stat(manager.log_path(0)).st_mode) == 0o600


def test_a_crashed_keyed_server_s_log_tail_is_redacted(tmp_path):
    import sys

    from jaxrl.rollout.sglang import ServerStartError
    from jaxrl.rollout.sglang.access import REDACTED

    config = ServerConfig(model_path=str(tmp_path / "model"), api_key="s3cret-key-for-the-log",
                          base_port=free_base_port(), python=sys.executable, log_dir=str(tmp_path / "logs"),
                          env={"PYTHONPATH": _fake_sglang(tmp_path), "FAKE_RECORD": str(tmp_path / "r.json"),
                               "FAKE_MODE": "crash"})
    with pytest.raises(ServerStartError, match="exited with code 3") as err:
        ServerManager(config).start()
    message = str(err.value)
    assert "s3cret-key-for-the-log" not in message and f"api_key='{REDACTED}'" in message


class _KeyedStub(http.server.BaseHTTPRequestHandler):
    """Refuses like SGLang 0.5.23 with --api-key: HTTP 401 unless ``Authorization: Bearer KEY``."""

    key = "stub-key"
    seen: list = []

    def _handle(self):
        if self.headers.get("content-length"):
            self.rfile.read(int(self.headers["content-length"]))
        type(self).seen.append(self.headers.get("Authorization"))
        ok = self.headers.get("Authorization") == f"Bearer {self.key}"
        data = json.dumps({"weight_version": "default"} if ok else {"error": "Unauthorized"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _handle

    def log_message(self, *args):
        pass


@pytest.fixture
def keyed_stub():
    _KeyedStub.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedStub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_client_sends_the_bearer_header_and_a_refusal_names_the_key_not_its_value(keyed_stub):
    url = f"http://127.0.0.1:{keyed_stub}"
    client = SGLangClient([url], ClientConfig(max_tries=1), api_key="stub-key")
    assert client.request(0, "POST", "/generate", {"input_ids": [1]}, "keyed request") == {"weight_version": "default"}
    assert _KeyedStub.seen == ["Bearer stub-key"]
    client.close()
    for key, hint in (("", "this client sent none"), ("wrong-key", "the one sent is not it")):
        client = SGLangClient([url], ClientConfig(max_tries=3, backoff_s=0.01), api_key=key)
        with pytest.raises(SGLangRequestError) as err:
            client.request(0, "POST", "/update_weights_from_disk", {}, "weight push")
        message = str(err.value)
        assert "HTTP 401" in message and "requires an API key" in message and hint in message
        assert "stub-key" not in message and (not key or key not in message)
        client.close()
    assert _KeyedStub.seen[1:] == [None, "Bearer wrong-key"]  # 401 is not retried


def test_engine_passes_the_manager_s_key_to_its_client(keyed_stub, tmp_path):
    write_random_checkpoint(str(tmp_path / "model"), ModelConfig(**TINY))
    for key, works in (("stub-key", True), ("", False)):
        config = ServerConfig(model_path=str(tmp_path / "model"), base_port=keyed_stub, api_key=key)
        engine = SGLangEngine(ServerManager(config), client=ClientConfig(max_tries=1))
        if works:
            engine.flush_cache()
        else:
            with pytest.raises(SGLangRequestError, match="requires an API key and this client sent none"):
                engine.flush_cache()
        engine.close()


def test_external_servers_take_the_key_from_the_environment_or_the_argument(keyed_stub, monkeypatch):
    from jaxrl.rollout.sglang import ExternalServers

    url = f"http://127.0.0.1:{keyed_stub}"
    monkeypatch.setenv("JAXRL_SGLANG_API_KEY", "stub-key")
    assert ExternalServers([url], "/m").api_key == "stub-key"
    assert ExternalServers([url], "/m", api_key="stub-key").weight_version == "default"
    monkeypatch.delenv("JAXRL_SGLANG_API_KEY")
    with pytest.raises(ValueError, match=r"HTTP 401\): it requires an API key; set \$JAXRL_SGLANG_API_KEY"):
        ExternalServers([url], "/m")
    with pytest.raises(ValueError, match=r"the API key from ExternalServers\(api_key=...\) is not the one") as err:
        ExternalServers([url], "/m", api_key="guess")
    assert "guess" not in str(err.value)


def test_shared_buffers_whose_files_a_dead_server_took_are_released_without_aborting():
    """Before: a server killed after it had loaded a push took the names of its shared files with it;
    when the pusher later dropped those buffers (renewing them for the restarted server, or at
    exit) torch failed to unlink the missing file and aborted the trainer (SIGABRT, "could not
    unlink the shared memory file"). Here the files go as a dead server's would, in a child
    process: it must survive the renewal and the release."""
    script = textwrap.dedent("""
        import contextlib
        import os
        import numpy as np
        from jaxrl.models.hf import TensorStream
        from jaxrl.rollout.sglang.tensors import SharedTensors, read_payload

        def serve_then_die(shared, payloads):
            for payload in payloads:  # the server opens each chunk's files, loads them, lets go
                read_payload(payload)
            for buffer in shared._buffers.values():  # then dies, and the names of its files go
                with contextlib.suppress(FileNotFoundError):
                    os.unlink("/dev/shm" + buffer.untyped_storage()._share_filename_cpu_()[1].decode())

        shared = SharedTensors()
        tensors = {"a": np.ones((4, 4), np.float32), "b": np.arange(3, dtype=np.float32)}
        payloads = [shared.payload(names) for names, _ in shared.chunks(TensorStream.of(tensors), chunk_bytes=1)]
        serve_then_die(shared, payloads)
        serve_then_die(shared, [shared.payload(shared.renew())])  # the restarted server is given the push again
        smaller = TensorStream.of({"a": np.ones((2, 2), np.float32)})  # a new shape: a's buffer is replaced
        serve_then_die(shared, [shared.payload(names) for names, _ in shared.chunks(smaller, chunk_bytes=1)])
        shared.close()
        print("released", len(payloads))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "released 2"
