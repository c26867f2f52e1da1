"""Starts, watches, restarts and stops SGLang servers (one process group each).

How each is launched (its command line, environment and GPUs) is ``ServerConfig``'s
(launch.py); the trainer's process never imports SGLang, it talks HTTP.

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
import threading
import time

import requests

from jaxrl.errors import InputError
from jaxrl.process_groups import kill_group, signal_group
from jaxrl.rollout.sglang.access import redact
from jaxrl.rollout.sglang.fleet import ServedWeights
from jaxrl.rollout.sglang.launch import INITIAL_WEIGHT_VERSION, ServerConfig
from jaxrl.rollout.sglang.processes import forget_at_exit, stop_at_exit

log = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server did not become healthy; the message names it and its log."""


class PortInUseError(ServerStartError, InputError):
    """A server's port is taken before it starts: the config's to change (exit 2 at the command line)."""


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
        self._weight_version = INITIAL_WEIGHT_VERSION
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
    def on_this_host(self) -> bool:
        return True  # started here, whatever address they listen on

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
            environment = self.config.environment(self._api_key, server.index)
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
