"""Starts, watches, restarts and stops SGLang servers (one process group each).

The servers run in their own interpreter (on CPU: ``.venv-sglang``, made by
``scripts/setup_sglang_cpu.sh``; on GPUs: wherever ``pip install jaxrl[sglang]``
put SGLang), so the trainer's process never imports SGLang; it talks HTTP.

Nothing is left behind: ``processes.py`` kills every server's process group on
``stop()``, at exit, on SIGTERM/SIGHUP, and (through the kernel) when the trainer
is killed outright.

Access: servers listen on 127.0.0.1 unless ``ServerConfig.host`` says otherwise. Off
loopback they always require an API key (``ServerConfig.api_key``, else a random one
made per ``ServerManager``), since ``/update_weights_from_disk`` lets anyone who reaches
the port replace the model. The key reaches SGLang as ``--api-key`` through the
launcher's environment, never on a command line (``ps`` shows those to every user);
jaxrl's client sends it as ``Authorization: Bearer KEY``. SGLang 0.5.23 then refuses
every route but ``/health*``, ``/ready*`` and ``/metrics*`` without it (HTTP 401).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

import requests

from jaxrl.errors import InputError
from jaxrl.rollout.base import LogprobKind
from jaxrl.rollout.sglang.access import EXTERNAL_API_KEY_ENV, is_loopback, redact, valid_key
from jaxrl.rollout.sglang.fleet import ServedWeights
from jaxrl.process_groups import kill_group, signal_group
from jaxrl.rollout.sglang.processes import LAUNCH_API_KEY_ENV, LAUNCHER, forget_at_exit, stop_at_exit

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
CPU_VENV_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"
CPU_STAND_IN_DIR = REPO_ROOT / "scripts" / "sglang_cpu"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")

log = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server did not become healthy; the message names it and its log."""


