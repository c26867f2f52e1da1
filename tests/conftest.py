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
import gc
import os
import secrets
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import repo_guard  # noqa: E402
import suite_settings  # noqa: E402
from server_ports import free_base_port  # noqa: E402

os.environ.setdefault("XLA_FLAGS", suite_settings.xla_flags())
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # why: tests/suite_settings.py
# One persistent compilation cache for the session, shared with the subprocesses tests start (a
# resumed run, the CLI) and with the xdist workers (they inherit this environment): the tiny
# trainers of many tests compile the same programs again. Made here only when nobody set one, and
# then removed by the process that made it.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl-tests-xla-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# A test process's heap holds every module it imported and the programs earlier tests traced, and with
# CPython's default thresholds (700, 10, 10) a full collection walks all of it every ~70,000 allocations,
# which JAX's tracing and lowering make by the million. Rarer collections: tests/trainer/test_objective_options.py
# and test_loop.py in one process took 161-189 s with the defaults, 138-140 s with these; peak memory
# +5% (test_loop.py alone). Module teardown (below) still collects everything.
gc.set_threshold(20_000, 50, 50)


_REPO_BEFORE = pytest.StashKey[dict]()


def _is_controller(config) -> bool:
    """The process that runs the session (not an xdist worker)."""
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session):
    if _is_controller(session.config):
        session.config.stash[_REPO_BEFORE] = repo_guard.snapshot()


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    if _is_controller(session.config) and _REPO_BEFORE in session.config.stash:
        found = repo_guard.changes(session.config.stash[_REPO_BEFORE], repo_guard.snapshot())
        if found:  # fails the run: pytest returns the session's exit status after this hook
            session.config.get_terminal_writer().line("\n" + repo_guard.report(found), red=True, bold=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program at the end of each test module.

    XLA:CPU maps each executable's code into the process (about 3.5 memory mappings a program),
    and JAX's jit caches keep them alive. The whole suite runs in one process and compiles
    thousands of programs: measured, 42,600 mappings by the critic tests, and the process died
    (SIGSEGV in CI, SIGABRT here) inside test_objective_options once it reached the kernel's
    vm.max_map_count of 65,530. Clearing after each module keeps the count to one module's
    programs; modules rarely share a program, and the persistent cache above still serves repeats.
    """
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
        gc.collect()


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
        push = PushConfig(method="disk", checkpoint_dir=str(self.tmp / "pushed"))
        self.engine = SGLangEngine(self.manager, push=push, client=ClientConfig(max_tries=4, backoff_s=0.2))
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
_FLEET_TESTS_LEFT = pytest.StashKey[int]()
_FLEETS_RUNNING = pytest.StashKey[dict]()


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the marks
def pytest_collection_modifyitems(config, items):
    """Groups for ``pytest -n N --dist loadgroup`` (scripts/test.sh). Every test that uses an
    SGLang server (a fleet fixture or the ``sglang`` mark) runs on one worker, so the fleets start
    once and no two SGLang servers compete for the cores; the other tests of a module with a
    costly module-scoped fixture run together on one worker, so it is built once; any other test
    is a unit of its own, so the workers finish together (the longest test is about a minute)."""
    shared_modules = {item.module.__name__ for item in items if _shares_fixtures(item)}
    for item in items:
        module = item.module.__name__
        group = "sglang" if _uses_sglang(item) else module if module in shared_modules else item.nodeid
        item.add_marker(pytest.mark.xdist_group(group))


def _uses_sglang(item) -> bool:
    return item.get_closest_marker("sglang") is not None or _uses_a_fleet(item)


# Module-scoped fixtures that take a second or less to build (small files, a character tokenizer,
# a few arrays, a tiny random checkpoint): a module that shares only these may be split across the workers. Any
# other module-scoped fixture (a trained run, a compiled reference) keeps its module on one worker.
_CHEAP_SHARED_FIXTURES = {"_release_compiled_programs", "files", "two_task_files", "tokenizer", "batch", "head_inputs",
                          "moe_checkpoint"}


def _shares_fixtures(item) -> bool:
    """Whether the test uses a costly fixture built once for its module (or class or package)."""
    definitions = getattr(item, "_fixtureinfo", None)
    return definitions is not None and any(
        fixture.scope in ("module", "class", "package") and fixture.argname not in _CHEAP_SHARED_FIXTURES
        for fixtures in definitions.name2fixturedefs.values() for fixture in fixtures)


class _FleetsUsed:
    """Records the fleets the selected tests use and how many tests use one (a plugin object: this
    module's own ``pytest_collection_modifyitems`` must run first, this one last)."""

    @pytest.hookimpl(trylast=True)  # after -k / -m deselection: count only the tests that will run
    def pytest_collection_modifyitems(self, config, items):
        config.stash[_FLEETS_USED] = {name for item in items for name in getattr(item, "fixturenames", ())
                                      if name in _FLEETS}
        config.stash[_FLEET_TESTS_LEFT] = sum(_uses_a_fleet(item) for item in items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        """Stops the fleets after the last test that uses one. Every such test runs on one worker
        (``pytest_collection_modifyitems``), early in its share, and an idle SGLang scheduler still
        polls: measured, 1 s of CPU a minute per server, for the rest of the suite."""
        yield
        if _uses_a_fleet(item):
            left = item.config.stash[_FLEET_TESTS_LEFT] = item.config.stash.get(_FLEET_TESTS_LEFT, 1) - 1
            if left <= 0:
                _close_fleets(item.config)


def _uses_a_fleet(item) -> bool:
    return bool(set(getattr(item, "fixturenames", ())) & set(_FLEETS))


def _close_fleets(config) -> None:
    fleets = config.stash.get(_FLEETS_RUNNING, {})
    while fleets:
        fleets.popitem()[1].close()


def pytest_configure(config):
    config.pluginmanager.register(_FleetsUsed(), "jaxrl-fleets-used")


@pytest.fixture(scope="session")
def _sglang_fleets(request, tmp_path_factory):
    """Every fleet the selected tests use, started side by side at the first test that needs one
    (start-up is mostly Python imports: overlapped, the fleets are up sooner than one by one)."""
    names = sorted(request.config.stash.get(_FLEETS_USED, set()) or _FLEETS)
    fleets = request.config.stash[_FLEETS_RUNNING] = {}
    try:
        for name in names:
            make_config, num_servers, api_key = _FLEETS[name]
            port = free_base_port(num_servers)
            fleets[name] = SGLangFleet(tmp_path_factory.mktemp(name), make_config(), num_servers, port, api_key)
        with concurrent.futures.ThreadPoolExecutor(len(fleets)) as pool:
            for future in [pool.submit(fleet.start) for fleet in fleets.values()]:
                future.result()
        yield dict(fleets)
    finally:
        _close_fleets(request.config)  # those the last test that used one left running


@pytest.fixture(scope="session")
def sglang_dense(_sglang_fleets):
    return _sglang_fleets["sglang_dense"]


@pytest.fixture(scope="session")
def sglang_moe(_sglang_fleets):
    return _sglang_fleets["sglang_moe"]


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """This machine as one without bubblewrap (the sandbox's jail), for the probe and its warning."""
    from jaxrl.sandbox import jail, probe

    monkeypatch.setattr(jail, "find_bwrap", lambda: None)
    monkeypatch.setattr("jaxrl.sandbox.execution._warned", set())
    probe.cache_clear()
    yield
    probe.cache_clear()


@pytest.fixture(autouse=True)
def _grouped_as_marked(request):
    """Under ``--dist loadgroup`` xdist marks each grouped test's id with its group (``...::test@sglang``)
    and schedules by it. A pytest whose ids ignore that (pytest 9 with xdist 3.8) silently spreads the
    groups over the workers: each worker then starts its own SGLang fleets, on ports the other is
    binding. Such a test fails here, saying so."""
    if (request.config.getoption("loadgroup", default=False) and request.node.get_closest_marker("xdist_group")
            and "@" not in request.node.nodeid):
        pytest.fail("--dist loadgroup did not group this test: this pytest / pytest-xdist pair ignores the groups; "
                    "install the versions of requirements.txt (scripts/setup.sh)", pytrace=False)


@pytest.fixture(autouse=True)
def _sglang_dense_api_key_env(request, monkeypatch):
    """Tests on ``sglang_dense`` see its key in ``JAXRL_SGLANG_API_KEY`` (read by ExternalServers)."""
    if "sglang_dense" in request.fixturenames:
        monkeypatch.setenv("JAXRL_SGLANG_API_KEY", request.getfixturevalue("sglang_dense").manager.api_key)
