"""How a run draws its samples: the rollout section of the config and the engine it builds.

``RolloutConfig`` chooses the engine (the embedded JAX sampler or a fleet of SGLang servers),
the group sizes and the sampling parameters; ``make_engine`` builds the engine it names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from jaxrl.distributed.placement import PlacementConfig
from jaxrl.rollout.base import LogprobKind, RolloutEngine, check_sampling_ranges
from jaxrl.rollout.rounds import DEFAULT_ROUND_TOKENS
from jaxrl.rollout.sglang import ClientConfig, PushConfig, ServerConfig


@dataclasses.dataclass(frozen=True)
class ExternalConfig:
    """Servers (or a router) someone else started, for a fleet separate from the learner
    (docs/rollouts.md#servers-started-elsewhere). urls: their base URLs; the API key they were
    started with comes from the environment (``JAXRL_SGLANG_API_KEY``), never the config.
    model_path: the checkpoint they serve, the run's initial weights ("" = ``model.hf_path``).
    logprob_kind, return_routed_experts, tensor_parallel (ranks per server): how they were
    started, which jaxrl cannot ask them (a wrong logprob kind shows in the push check)."""

    urls: tuple[str, ...]
    model_path: str = ""
    logprob_kind: LogprobKind = LogprobKind.RAW
    return_routed_experts: bool = False
    tensor_parallel: int = 1

    def __post_init__(self):
        if not self.urls:
            raise ValueError("rollout.sglang.external.urls is empty; give the servers' base URLs "
                             "(http://host:port), or a router's")
        if self.tensor_parallel < 1:
            raise ValueError(f"rollout.sglang.external.tensor_parallel must be >= 1, got {self.tensor_parallel}")


@dataclasses.dataclass(frozen=True)
class SGLangConfig:
    """The SGLang engine: the server fleet, the weight push (with its probe check) and the HTTP client.
    The fleet is either ``server`` (servers jaxrl starts, watches and restarts; ``model_path`` is the
    HF folder they start from, the run's initial weights) or ``external`` (servers someone else runs)."""

    server: ServerConfig | None = None
    external: ExternalConfig | None = None
    push: PushConfig = PushConfig()
    client: ClientConfig = ClientConfig()

    def __post_init__(self):
        if (self.server is None) == (self.external is None):
            raise ValueError("rollout.sglang needs exactly one of server (servers jaxrl starts) and external "
                             "(servers someone else started, by URL)")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How samples are drawn.

    engine: "embedded" (the in-process JAX sampler) or "sglang" (servers configured by the
    ``sglang`` section; SGLang verifies its own pushes with its probe). prompts_per_step
    prompts, group_size (G) samples each. logprob_kind: which distribution the engine
    reports (raw = what the learner recomputes; docs/rollouts.md#logprob-kinds). verify_push: after each
    weight push the engine must report the new version, and the next batch's engine
    logprobs must match the learner's recompute within ``push_tolerance`` (nats, with raw
    logprobs; the spot check runs on every sampled token, at no extra cost; SGLang additionally
    checks its probe sequence inside each push). push_check: the statistic of |dlogp| over the
    batch's generated tokens that ``push_tolerance`` bounds: "max" (one wrong token shows),
    "mean", or "auto": max when the learner and the engine both compute in float32, whose gaps
    are reduction order, mean otherwise (bfloat16's gaps are rounding flips whose largest grows
    with the batch; docs/rollouts.md#the-push-check-in-bfloat16). push_tolerance None: 1e-3
    under max, 0.05 under mean. With ``max_staleness`` > 0
    only batches sampled with the learner's current weights can be compared (the first one).
    max_staleness: how many updates the weights of a batch may lag the learner's; 0 is the
    synchronous loop, >= 1 generates the next batches in the background while the learner
    updates (docs/training.md#asynchronous-rollouts).
    max_batch: the most sequences the embedded sampler decodes in one call (its KV cache holds that
    many rows; a step's batch runs in as many calls as it needs); 0 = the whole step's batch (or the
    held-out evaluation's, when larger) in one call. ``jaxrl compile`` (docs/tpu.md) shows what fits.
    dynamic_sampling: drop prompt groups whose rewards do not vary and draw more prompts until
    the batch is full, at most ``max_extra_draws`` extra draws per step (DAPO;
    docs/training.md#dynamic-sampling).
    partial_tokens: partial rollouts (slime's --partial-rollout; docs/training.md#partial-rollouts):
    each round of a step generates at most this many tokens per sample; a step trains on the
    first ``prompts_per_step`` groups whose samples all finished, and unfinished ones continue
    in the next step with the new weights (per-token versions in ``Sample.output_versions``).
    0 = off (every sample is generated whole in its step). partial_groups: prompt groups in
    flight (started, or finished and not yet trained on), so that a step ends when the fastest
    ``prompts_per_step`` finish and the long tail carries over (slime's over-sampling); 0 = twice
    ``prompts_per_step``; ``prompts_per_step`` itself makes partial rollouts with
    ``partial_tokens >= max_new_tokens`` the synchronous loop.
    round_tokens: the embedded sampler decodes a generation longer than this many tokens in rounds
    whose KV cache holds only the unfinished samples and doubles each round, so its memory follows
    the batch's real lengths (docs/rollouts.md#long-generations); 0 = one dense cache per call, sized
    to the longest sample's bucket. Shorter generations run one call either way.
    """

    engine: Literal["embedded", "sglang"] = "embedded"
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    logprob_kind: LogprobKind = LogprobKind.RAW
    verify_push: bool = True
    push_tolerance: float | None = None
    push_check: Literal["auto", "max", "mean"] = "auto"
    max_staleness: int = 0
    max_batch: int = 0
    dynamic_sampling: bool = False
    max_extra_draws: int = 4
    partial_tokens: int = 0
    partial_groups: int = 0
    round_tokens: int = DEFAULT_ROUND_TOKENS
    sglang: SGLangConfig | None = None

    def __post_init__(self):
        if self.engine == "sglang" and self.sglang is None:
            raise ValueError("rollout.engine='sglang' needs a rollout.sglang section (server.model_path at least)")
        if self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError(
                f"rollout.prompts_per_step ({self.prompts_per_step}) and rollout.group_size "
                f"({self.group_size}) must be >= 1"
            )
        # SamplingParams checks the same, but only after the model loaded and the first rollout began.
        check_sampling_ranges("rollout", self)
        if self.max_batch < 0:
            raise ValueError(f"rollout.max_batch must be >= 0 (0 = the whole batch at once), got {self.max_batch}")
        if self.max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0 (0 = synchronous), got {self.max_staleness}")
        if self.max_extra_draws < 0:
            raise ValueError(f"rollout.max_extra_draws must be >= 0, got {self.max_extra_draws}")
        if self.dynamic_sampling and self.max_staleness > 0:
            raise ValueError("rollout.dynamic_sampling draws its extra prompts with the learner's current weights, "
                             f"which rollout.max_staleness={self.max_staleness} does not give the engine; use one "
                             "of the two")
        if self.partial_tokens < 0:
            raise ValueError(f"rollout.partial_tokens must be >= 0 (0 = off), got {self.partial_tokens}")
        if self.partial_groups and self.partial_groups < self.prompts_per_step:
            raise ValueError(f"rollout.partial_groups={self.partial_groups} must be >= rollout.prompts_per_step="
                             f"{self.prompts_per_step} (a step trains on that many finished groups), or 0 for "
                             f"twice prompts_per_step")
        for key, value in (("max_staleness", self.max_staleness), ("dynamic_sampling", self.dynamic_sampling)):
            if self.partial_tokens and value:
                raise ValueError(f"rollout.partial_tokens (partial rollouts) and rollout.{key} both decide which "
                                 f"samples a step trains on; use one of the two (set rollout.{key} to its "
                                 "default or rollout.partial_tokens=0)")
        if self.round_tokens < 0:
            raise ValueError(f"rollout.round_tokens must be >= 0 (0 = one dense KV cache per call), got "
                             f"{self.round_tokens}")
        if self.push_tolerance is not None and not self.push_tolerance > 0.0:
            raise ValueError(f"rollout.push_tolerance must be > 0 (nats), got {self.push_tolerance}")


def make_engine(rollout: RolloutConfig, model, mesh: jax.sharding.Mesh, max_batch: int,
                placement: PlacementConfig | None = None) -> tuple[RolloutEngine, Any]:
    """(engine, server manager or None) for ``rollout.engine``. The embedded sampler reads
    ``model``'s arrays by reference and decodes up to ``max_batch`` sequences at once; SGLang
    servers start from ``rollout.sglang.server.model_path``, this process's own, on the devices
    ``placement`` gives them, or are someone else's (``rollout.sglang.external``: nothing to stop)."""
    if rollout.engine == "sglang":
        from jaxrl.rollout.sglang import ExternalFleetConfig, ExternalServers, ServerManager, SGLangEngine

        sglang = rollout.sglang
        if sglang.external is not None:
            external = sglang.external
            fleet = ExternalServers(external.urls, external.model_path, ExternalFleetConfig(
                external.logprob_kind, external.return_routed_experts, external.tensor_parallel))
            return SGLangEngine(fleet, push=sglang.push, client=sglang.client), None
        server = sglang.server
        if placement is not None:
            server = server.placed(placement, jax.process_index())
        elif jax.process_count() > 1:
            # Processes that share a host (one per GPU under SLURM) must not share ports: each
            # process starts its own servers, so process p takes the block after process p-1's.
            server = dataclasses.replace(server, base_port=server.base_port + jax.process_index() * server.num_servers)
        manager = ServerManager(server).start()
        return SGLangEngine(manager, push=sglang.push, client=sglang.client), manager
    from jaxrl.rollout.sampler import JaxSampler

    return JaxSampler(model, mesh=mesh, max_batch=max_batch, round_tokens=rollout.round_tokens), None