class PortInUseError(ServerStartError, InputError):
    """A server's port is taken before it starts: the config's to change (exit 2 at the command line)."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How to launch a fleet of identical SGLang servers (data parallel).

    model_path: HF checkpoint folder (config.json + safetensors) every server loads.
    num_servers: servers to start; server i listens on ``base_port + i``.
    host: bind address; 127.0.0.1 keeps the servers private to this machine. Any address
      off loopback (not 127.0.0.0/8, ::1 or localhost) needs an API key: ``api_key``, else
      the ``ServerManager`` makes a random one and logs a warning.
    api_key: the key every request must carry (SGLang ``--api-key``, sent as
      ``Authorization: Bearer KEY``); "" for none on loopback, a random one off it.
      Read a generated one from ``ServerManager.api_key``. Never shown in reprs or logs.
    device: "cpu" (the CPU recipe: stand-in sgl_kernel, torch-native kernels) or "cuda".
    dtype: SGLang ``--dtype``; float32 makes logprobs match a float32 learner.
    logprob_kind: what ``output_token_logprobs`` hold. RAW sets the server-wide
      ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (raw ``log_softmax(logits)``);
      PROCESSED leaves SGLang's default. Either way a PROCESSED request gets the
      sampled-from distribution through ``return_sampling_mask`` (see client.py),
      but a RAW request on a PROCESSED fleet is refused: those servers cannot give it.
    return_routed_experts: start with ``--enable-return-routed-experts`` (MoE R3).
    max_total_tokens: KV-cache size in tokens (``--max-total-tokens``); None: SGLang's choice.
    python: interpreter that has SGLang; None: ``.venv-sglang`` on CPU, this one on GPUs.
    extra_args: more ``launch_server`` flags, passed as given.
    env: more environment variables for the servers, as (name, value) pairs.
    startup_timeout_s: how long to wait for ``/health`` after a (re)start.
    stop_timeout_s: how long SIGTERM may take before the group gets SIGKILL.
    log_dir: one log file per server (``server-<i>-port-<port>.log``), appended across restarts.
    omp_num_threads: OMP_NUM_THREADS for CPU servers (1: an idle scheduler spins otherwise).
    """

    model_path: str
    num_servers: int = 1
    host: str = "127.0.0.1"
    api_key: str = dataclasses.field(default="", repr=False)
    base_port: int = 30000
    device: str = "cpu"
    dtype: str = "float32"
    logprob_kind: LogprobKind = LogprobKind.RAW
    return_routed_experts: bool = False
    max_total_tokens: int | None = 8192
    python: str | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 5.0
    log_dir: str = "runs/sglang"
    omp_num_threads: int = 1

    def __post_init__(self):
        def bad(field, got, expected):
            raise ValueError(f"ServerConfig.{field}: got {got!r}, expected {expected}")

        if not self.model_path:
            bad("model_path", self.model_path, "a Hugging Face checkpoint folder")
        if not isinstance(self.host, str) or not self.host.strip() or any(c.isspace() for c in self.host):
            bad("host", self.host, "a bind address such as 127.0.0.1 (this machine only) or 0.0.0.0")
        if not valid_key(self.api_key):
            raise ValueError("ServerConfig.api_key: expected printable characters without spaces "
                             "(a token such as secrets.token_urlsafe() makes), or \"\" for none")
        if self.num_servers < 1:
            bad("num_servers", self.num_servers, "at least 1")
        if not 1024 <= self.base_port <= 65535 - self.num_servers:
            bad("base_port", self.base_port, f"a port in [1024, {65535 - self.num_servers}]")
        if self.device not in DEVICES:
            bad("device", self.device, f"one of {DEVICES}")
        if self.dtype not in DTYPES:
            bad("dtype", self.dtype, f"one of {DTYPES}")
        try:
            object.__setattr__(self, "logprob_kind", LogprobKind(self.logprob_kind))
        except ValueError:
            bad("logprob_kind", self.logprob_kind, f"one of {[k.value for k in LogprobKind]}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            bad("max_total_tokens", self.max_total_tokens, "a positive token count or None")
        if self.startup_timeout_s <= 0:
            bad("startup_timeout_s", self.startup_timeout_s, "> 0 seconds")
        if self.stop_timeout_s < 0:
            bad("stop_timeout_s", self.stop_timeout_s, ">= 0 seconds")
        if self.omp_num_threads < 1:
            bad("omp_num_threads", self.omp_num_threads, "at least 1")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        if any(a == "--api-key" or a.startswith("--api-key=") for a in self.extra_args):
            raise ValueError("ServerConfig.extra_args: --api-key is set by ServerConfig.api_key (so that "
                             "jaxrl's client sends it and no command line shows it); move it there")
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in dict(self.env).items()))

    @property
    def ports(self) -> tuple[int, ...]:
        return tuple(self.base_port + i for i in range(self.num_servers))

    @property
    def urls(self) -> tuple[str, ...]:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 literal
        return tuple(f"http://{host}:{port}" for port in self.ports)

    @property
    def on_loopback(self) -> bool:
        """True when ``host`` is a loopback address (127.0.0.0/8, ::1, localhost): only this machine connects."""
        return is_loopback(self.host)

    @property
    def python_executable(self) -> str:
        return self.python or str(CPU_VENV_PYTHON if self.device == "cpu" else sys.executable)

    def command(self, port: int, model_path: str, weight_version: str) -> list[str]:
        """The server's argv (launched through ``processes.LAUNCHER``); token ids in and out, no tokenizer.
        Holds no API key: the launcher adds ``--api-key`` from ``environment(api_key)``."""
        args = [self.python_executable, "-c", LAUNCHER, "--model-path", model_path,
                "--weight-version", weight_version, "--host", self.host, "--port", str(port),
                "--dtype", self.dtype, "--device", self.device,
                "--skip-tokenizer-init", "--skip-server-warmup"]
        if self.device == "cpu":
            args += ["--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                     "--disable-cuda-graph", "--sleep-on-idle"]
        if self.max_total_tokens is not None:
            args += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.return_routed_experts:
            args += ["--enable-return-routed-experts"]
        return args + list(self.extra_args)

    def environment(self, api_key: str = "") -> dict[str, str]:
        """The server's environment; with ``api_key`` the launcher starts SGLang with ``--api-key``."""
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["OMP_NUM_THREADS"] = str(self.omp_num_threads)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_STAND_IN_DIR), env.get("PYTHONPATH", "")) if p)
        if self.logprob_kind == LogprobKind.RAW:
            env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        else:
            env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        env.update(self.env)
        env["JAXRL_SGLANG_PARENT_PID"] = str(os.getpid())
        env.pop(EXTERNAL_API_KEY_ENV, None)  # an external fleet's key is not these servers' business
        if api_key:
            env[LAUNCH_API_KEY_ENV] = api_key
        else:
            env.pop(LAUNCH_API_KEY_ENV, None)
        return env


