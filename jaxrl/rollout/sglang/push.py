"""The SGLang weight push and its verification (docs/rollouts.md#weight-push-and-its-verification).

A push sends the learner's parameters to every server of the fleet by one of three transports,
``PushConfig.method`` naming it (``_TRANSPORTS``; ``auto`` picks tensor for servers on this host,
distributed for the others):

- ``tensor``: through shared memory on each host, no file written (push_memory.py); with
  several JAX processes each gathers the parameters over the learner's mesh and loads its own
  servers;
- ``distributed``: broadcast over a torch process group that the learner forms with servers
  started elsewhere, no file written (push_group.py);
- ``disk``: a Hugging Face checkpoint written into ``checkpoint_dir`` and loaded from there
  (push_disk.py); with several processes that folder must be storage every host sees.

Then, either way, every server scores a fixed probe sequence; its answer must name the new
version and match the learner's own recompute of the probe. A mismatch is a
``PushVerificationError``. With several JAX processes (jaxrl.distributed) a push is a collective
every process enters in the same order, and each verifies its own servers.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Literal

import jax
import numpy as np

from jaxrl.rollout.base import PushVerificationError
from jaxrl.rollout.sglang.client import SGLangClient
from jaxrl.rollout.sglang.fleet import Fleet
from jaxrl.rollout.sglang.push_disk import DiskPush, ExportFn
from jaxrl.rollout.sglang.push_group import GroupPush
from jaxrl.rollout.sglang.push_memory import MemoryPush, TensorsFn

# (params, token_ids [L] int) -> [L - 1] float: log p(token_{t+1} | tokens_{<=t}), raw logits, T = 1.
RecomputeFn = Callable[[Any, np.ndarray], np.ndarray]

# method -> its transport, made from (fleet, client, PushConfig, export_fn, tensors_fn); each has
# send(params, version) -> (when the data was out, extra metrics), verified, reload and close.
_TRANSPORTS = {
    "tensor": lambda fleet, client, c, export_fn, tensors_fn: MemoryPush(fleet, client, c.chunk_mib, tensors_fn),
    "distributed": lambda fleet, client, c, export_fn, tensors_fn: GroupPush(
        fleet, client, c.chunk_mib, tensors_fn, c.group_address, c.group_port, c.group_backend, c.group_timeout_s),
    "disk": lambda fleet, client, c, export_fn, tensors_fn: DiskPush(
        fleet, client, c.checkpoint_dir, c.keep_checkpoints, export_fn),
}


def export_decoder(model, path: str) -> None:
    """Default ``ExportFn``: ``jaxrl.models.save_hf_checkpoint`` of the learner's ``Decoder``."""
    from jaxrl.models import save_hf_checkpoint

    save_hf_checkpoint(model, path)


def tensors_decoder(model):
    """Default ``TensorsFn``: ``jaxrl.models.hf.hf_tensor_stream`` of the learner's ``Decoder`` (host
    views of its parameters in HF's layout, gathered over processes, each copied once, into its
    shared buffer)."""
    from jaxrl.models.hf import hf_tensor_stream

    return hf_tensor_stream(model)


def recompute_decoder(model, token_ids: np.ndarray) -> np.ndarray:
    """Default ``RecomputeFn``: the learner's one scoring path (``jaxrl.models.scoring``, which the
    trainer's ``old_logp`` and the alignment checker use too) on one sequence; [L - 1] float32."""
    from jaxrl.models.scoring import sequence_logprobs

    ids = np.asarray(token_ids, np.int32)[None]
    return sequence_logprobs(model, ids, np.asarray([ids.shape[1]], np.int32))[0, 1:]


