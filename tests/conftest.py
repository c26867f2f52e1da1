"""Test-wide settings: 8 CPU devices so mesh tests can run in the same process.

Also the real SGLang servers (CPU, float32, ``.venv-sglang``) as session fixtures, so every
module that needs one shares it: ``sglang_dense`` (one dense Qwen3 server) and ``sglang_moe``
(two Qwen3-MoE servers, data parallel, routes returned). The fleets the selected tests use start
together at the first test that needs one and stop at the end of the session. Models are random
``jaxrl.models.Decoder``s written with ``save_hf_checkpoint``. A test that pushes other weights
must push the fleet's own ``model`` back before it ends: later tests, in any module, expect
those weights served.

``sglang_dense`` runs with an API key (``ServerConfig.api_key``), so every test on it goes
through the authenticated path (SGLang ``--api-key``, jaxrl's client sending the Bearer
header); a test that uses it runs with ``JAXRL_SGLANG_API_KEY`` set to that key, as a user of
``jaxrl align run --server-url`` against a keyed fleet would. ``sglang_moe`` has no key.
"""
import concurrent.futures
import os
import secrets
import shutil
import socket
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, shared with the subprocesses tests start (a
# resumed run, the CLI): the tiny trainers of many tests compile the same programs again.
_XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _XLA_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def _free_base_port(count: int, first: int = 31200) -> int:
    for base in range(first, 32000, 10):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no free ports in {first}-32000")


class SGLangFleet:
    """A random checkpoint (``model``, written to ``model_path``), the ``manager`` of the servers
    that load it and, once started, an ``engine`` on them."""

    def __init__(self, tmp, config, num_servers: int, base_port: int, api_key: str = ""):
        from jaxrl.rollout.sglang import ServerConfig, ServerManager
        from jaxrl.rollout.sglang.testing import write_random_checkpoint

        self.tmp = tmp
        self.model_path = str(tmp / "model")
        self.model = write_random_checkpoint(self.model_path, config, seed=1)
        self.manager = ServerManager(ServerConfig(
            model_path=self.model_path, num_servers=num_servers, base_port=base_port, api_key=api_key,
            return_routed_experts=config.num_experts > 0, log_dir=str(tmp / "logs"),
            startup_timeout_s=200, stop_timeout_s=2))
        self.engine = None

    def start(self) -> "SGLangFleet":
        from jaxrl.rollout.sglang import ClientConfig, PushConfig, SGLangEngine

        self.manager.start()
        self.engine = SGLangEngine(self.manager, push=PushConfig(checkpoint_dir=str(self.tmp / "pushed")),
                                   client=ClientConfig(max_tries=4, backoff_s=0.2))
        return self

    def close(self):
        if self.engine is not None:
            self.engine.close()
        self.manager.stop()


def _dense_config():
    from jaxrl.models import ModelConfig

    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=512)


def _moe_config():
    return _dense_config().replace(mlp_types=("moe", "moe"), num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=16)


# fixture name -> (model config, number of servers, API key)
_FLEETS = {"sglang_dense": (_dense_config, 1, secrets.token_urlsafe(16)), "sglang_moe": (_moe_config, 2, "")}
_FLEETS_USED = pytest.StashKey[set]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: count only the tests that will run
def pytest_collection_modifyitems(config, items):
    config.stash[_FLEETS_USED] = {name for item in items for name in getattr(item, "fixturenames", ())
                                  if name in _FLEETS}


@pytest.fixture(scope="session")
def _sglang_fleets(request, tmp_path_factory):
    """Every fleet the selected tests use, started side by side at the first test that needs one
    (start-up is mostly Python imports: overlapped, the fleets are up sooner than one by one)."""
    names = sorted(request.config.stash.get(_FLEETS_USED, set()) or _FLEETS)
    fleets, port = {}, 31200
    try:
        for name in names:
            make_config, num_servers, api_key = _FLEETS[name]
            port = _free_base_port(num_servers, port)
            fleets[name] = SGLangFleet(tmp_path_factory.mktemp(name), make_config(), num_servers, port, api_key)
            port += num_servers
        with concurrent.futures.ThreadPoolExecutor(len(fleets)) as pool:
            for future in [pool.submit(fleet.start) for fleet in fleets.values()]:
                future.result()
        yield fleets
    finally:
        for fleet in fleets.values():
            fleet.close()


@pytest.fixture(scope="session")
def sglang_dense(_sglang_fleets):
    return _sglang_fleets["sglang_dense"]


@pytest.fixture(scope="session")
def sglang_moe(_sglang_fleets):
    return _sglang_fleets["sglang_moe"]


@pytest.fixture(autouse=True)
def _sglang_dense_api_key_env(request, monkeypatch):
    """Tests on ``sglang_dense`` see its key in ``JAXRL_SGLANG_API_KEY`` (read by ExternalServers)."""
    if "sglang_dense" in request.fixturenames:
        monkeypatch.setenv("JAXRL_SGLANG_API_KEY", request.getfixturevalue("sglang_dense").manager.api_key)
