"""An SGLang fleet that cannot start ends ``jaxrl train`` with its cause on the first line, no
traceback, and nothing left running. The "server" is a stand-in interpreter that never answers
``/health`` (what a hung model load looks like from outside): the trainer's start-up path is under
test here, not SGLang, which tests/rollout/test_sglang*.py run for real."""

import json
import os
import socket
import stat

import pytest

from jaxrl.cli import main
from jaxrl.models import ModelConfig
from jaxrl.rollout.sglang.testing import write_random_checkpoint


@pytest.fixture
def sglang_config(tmp_path, run_config):
    model = str(tmp_path / "hf")
    write_random_checkpoint(model, ModelConfig(vocab_size=17, hidden_size=32, intermediate_size=64, num_layers=1,
                                               num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64),
                            seed=0)
    never = tmp_path / "never_healthy"
    never.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/server.pid\nexec sleep 600\n")
    never.chmod(never.stat().st_mode | stat.S_IEXEC)

    def make(port: int, **server) -> str:
        config = run_config(tmp_path / "out", model={"architecture": None, "hf_path": model}, rollout={
            "engine": "sglang", "sglang": {"server": {"model_path": model, "python": str(never), "base_port": port,
                                                      "log_dir": str(tmp_path / "logs"), **server}}})
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        return str(path)

    return make


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_never_becomes_healthy(sglang_config, tmp_path, capfd):
    """Before: a ServerStartError traceback (29 lines). Now one line naming the server, its log and
    ``startup_timeout_s``, then the log's last lines; the server's process is gone; exit 1."""
    port = _free_port()
    assert main(["train", sglang_config(port, startup_timeout_s=2)]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    first = err.splitlines()[0]
    assert first.startswith(f"jaxrl train: SGLang server 0 at http://127.0.0.1:{port} (log: {tmp_path}/logs/")
    assert first.endswith("did not answer /health within 2 s (ServerConfig.startup_timeout_s); last log lines:")
    pid = int((tmp_path / "server.pid").read_text())
    assert not os.path.exists(f"/proc/{pid}")


def test_a_port_in_use(sglang_config, capfd):
    """Before: a ServerStartError traceback, exit 1. Now one line naming the port and the key to
    change, exit 2 (the config's to fix), before anything is started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["train", sglang_config(port)]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"port {port} is taken" in err and "ServerConfig.base_port" in err