@dataclasses.dataclass(frozen=True)
class PushConfig:
    """method (docs/rollouts.md#weight-push-and-its-verification): "tensor" (shared memory, each
    process's servers on its own host, no file), "distributed" (a torch process group with servers
    started elsewhere, no file), "disk" (a checkpoint per push, which every server reads), or
    "auto": tensor for servers on this host (those jaxrl starts), distributed for the others;
    checkpoint_dir: where pushed checkpoints are written (``weights-<version>``; method disk);
    keep_checkpoints: newest pushed checkpoints kept on disk (>= 1: a restarted server reloads the newest);
    probe_ids: the fixed token sequence scored after every push (>= 2 tokens);
    probe_atol: largest allowed |engine logprob - learner logprob| on the probe;
    chunk_mib: methods tensor and distributed: the tensors go over in chunks of at least this many
      MiB (> 0), so the servers load one chunk while the learner copies (and gathers) the next;
    group_address / group_port / group_backend / group_timeout_s: method distributed: the address of
      this learner the servers reach (process 0's host), its port (0: a free one), "gloo" (servers
      on CPU) or "nccl" (servers on GPUs), and how long the group may take to form."""

    method: Literal["auto", "tensor", "distributed", "disk"] = "auto"
    checkpoint_dir: str = "runs/sglang/checkpoints"
    keep_checkpoints: int = 2
    probe_ids: tuple[int, ...] = (1, 7, 23, 3, 29, 5, 12, 8, 30, 2, 31, 17)
    probe_atol: float = 1e-5
    chunk_mib: float = 128.0
    group_address: str = "127.0.0.1"
    group_port: int = 0
    group_backend: Literal["gloo", "nccl"] = "gloo"
    group_timeout_s: float = 300.0

    def __post_init__(self):
        object.__setattr__(self, "probe_ids", tuple(int(t) for t in self.probe_ids))
        if self.method not in _TRANSPORTS and self.method != "auto":
            raise ValueError(f"PushConfig.method: got {self.method!r}, expected 'auto' or one of {sorted(_TRANSPORTS)}")
        if self.group_backend not in ("gloo", "nccl"):
            raise ValueError(f"PushConfig.group_backend: got {self.group_backend!r}, expected 'gloo' or 'nccl'")
        if not 0 <= self.group_port <= 65535 or not self.group_timeout_s > 0:
            raise ValueError(f"PushConfig.group_port ({self.group_port}) must be a port or 0, and group_timeout_s "
                             f"({self.group_timeout_s}) > 0")
        if self.keep_checkpoints < 1:
            raise ValueError(f"PushConfig.keep_checkpoints: got {self.keep_checkpoints}, expected >= 1")
        if len(self.probe_ids) < 2 or min(self.probe_ids) < 0:
            raise ValueError(f"PushConfig.probe_ids: got {self.probe_ids}, expected >= 2 token ids >= 0")
        if not self.probe_atol > 0:
            raise ValueError(f"PushConfig.probe_atol: got {self.probe_atol}, expected > 0")
        if not self.chunk_mib > 0:
            raise ValueError(f"PushConfig.chunk_mib: got {self.chunk_mib}, expected > 0 (MiB per in-memory chunk)")


