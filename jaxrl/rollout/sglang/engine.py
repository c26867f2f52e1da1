"""``SGLangEngine``: the rollout interface (jaxrl/rollout/base.py) on a fleet of SGLang servers.

Generation: one ``/generate`` request per prompt (``n`` samples), prompt i sent
to server ``i % num_servers``, all in flight at once; results come back complete
and in prompt order. A request that fails (server died, timeout) is retried
after the manager restarts a dead server; a retried request replaces, never
adds to, its prompt's samples.

With several JAX processes (jaxrl.distributed) every process calls ``generate``
with the same prompts; process p sends only its contiguous share
(``distributed.process_share``) to its own servers, and the samples are
all-gathered so every process returns the same full list in prompt order.
``update_weights`` is then a collective too: the export is written once to
``PushConfig.checkpoint_dir`` (which all hosts must see) and every process
loads it on, and verifies, its own servers.

Weight push (SPEC section 7, "push the new weights ... and verify the push"):
export the learner's parameters as a Hugging Face checkpoint into a temporary
folder, rename it into place (a crash never leaves a half-written checkpoint a
server could load), ``/update_weights_from_disk`` on every server with the new
``weight_version``, confirm the version in ``/model_info``, then score a fixed
probe sequence on every server and compare with the learner's own recompute.
A mismatch is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time
import uuid
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.rollout.base import LogprobKind, RolloutEngine, Sample, SamplingParams
from jaxrl.rollout.sglang.client import (
    ClientConfig,
    SGLangClient,
    SGLangResponseError,
    generate_payload,
    parse_samples,
)
from jaxrl.rollout.sglang.server import ServerManager

# (params, folder) -> None: writes config.json + safetensors for ``params`` into folder.
ExportFn = Callable[[Any, str], None]
# (params, token_ids [L] int) -> [L - 1] float: log p(token_{t+1} | tokens_{<=t}), raw logits, T = 1.
RecomputeFn = Callable[[Any, np.ndarray], np.ndarray]


def export_decoder(model, path: str) -> None:
    """Default ``ExportFn``: ``jaxrl.models.save_hf_checkpoint`` of the learner's ``Decoder``."""
    from jaxrl.models import save_hf_checkpoint

    save_hf_checkpoint(model, path)


def recompute_decoder(model, token_ids: np.ndarray) -> np.ndarray:
    """Default ``RecomputeFn``: the learner's own scoring (``jaxrl.align.check.learner_logprobs``,
    the trainer's ``old_logp`` path) of one sequence; [L - 1] float32."""
    from jaxrl.align.check import learner_logprobs

    ids = np.asarray(token_ids, np.int32)[None]
    return learner_logprobs(model, ids, np.asarray([ids.shape[1]], np.int32))[0, 1:]


class WeightPushError(RuntimeError):
    """A push did not take effect as verified; the message names the server and what differed."""


@dataclasses.dataclass(frozen=True)
class PushConfig:
    """checkpoint_dir: where pushed checkpoints are written (``weights-<version>``);
    keep_checkpoints: newest pushed checkpoints kept on disk (>= 1: a restarted server reloads the newest);
    probe_ids: the fixed token sequence scored after every push (>= 2 tokens);
    probe_atol: largest allowed |engine logprob - learner logprob| on the probe."""

    checkpoint_dir: str = "runs/sglang/checkpoints"
    keep_checkpoints: int = 2
    probe_ids: tuple[int, ...] = (1, 7, 23, 3, 29, 5, 12, 8, 30, 2, 31, 17)
    probe_atol: float = 1e-5

    def __post_init__(self):
        object.__setattr__(self, "probe_ids", tuple(int(t) for t in self.probe_ids))
        if self.keep_checkpoints < 1:
            raise ValueError(f"PushConfig.keep_checkpoints: got {self.keep_checkpoints}, expected >= 1")
        if len(self.probe_ids) < 2 or min(self.probe_ids) < 0:
            raise ValueError(f"PushConfig.probe_ids: got {self.probe_ids}, expected >= 2 token ids >= 0")
        if not self.probe_atol > 0:
            raise ValueError(f"PushConfig.probe_atol: got {self.probe_atol}, expected > 0")


