"""How one SGLang server is launched: ``ServerConfig``, its command line and its environment.

``ServerManager`` (server.py) starts servers from these; ``jaxrl train --dry-run`` prints them.
The servers run in their own interpreter (on CPU: ``.venv-sglang``, made by
``scripts/setup_sglang_cpu.sh``; on GPUs: wherever ``pip install jaxrl[sglang]`` put SGLang), so
the trainer's process never imports SGLang. A placed server (``devices``) sees only its own
GPUs through ``CUDA_VISIBLE_DEVICES`` (docs/multi-host.md#gpu-clusters).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys
from typing import Mapping

from jaxrl.distributed.placement import PlacementConfig, visible_devices
from jaxrl.rollout.base import LogprobKind
from jaxrl.rollout.sglang.access import EXTERNAL_API_KEY_ENV, is_loopback, valid_key
from jaxrl.rollout.sglang.processes import LAUNCH_API_KEY_ENV, LAUNCH_FORK_ENV, LAUNCHER

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
CPU_VENV_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"
GPU_VENV_PYTHON = REPO_ROOT / ".venv-sglang-gpu" / "bin" / "python"  # made by scripts/setup_gpu.sh
CPU_STAND_IN_DIR = REPO_ROOT / "scripts" / "sglang_cpu"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
# The version a server started from its checkpoint reports until the first push.
INITIAL_WEIGHT_VERSION = "default"
# launch_server flags that ServerConfig fields set (one way to say each).
_FIELD_FLAGS = {"--api-key": "api_key (so that jaxrl's client sends it and no command line shows it)",
                "--tp-size": "tensor_parallel", "--tp": "tensor_parallel",
                "--mem-fraction-static": "mem_fraction_static", "--base-gpu-id": "devices"}


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
    python: interpreter that has SGLang; None: ``.venv-sglang`` on CPU, ``.venv-sglang-gpu`` on GPUs
      (scripts/setup_gpu.sh), else this one.
    tensor_parallel: devices per server (SGLang ``--tp-size``).
    mem_fraction_static: SGLang ``--mem-fraction-static`` (share of each GPU for weights and KV
      cache, counting what other processes hold there as taken); None: SGLang's default.
    devices: each server's local GPU ids (``num_servers`` tuples of ``tensor_parallel``), which it
      alone sees (``CUDA_VISIBLE_DEVICES``, mapped through this process's own); () leaves every
      server the GPUs this process sees. A training config's ``placement`` section sets the three.
    extra_args: more ``launch_server`` flags, passed as given (not those the fields above set).
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
    tensor_parallel: int = 1
    mem_fraction_static: float | None = None
    devices: tuple[tuple[int, ...], ...] = ()
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
        if self.tensor_parallel < 1:
            bad("tensor_parallel", self.tensor_parallel, "at least 1")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            bad("mem_fraction_static", self.mem_fraction_static, "a share in (0, 1) or None")
        object.__setattr__(self, "devices", tuple(tuple(int(d) for d in ids) for ids in self.devices))
        if self.devices and (len(self.devices) != self.num_servers
                             or any(len(ids) != self.tensor_parallel for ids in self.devices)):
            bad("devices", self.devices, f"num_servers={self.num_servers} tuples of tensor_parallel="
                                         f"{self.tensor_parallel} GPU ids each, or () for no placement")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        for flag, field in _FIELD_FLAGS.items():
            if any(a == flag or a.startswith(flag + "=") for a in self.extra_args):
                raise ValueError(f"ServerConfig.extra_args: {flag} is set by ServerConfig.{field}; move it there")
        object.__setattr__(self, "env", tuple((str(k), str(v)) for k, v in dict(self.env).items()))
        if self.devices and "CUDA_VISIBLE_DEVICES" in dict(self.env):
            raise ValueError("ServerConfig.env: CUDA_VISIBLE_DEVICES is set per server from ServerConfig.devices "
                             "(the placement); remove it from env")

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
        """``python``, else on CPU ``.venv-sglang`` and on GPUs ``.venv-sglang-gpu`` where
        scripts/setup_gpu.sh made it, this interpreter otherwise (SGLang installed beside jaxrl)."""
        if self.python:
            return self.python
        if self.device == "cpu":
            return str(CPU_VENV_PYTHON)
        return str(GPU_VENV_PYTHON) if GPU_VENV_PYTHON.exists() else sys.executable

    def placed(self, placement: PlacementConfig, process_index: int) -> "ServerConfig":
        """Process ``process_index``'s servers as ``placement`` lays them out on its host: their
        count, GPUs, tensor-parallel size and memory fraction (:meth:`check_placeable` first). Ports
        follow those of the lower processes, so processes that share a machine (tests) never collide."""
        count = placement.servers_per_host
        return dataclasses.replace(
            self, num_servers=count, tensor_parallel=placement.server_tensor_parallel,
            mem_fraction_static=placement.sglang_memory_fraction(),
            devices=placement.server_devices if self.device == "cuda" else (),
            base_port=self.base_port + process_index * count)

    def check_placeable(self, key: str) -> None:
        """Refuses (ValueError naming ``key``.*) what a placement decides for itself."""
        decided = {"num_servers": 1, "tensor_parallel": 1, "mem_fraction_static": None, "devices": ()}
        for field, default in decided.items():
            if getattr(self, field) != default:
                raise ValueError(f"{key}.{field}={getattr(self, field)!r} is decided by the placement section "
                                 f"(servers per host, their GPUs and memory); remove {key}.{field}")

    def command(self, port: int, model_path: str, weight_version: str) -> list[str]:
        """The server's argv: ``processes.LAUNCHER`` running ``sglang.launch_server`` with :meth:`launch_args`."""
        return [self.python_executable, "-c", LAUNCHER, *self.launch_args(port, model_path, weight_version)]

    def launch_args(self, port: int, model_path: str, weight_version: str) -> list[str]:
        """``sglang.launch_server``'s arguments; token ids in and out, no tokenizer. Holds no API key:
        the launcher adds ``--api-key`` from ``environment(api_key)``."""
        args = ["--model-path", model_path,
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
        if self.tensor_parallel > 1:
            args += ["--tp-size", str(self.tensor_parallel)]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", f"{self.mem_fraction_static:g}"]
        return args + list(self.extra_args)

    def environment(self, api_key: str = "", index: int | None = None,
                    base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Server ``index``'s environment: ``base`` (default this process's) with its GPUs when
        ``devices`` places it; with ``api_key`` the launcher starts SGLang with ``--api-key``."""
        base = os.environ if base is None else base
        env = dict(base)
        if self.devices and index is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(self.devices[index], base)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env[LAUNCH_FORK_ENV] = "1"  # why: processes.LAUNCH_FORK_ENV
            env["OMP_NUM_THREADS"] = str(self.omp_num_threads)
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_STAND_IN_DIR), env.get("PYTHONPATH", "")) if p)
        else:  # a CUDA context does not survive a fork
            env.pop(LAUNCH_FORK_ENV, None)
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