class WeightPusher:
    """Pushes the learner's parameters to every server of ``fleet`` (through ``client``) and
    verifies the push took effect.

    export_fn / recompute_fn / tensors_fn: how to write the learner's parameters as an HF
      checkpoint (method disk), how the learner scores a sequence, and the checkpoint's tensors
      (method tensor). The defaults take a ``jaxrl.models.Decoder``.
    """

    def __init__(self, fleet: Fleet, client: SGLangClient, config: PushConfig = PushConfig(),
                 export_fn: ExportFn = export_decoder, recompute_fn: RecomputeFn = recompute_decoder,
                 tensors_fn: TensorsFn = tensors_decoder):
        self.fleet = fleet
        self.config = config
        self._client = client
        self._recompute_fn = recompute_fn
        self.method = config.method if config.method != "auto" else \
            "tensor" if fleet.on_this_host else "distributed"
        self._transport = _TRANSPORTS[self.method](fleet, client, config, export_fn, tensors_fn)

    def push(self, params, version: str) -> dict[str, float]:
        """Pushes ``params`` as ``version`` and verifies it; returns timing metrics.

        Metrics (seconds unless named otherwise): push/export_s (the checkpoint's write; method
        tensor: the gathers and copies into shared memory, which the servers' loads overlap),
        push/load_s (servers loading it, after the export), push/verify_s (version and probe
        checks), push/total_s, push/probe_max_abs_diff (nats); method tensor: push/chunks (update
        requests per server) and push/bytes (bytes handed to each server of this process).
        """
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            expected = self._probe_recompute(params, pool)
            exported, extra = self._transport.send(params, version)
            loaded = time.perf_counter()
            diff = self._verify(version, expected)
        verified = time.perf_counter()
        self._transport.verified(version)
        return {
            "push/export_s": exported - start,
            "push/load_s": loaded - exported,
            "push/verify_s": verified - loaded,
            "push/total_s": verified - start,
            "push/probe_max_abs_diff": diff,
            **extra,
        }

    def reload(self, index: int) -> None:
        """After server ``index`` restarted: gives it the last push every server loaded where the fleet's own
        restart (from the last recorded checkpoint) does not."""
        self._transport.reload(index)

    def close(self) -> None:
        self._transport.close()

    def _call_everywhere(self, call: Callable[[int], Any]) -> list[Any]:
        """``call(i)`` for every server at once (each its own HTTP calls); their results in server
        order; the first failure is raised."""
        with concurrent.futures.ThreadPoolExecutor(self.fleet.num_servers) as pool:
            return [future.result() for future in [pool.submit(call, i) for i in range(self.fleet.num_servers)]]

    def _probe_recompute(self, params, pool: concurrent.futures.Executor) -> Callable[[], np.ndarray]:
        """The learner's probe logprobs, to be read once the servers have loaded: with one JAX
        process computed in ``pool`` meanwhile (it needs only ``params``; about 30 ms of a ~100M
        model's push here); with several in place, first, since the recompute is a collective every
        process must enter in the same order."""
        if jax.process_count() > 1:
            expected = self._expected_probe(params)
            return lambda: expected
        return pool.submit(self._expected_probe, params).result

    def _expected_probe(self, params) -> np.ndarray:
        probe = np.asarray(self.config.probe_ids, np.int32)
        expected = np.asarray(self._recompute_fn(params, probe), np.float64)
        if expected.shape != (len(probe) - 1,):
            raise ValueError(f"recompute_fn returned shape {expected.shape}; expected "
                             f"({len(probe) - 1},): log p(token t+1 | tokens <= t) of the probe")
        return expected

    def _verify(self, version: str, expected: Callable[[], np.ndarray]) -> float:
        """Every server scores the probe; the answer must carry ``version`` and logprobs within
        ``probe_atol`` of the learner's ``expected()``. Returns the largest difference (nats)."""
        probe = list(self.config.probe_ids)
        answers = self._call_everywhere(lambda i: self._client.score_request(i, probe))
        expected = expected()
        worst = 0.0
        for i, meta in enumerate(answers):
            if meta.get("weight_version") != version:
                raise PushVerificationError(
                    f"{self.fleet.describe(i)} reports weight_version {meta.get('weight_version')!r} after the "
                    f"push of {version!r}; the update did not take effect: check the server log and that "
                    "/update_weights_from_disk accepts weight_version (SGLang >= 0.5.23)")
            got = self._client.scored_logprobs(i, probe, meta)
            diff = float(np.max(np.abs(got.astype(np.float64) - expected)))
            worst = max(worst, diff)
            if not diff <= self.config.probe_atol:
                raise PushVerificationError(
                    f"{self.fleet.describe(i)}: after pushing version {version!r}, the probe's "
                    f"logprobs differ from the learner's recompute by up to {diff:.3g} nats "
                    f"(PushConfig.probe_atol={self.config.probe_atol:g}); the server is not "
                    "serving the learner's weights: check the export (parameter names, dtype, "
                    "tied embeddings) and the server's --dtype")
        return worst

