"""Test-wide settings: 8 CPU devices so mesh tests can run in the same process.

Also the real SGLang servers (CPU, float32, ``.venv-sglang``) as session fixtures, so every
module that needs one shares it: ``sglang_dense`` (one dense Qwen3 server) and ``sglang_moe``
(two Qwen3-MoE servers, data parallel, routes returned). Each starts the first time a test
asks for it and stops at the end of the session. Models are random ``jaxrl.models.Decoder``s
written with ``save_hf_checkpoint``. A test that pushes other weights must push the fleet's
own ``model`` back before it ends: later tests, in any module, expect those weights served.
"""
import os
import socket

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _free_base_port(count: int) -> int:
    for base in range(31200, 32000, 10):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports in 31200-32000")


class SGLangFleet:
    """A random checkpoint (``model``, written to ``model_path``), the ``manager`` of the servers
    that load it and an ``engine`` on them."""

    def __init__(self, tmp, config, num_servers: int):
        from jaxrl.rollout.sglang import ClientConfig, PushConfig, SGLangEngine, ServerConfig, ServerManager
        from jaxrl.rollout.sglang.testing import write_random_checkpoint

        self.model_path = str(tmp / "model")
        self.model = write_random_checkpoint(self.model_path, config, seed=1)
        self.manager = ServerManager(ServerConfig(
            model_path=self.model_path, num_servers=num_servers, base_port=_free_base_port(num_servers),
            return_routed_experts=config.num_experts > 0, log_dir=str(tmp / "logs"),
            startup_timeout_s=200, stop_timeout_s=2)).start()
        self.engine = SGLangEngine(self.manager, push=PushConfig(checkpoint_dir=str(tmp / "pushed")),
                                   client=ClientConfig(max_tries=4, backoff_s=0.2))

    def close(self):
        self.engine.close()
        self.manager.stop()


def _dense_config():
    from jaxrl.models import ModelConfig

    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=512)


@pytest.fixture(scope="session")
def sglang_dense(tmp_path_factory):
    fleet = SGLangFleet(tmp_path_factory.mktemp("sglang-dense"), _dense_config(), num_servers=1)
    yield fleet
    fleet.close()


@pytest.fixture(scope="session")
def sglang_moe(tmp_path_factory):
    config = _dense_config().replace(mlp_types=("moe", "moe"), num_experts=8, num_experts_per_tok=2,
                                     moe_intermediate_size=16)
    fleet = SGLangFleet(tmp_path_factory.mktemp("sglang-moe"), config, num_servers=2)
    yield fleet
    fleet.close()
