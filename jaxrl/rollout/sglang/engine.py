"""``SGLangEngine``: the rollout interface (jaxrl/rollout/base.py) on a fleet of SGLang servers.

Generation: one ``/generate`` request per prompt (``n`` samples), prompt i sent
to server ``i % num_servers``, all in flight at once; results come back complete
and in prompt order. A request that fails (server died, timeout) is retried
after the fleet restarts a dead server; a retried request replaces, never
adds to, its prompt's samples.

With several JAX processes (jaxrl.distributed) every process calls ``generate``
with the same prompts; process p sends only its contiguous share
(``distributed.process_share``) to its own servers, and the samples are
all-gathered so every process returns the same full list in prompt order. The two
halves are ``generate_share`` (HTTP only: a background thread may run it beside the
update) and ``gather`` (the collective). ``update_weights`` is a collective too (push.py).

Weight push: ``update_weights`` hands the learner's parameters to ``WeightPusher``
(push.py), which exports (a checkpoint, or shared-memory tensors with ``PushConfig.method:
tensor``), loads, verifies and prunes. A server the fleet restarts after a failed request is
given the pushed tensors again before the request is retried (with a checkpoint push the fleet
restarts it from the last pushed checkpoint itself).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import jax
import numpy as np

from jaxrl import distributed
from jaxrl.rollout.base import LogprobKind, RolloutEngine, Sample, SamplingParams
from jaxrl.rollout.sglang.client import ClientConfig, SGLangClient, generate_payload, parse_samples
from jaxrl.rollout.sglang.fleet import Fleet
from jaxrl.rollout.sglang.push import (ExportFn, PushConfig, RecomputeFn, TensorsFn, WeightPusher, export_decoder,
                                       recompute_decoder, tensors_decoder)


@dataclasses.dataclass(frozen=True)
class Share:
    """One process's part of a ``generate`` call: all its prompts, and the samples of its share."""

    prompts: list[list[int]]
    params: SamplingParams
    n: int
    samples: list[list[Sample]]


class SGLangEngine(RolloutEngine):
    """Rollouts on the servers of a ``Fleet``: a started ``ServerManager`` or ``ExternalServers``.

    export_fn / recompute_fn / tensors_fn: how to write the learner's parameters as an HF
      checkpoint, how the learner scores a sequence and the HF tensors of the parameters
      (used by ``update_weights`` only, through ``WeightPusher``). The defaults take a
      ``jaxrl.models.Decoder`` as ``params``.
    """

    gathers_apart = True  # each process asks its own servers; only the gathering is collective

    def __init__(
        self,
        manager: Fleet,
        export_fn: ExportFn = export_decoder,
        recompute_fn: RecomputeFn = recompute_decoder,
        push: PushConfig = PushConfig(),
        client: ClientConfig = ClientConfig(),
        tensors_fn: TensorsFn = tensors_decoder,
    ):
        self.manager = manager
        self.push_config = push
        self._client = SGLangClient(manager.urls, client, on_failure=self._recover,
                                    describe=manager.describe, api_key=manager.api_key)
        self._pusher = WeightPusher(manager, self._client, push, export_fn, recompute_fn, tensors_fn)
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
        return self.gather(self.generate_share(prompts, params, n))

    def generate_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> Share:
        """This process's share of ``generate`` from its own servers: HTTP only, no collective."""
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
                 for k, (i, r) in enumerate(zip(mine, responses, strict=True))]
        return Share(prompts, params, n, local)

    def gather(self, share: Share) -> list[list[Sample]]:
        """Every process's share, on every process, in prompt order (a collective with several)."""
        return self._gather(share.samples, share.prompts, share.params, share.n)

    def update_weights(self, params, version: str) -> dict[str, float]:
        """Pushes ``params`` to every server as ``version`` and verifies it; returns the timing
        metrics of ``WeightPusher.push``. Raises ``PushVerificationError`` when the push did not
        take effect."""
        version = str(version)
        if version == self._version:
            raise ValueError(f"SGLangEngine.update_weights: version {version!r} is the current one; "
                             "every push needs a new version so samples can be attributed to weights")
        self.last_push_metrics = self._pusher.push(params, version)
        self._version = version
        return dict(self.last_push_metrics)

    def _recover(self, index: int) -> bool:
        """The client's retry hook: the fleet restarts server ``index`` if it died, then the pusher
        gives it the pushed weights it cannot load from disk."""
        restarted = bool(self.manager.ensure_running(index))
        if restarted:
            self._pusher.reload(index)
        return restarted

    def flush_cache(self) -> None:
        """Empties every server's prefix (radix) cache, so the next prompts are prefilled afresh."""
        self._client.map([(i, "POST", "/flush_cache", None, "cache flush")
                          for i in range(self.manager.num_servers)])

    def close(self) -> None:
        self._pusher.close()  # may still talk to the servers (a process group to leave)
        self._client.close()

    # ----- scoring ---------------------------------------------------------
    def score(self, token_ids: Sequence[int], server: int = 0) -> np.ndarray:
        """Server ``server``'s raw logprobs of a given sequence (``SGLangClient.score``): [L - 1]
        float32, entry t = log p(token_{t+1} | tokens_{<=t}); the ids are checked against the
        vocabulary first, so a bad one is named here rather than failing inside the server."""
        token_ids = self._check_prompt(0, token_ids)
        if len(token_ids) < 2:
            raise ValueError(f"SGLangEngine.score: need >= 2 tokens, got {len(token_ids)}")
        return self._client.score(server, token_ids)

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


def _read_model_config(model_path: str) -> dict:
    path = pathlib.Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"cannot read the model config {path}: {err}; ServerConfig.model_path "
                                "must be a Hugging Face checkpoint folder") from None