class SGLangEngine(RolloutEngine):
    """Rollouts on the servers of a started ``ServerManager``.

    export_fn / recompute_fn: how to write the learner's parameters as an HF
      checkpoint and how the learner scores a sequence (used by ``update_weights``
      only). The defaults take a ``jaxrl.models.Decoder`` as ``params``.
    """

    def __init__(
        self,
        manager: ServerManager,
        export_fn: ExportFn = export_decoder,
        recompute_fn: RecomputeFn = recompute_decoder,
        push: PushConfig = PushConfig(),
        client: ClientConfig = ClientConfig(),
    ):
        self.manager = manager
        self.push_config = push
        self._export_fn = export_fn
        self._recompute_fn = recompute_fn
        self._client = SGLangClient(manager.urls, client, on_failure=manager.ensure_running,
                                    describe=manager.describe, api_key=getattr(manager, "api_key", ""))
        model_config = _read_model_config(manager.model_path)
        self.vocab_size = int(model_config["vocab_size"])
        if max(push.probe_ids) >= self.vocab_size:
            raise ValueError(f"PushConfig.probe_ids has ids up to {max(push.probe_ids)}, outside the "
                             f"vocabulary [0, {self.vocab_size}) of {manager.model_path}; pick smaller ids")
        self._moe_top_k = (int(model_config["num_experts_per_tok"])
                           if manager.config.return_routed_experts else None)
        self._version = manager.weight_version
        self._batches = 0
        self.last_push_metrics: dict[str, float] = {}

    # ----- RolloutEngine ---------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1
                 ) -> list[list[Sample]]:
        """``n`` samples for each prompt: result[i][j] is sample j of prompt i.

        Sample.routed_experts (MoE fleets started with return_routed_experts): int32
        [len(output), num_layers, top_k]; row j: the experts of the position whose
        forward produced output token j (as in ``jaxrl.rollout.base.Sample``);
        Sample.prompt_routed_experts: [len(prompt) - 1, num_layers, top_k], the rest
        of SGLang's routes (prompt positions 0 .. len(prompt) - 2).
        """
        self._check_kind(params)
        if n < 1:
            raise ValueError(f"SGLangEngine.generate: n must be >= 1, got {n}")
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompts)]
        self._batches += 1
        num_servers = self.manager.num_servers
        share = distributed.process_share(len(prompts))
        mine = range(share.start, share.stop)
        names = {i: f"request {i} of batch {self._batches} (prompt of {len(prompts[i])} tokens, n={n})"
                 for i in mine}
        calls = [(k % num_servers, "POST", "/generate",
                  generate_payload(prompts[i], params, n, self._moe_top_k is not None), names[i])
                 for k, i in enumerate(mine)]
        responses = self._client.map(calls)
        local = [parse_samples(r, prompts[i], params, n, self._moe_top_k,
                               f"{self.manager.describe(k % num_servers)}, {names[i]}")
                 for k, (i, r) in enumerate(zip(mine, responses))]
        return self._gather(local, prompts, params, n)

    def update_weights(self, params, version: str) -> dict[str, float]:
        """Pushes ``params`` to every server as ``version`` and verifies it; returns timing metrics.

        Metrics (seconds unless named otherwise): push/export_s (checkpoint
        write), push/load_s (servers loading it), push/verify_s (version and
        probe checks), push/total_s, push/probe_max_abs_diff (nats).
        """
        version = str(version)
        if version == self._version:
            raise ValueError(f"SGLangEngine.update_weights: version {version!r} is the current one; "
                             "every push needs a new version so samples can be attributed to weights")
        start = time.perf_counter()
        path = self._write_checkpoint(params, version)
        exported = time.perf_counter()
        self._load_everywhere(path, version)
        loaded = time.perf_counter()
        diff = self._verify(params, version)
        verified = time.perf_counter()
        self._version = version
        self.manager.record_weights(str(path), version)
        self._prune_checkpoints(keep=path)
        self.last_push_metrics = {
            "push/export_s": exported - start,
            "push/load_s": loaded - exported,
            "push/verify_s": verified - loaded,
            "push/total_s": verified - start,
            "push/probe_max_abs_diff": diff,
        }
        return dict(self.last_push_metrics)

    def flush_cache(self) -> None:
        """Empties every server's prefix (radix) cache, so the next prompts are prefilled afresh."""
        self._client.map([(i, "POST", "/flush_cache", None, "cache flush")
                          for i in range(self.manager.num_servers)])

    def close(self) -> None:
        self._client.close()

    # ----- scoring ---------------------------------------------------------
    def score(self, token_ids: Sequence[int], server: int = 0) -> np.ndarray:
        """SGLang's raw logprobs of a given sequence (teacher forcing): [L - 1] float32,
        entry t = log p(token_{t+1} | tokens_{<=t}). ``input_token_logprobs`` are raw
        (temperature 1, unfiltered) whatever the fleet's logprob_kind."""
        token_ids = self._check_prompt(0, token_ids)
        if len(token_ids) < 2:
            raise ValueError(f"SGLangEngine.score: need >= 2 tokens, got {len(token_ids)}")
        payload = {"input_ids": token_ids, "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        name = f"scoring request ({len(token_ids)} tokens)"
        response = self._client.request(server, "POST", "/generate", payload, name)
        entries = (response.get("meta_info") or {}).get("input_token_logprobs")
        if entries is None or len(entries) != len(token_ids):
            raise SGLangResponseError(
                f"{self.manager.describe(server)}, {name}: expected {len(token_ids)} "
                f"input_token_logprobs, got {None if entries is None else len(entries)}; check that "
                "the server honours logprob_start_len (SGLang >= 0.5.23)")
        return np.asarray([e[0] for e in entries[1:]], np.float32)

    # ----- internals -------------------------------------------------------
    def _gather(self, local: list[list[Sample]], prompts: list[list[int]], params: SamplingParams,
                n: int) -> list[list[Sample]]:
        """Every process's samples (its share of ``prompts``, in order) on every process, in prompt order."""
        if jax.process_count() == 1:
            return local
        flat = [s for group in local for s in group]

        def text(values):
            return [np.frombuffer(v.encode(), np.uint8) for v in values]

        output_ids = distributed.allgather_ragged([s.output_ids for s in flat], np.int32)
        logprobs = distributed.allgather_ragged([s.output_logprobs for s in flat], np.float32)
        finish = distributed.allgather_ragged(text(s.finish_reason for s in flat), np.uint8)
        versions = distributed.allgather_ragged(text(s.weight_version for s in flat), np.uint8)
        # The routes of every fed position (prompt's, then output's) travel as one flat array.
        routes = ([None] * len(output_ids) if self._moe_top_k is None else distributed.allgather_ragged(
            [np.concatenate([s.prompt_routed_experts.reshape(-1), s.routed_experts.reshape(-1)]) for s in flat],
            np.int32))
        if len(output_ids) != len(prompts) * n:
            raise RuntimeError(f"gathered {len(output_ids)} samples from {jax.process_count()} processes for "
                               f"{len(prompts)} prompts x n={n}; every process must call generate with the "
                               "same prompts and n")
        samples = []
        for j in range(len(output_ids)):
            prompt = prompts[j // n]
            fed = None if routes[j] is None else routes[j].reshape(len(prompt) - 1 + len(output_ids[j]), -1,
                                                                   self._moe_top_k)
            samples.append(Sample(
                prompt_ids=np.asarray(prompt, np.int32), output_ids=output_ids[j],
                output_logprobs=logprobs[j], finish_reason=finish[j].tobytes().decode(),
                weight_version=versions[j].tobytes().decode(), logprob_kind=params.logprob_kind,
                routed_experts=None if fed is None else fed[len(prompt) - 1:],
                prompt_routed_experts=None if fed is None else fed[:len(prompt) - 1],
            ))
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _check_kind(self, params: SamplingParams) -> None:
        fleet_kind = self.manager.config.logprob_kind
        if params.logprob_kind == LogprobKind.RAW and fleet_kind != LogprobKind.RAW:
            raise ValueError(
                f"SamplingParams.logprob_kind is RAW but the servers were started with "
                f"ServerConfig.logprob_kind={fleet_kind.value!r}, so their output_token_logprobs "
                "are temperature-scaled, not raw; start them with logprob_kind=RAW "
                "(SGLANG_RETURN_ORIGINAL_LOGPROB=1) or ask for LogprobKind.PROCESSED")

    def _check_prompt(self, index: int, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty; every prompt needs >= 1 token id")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index} has token ids {bad[:5]} outside [0, {self.vocab_size}) "
                             f"(vocab_size of {self.manager.model_path})")
        return ids

    def _write_checkpoint(self, params, version: str) -> pathlib.Path:
        root = pathlib.Path(self.push_config.checkpoint_dir).resolve()
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"weights-{_safe_name(version)}"
        if final.exists():
            raise ValueError(f"SGLangEngine.update_weights: {final} exists already; version "
                             f"{version!r} was pushed before (versions must be new)")
        if jax.process_count() > 1:
            return self._write_shared_checkpoint(params, root, final, version)
        temporary = root / f".partial-{_safe_name(version)}-{uuid.uuid4().hex[:8]}"
        try:
            self._export_fn(params, str(temporary))
            _check_exported(temporary)
            os.rename(temporary, final)
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
        return final

    def _write_shared_checkpoint(self, params, root: pathlib.Path, final: pathlib.Path,
                                 version: str) -> pathlib.Path:
        """Several processes: every one calls ``export_fn`` on the same folder (the default export is a
        collective in which process 0 writes), process 0 renames it into place, and every process
        then loads it on its own servers, so ``checkpoint_dir`` must be storage all hosts see."""
        from jax.experimental import multihost_utils  # noqa: PLC0415

        temporary = root / f".partial-{_safe_name(version)}"  # the same name in every process
        if distributed.is_main_process():
            shutil.rmtree(temporary, ignore_errors=True)
        multihost_utils.sync_global_devices(f"jaxrl sglang push {version} begins")
        try:
            self._export_fn(params, str(temporary))
            multihost_utils.sync_global_devices(f"jaxrl sglang push {version} exported")
            if distributed.is_main_process():
                _check_exported(temporary)
                os.rename(temporary, final)
        finally:
            if distributed.is_main_process():
                shutil.rmtree(temporary, ignore_errors=True)
        multihost_utils.sync_global_devices(f"jaxrl sglang push {version} in place")
        if not (final / "config.json").is_file():
            raise FileNotFoundError(
                f"process {jax.process_index()} cannot see {final / 'config.json'}, which process 0 "
                "wrote; with several processes PushConfig.checkpoint_dir must be on storage every "
                "host sees (a shared file system)")
        return final

    def _load_everywhere(self, path: pathlib.Path, version: str) -> None:
        payload = {"model_path": str(path), "weight_version": version, "flush_cache": True}
        name = f"weight push of version {version!r} from {path}"
        calls = [(i, "POST", "/update_weights_from_disk", payload, name)
                 for i in range(self.manager.num_servers)]
        for i, result in enumerate(self._client.map(calls)):
            if not result.get("success", False):
                raise WeightPushError(
                    f"{self.manager.describe(i)}: {name} failed: {result.get('message')!r}; check "
                    "that the checkpoint has the served architecture and parameter names")

    def _verify(self, params, version: str) -> float:
        infos = self._client.map([(i, "GET", "/model_info", None, f"version check after pushing {version!r}")
                                  for i in range(self.manager.num_servers)])
        for i, info in enumerate(infos):
            if info.get("weight_version") != version:
                raise WeightPushError(
                    f"{self.manager.describe(i)} reports weight_version "
                    f"{info.get('weight_version')!r} after the push of {version!r}; the update "
                    "did not take effect: check the server log and that /update_weights_from_disk "
                    "accepts weight_version (SGLang >= 0.5.23)")
        probe = np.asarray(self.push_config.probe_ids, np.int32)
        expected = np.asarray(self._recompute_fn(params, probe), np.float64)
        if expected.shape != (len(probe) - 1,):
            raise ValueError(f"recompute_fn returned shape {expected.shape}; expected "
                             f"({len(probe) - 1},): log p(token t+1 | tokens <= t) of the probe")
        worst = 0.0
        for i in range(self.manager.num_servers):
            got = self.score(probe, server=i).astype(np.float64)
            diff = float(np.max(np.abs(got - expected)))
            worst = max(worst, diff)
            if not diff <= self.push_config.probe_atol:
                raise WeightPushError(
                    f"{self.manager.describe(i)}: after pushing version {version!r}, the probe's "
                    f"logprobs differ from the learner's recompute by up to {diff:.3g} nats "
                    f"(PushConfig.probe_atol={self.push_config.probe_atol:g}); the server is not "
                    "serving the learner's weights: check the export (parameter names, dtype, "
                    "tied embeddings) and the server's --dtype")
        return worst

    def _prune_checkpoints(self, keep: pathlib.Path) -> None:
        if not distributed.is_main_process():
            return  # the pushed folders are shared: process 0 prunes them
        pushed = sorted(keep.parent.glob("weights-*"), key=lambda p: p.stat().st_mtime)
        for old in pushed[: max(len(pushed) - self.push_config.keep_checkpoints, 0)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def _read_model_config(model_path: str) -> dict:
    path = pathlib.Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot read the model config {path}: {err}; ServerConfig.model_path "
                                "must be a Hugging Face checkpoint folder") from None


def _check_exported(folder: pathlib.Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"export_fn wrote no config.json into {folder}; it must write a "
                         "complete Hugging Face checkpoint (config.json + *.safetensors)")


def _safe_name(version: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