@dataclasses.dataclass
class _Server:
    index: int
    port: int
    url: str
    log_path: pathlib.Path
    process: subprocess.Popen | None = None
    starts: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ServerManager(ServedWeights):
    """Owns ``config.num_servers`` SGLang servers. Use as a context manager or call ``stop()``.

    Thread-safe: ``ensure_running(i)`` may be called from many request threads at
    once; one of them restarts a dead server, the others wait for it.

    api_key: ``config.api_key``; when that is empty and ``config.host`` is off loopback,
    a random key made here, kept for this manager's life (restarts reuse it). jaxrl
    never prints or logs it (SGLang's own log, which holds it, is made private, 0600).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self._api_key = config.api_key or ("" if config.on_loopback else secrets.token_urlsafe(32))
        log_dir = pathlib.Path(config.log_dir)
        self._servers = [
            _Server(i, port, url, log_dir / f"server-{i}-port-{port}.log")
            for i, (port, url) in enumerate(zip(config.ports, config.urls, strict=True))
        ]
        self._model_path = config.model_path
        self._weight_version = "default"
        self._open()

    def _open(self) -> None:
        # All servers are spawned from this one long-lived thread: PR_SET_PDEATHSIG
        # fires when the spawning *thread* exits, so a short-lived request thread
        # must never be the parent.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sglang-spawner")
        self._stopped = False
        stop_at_exit(self)

    # ----- lifecycle -------------------------------------------------------
    def start(self) -> "ServerManager":
        """Starts every server and waits until all answer ``/health`` (again after ``stop()``)."""
        if self._stopped:
            self._open()
        self._check_model_path()
        self._log_access()
        for server in self._servers:
            self._check_port_free(server)
        try:
            for server in self._servers:
                self._spawn(server)
            for server in self._servers:
                self._wait_healthy(server)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops every server (SIGTERM, then SIGKILL to the group). Idempotent."""
        for server in self._servers:  # all at once, so the grace periods overlap
            if server.process is not None and server.process.poll() is None:
                signal_group(server.process, signal.SIGTERM)
        for server in self._servers:
            self._terminate(server)
        self._stopped = True
        self._spawner.shutdown(wait=False)
        forget_at_exit(self)

    def __enter__(self) -> "ServerManager":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- queries ---------------------------------------------------------
    @property
    def urls(self) -> tuple[str, ...]:
        return self.config.urls

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    @property
    def api_key(self) -> str:
        """The key every request must carry ("" for none): ``config.api_key`` or the generated one."""
        return self._api_key

    def log_path(self, index: int) -> pathlib.Path:
        return self._servers[index].log_path

    def pid(self, index: int) -> int | None:
        process = self._servers[index].process
        return process.pid if process is not None else None

    def is_running(self, index: int) -> bool:
        process = self._servers[index].process
        return process is not None and process.poll() is None

    def restarts(self, index: int) -> int:
        return max(self._servers[index].starts - 1, 0)

    def describe(self, index: int) -> str:
        """One line naming server ``index`` for error messages."""
        server = self._servers[index]
        return f"SGLang server {index} at {server.url} (log: {server.log_path})"

    # ----- recovery --------------------------------------------------------
    def ensure_running(self, index: int) -> bool:
        """Restarts server ``index`` if its process died; True when it restarted it.

        A server whose process is alive is left alone (a slow or failing request
        is the client's retry to handle).
        """
        server = self._servers[index]
        with server.lock:
            if self._stopped:
                raise RuntimeError(f"{self.describe(index)}: the manager was stopped")
            if self.is_running(index):
                return False
            self._terminate(server)
            self._spawn(server)
            self._wait_healthy(server)
            return True

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to server ``index``'s whole process group (tests, drills)."""
        process = self._servers[index].process
        if process is not None:
            signal_group(process, sig)

    # ----- internals -------------------------------------------------------
    def _log_access(self) -> None:
        if self.config.on_loopback:
            return
        where = f"{self.config.host} (ports {', '.join(map(str, self.config.ports))})"
        if self.config.api_key:
            log.info("SGLang servers listen on %s, reachable from other machines; every request "
                     "needs ServerConfig.api_key", where)
        else:
            log.warning("SGLang servers listen on %s, reachable from other machines, and require an "
                        "API key: jaxrl generated a random one (ServerManager.api_key; not logged). To "
                        "talk to them yourself, set ServerConfig.api_key, or keep them private with "
                        "ServerConfig.host=127.0.0.1", where)

    def _check_model_path(self) -> None:
        path = pathlib.Path(self._model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"ServerConfig.model_path: {str(path)!r} has no config.json "
                f"({'folder does not exist' if not path.exists() else 'not a Hugging Face checkpoint'}); "
                "expected a folder written by jaxrl.models.hf.save_hf_checkpoint or save_pretrained")
        python = self.config.python_executable
        if not pathlib.Path(python).exists():
            raise FileNotFoundError(
                f"ServerConfig.python: {str(python)!r} does not exist; on CPU run "
                "scripts/setup_sglang_cpu.sh, on GPUs pip install -e '.[sglang]'")

    def _check_port_free(self, server: _Server) -> None:
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        with socket.socket(family) as sock:
            # As the server will: a port whose old connections linger in TIME_WAIT is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((self.config.host, server.port))
            except OSError as err:
                raise PortInUseError(
                    f"{self.describe(server.index)}: port {server.port} is taken ({err}); choose "
                    "another ServerConfig.base_port or stop what listens there") from None

    def _spawn(self, server: _Server) -> None:
        server.log_path.parent.mkdir(parents=True, exist_ok=True)
        server.starts += 1
        with open(server.log_path, "a") as server_log:
            if self._api_key:  # SGLang writes its server_args, key included, into this log
                os.chmod(server.log_path, 0o600)
            server_log.write(f"\n===== jaxrl: start #{server.starts} of server {server.index} "
                             f"at {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
            server_log.flush()
            command = self.config.command(server.port, self._model_path, self._weight_version)
            environment = self.config.environment(self._api_key)
            server.process = self._spawner.submit(
                subprocess.Popen, command, env=environment, stdin=subprocess.DEVNULL,
                stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True,
            ).result()

    def _wait_healthy(self, server: _Server) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            if server.process.poll() is not None:
                raise ServerStartError(
                    f"{self.describe(server.index)} exited with code {server.process.returncode} "
                    f"while starting; last log lines:\n{_tail(server.log_path, self._api_key)}")
            try:
                if requests.get(server.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self._terminate(server)
                raise ServerStartError(
                    f"{self.describe(server.index)} did not answer /health within "
                    f"{self.config.startup_timeout_s:.0f} s (ServerConfig.startup_timeout_s); "
                    f"last log lines:\n{_tail(server.log_path, self._api_key)}")
            time.sleep(0.5)

    def _terminate(self, server: _Server) -> None:
        process = server.process
        if process is None:
            return
        if process.poll() is None:
            signal_group(process, signal.SIGTERM)
            try:
                process.wait(self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # SGLang's scheduler and detokenizer share the group; kill stragglers too.
        kill_group(process)
        server.process = None


def _tail(path: pathlib.Path, api_key: str = "", lines: int = 25) -> str:
    try:
        return redact("\n".join(path.read_text(errors="replace").splitlines()[-lines:]), api_key)
    except OSError as err:
        return f"(cannot read {path}: {err})"
