"""The trainer's typed config: one frozen dataclass per section, validated at load.

A YAML file in ``configs/`` fills these sections; ``key=value`` overrides on the
command line use the same dotted names (``optimizer.lr=1e-5``,
``rollout.group_size=16``, ``objective.policy_loss=gspo``). Every loss, KL,
entropy and mismatch option lives in the ``objective`` section, which is the loss
library's own ``ObjectiveConfig``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from jaxrl.config import FieldError
from jaxrl.data.pipeline import DataConfig, check_mixture
from jaxrl.distributed.placement import PlacementConfig
from jaxrl.env.config import EnvConfig
from jaxrl.evaluation.filter import FilterConfig
from jaxrl.evaluation.self_verify import SelfVerifyConfig
from jaxrl.losses.advantages import AdvantageConfig
from jaxrl.losses.objective import ObjectiveConfig
from jaxrl.models.config import ModelConfig
from jaxrl.models.context_parallel import chunks_per_shard
from jaxrl.models.hf import read_hf_config
from jaxrl.models.sharding import MeshConfig
from jaxrl.reward import RewardConfig
from jaxrl.rollout.config import RolloutConfig
from jaxrl.rollout.sglang.judge import JudgeServerConfig
from jaxrl.trainer.checkpoint import CheckpointConfig


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Where the initial weights come from: ``hf_path`` (a transformers Qwen3 / Qwen3-MoE /
    MiniMax / Qwen3-Next folder, e.g. the SFT warm-up's ``checkpoint.export_hf``), else a random
    init of ``architecture`` with ``init_seed``. ``dtype``/``param_dtype``/``remat``/
    ``attention_impl``/``attention_block_size``/``context_parallel``/``scan_layers`` override the architecture's
    (``remat``: "none" or one of the model's remat policies; ``attention_impl``:
    docs/models.md#attention-implementations; ``context_parallel``: docs/models.md#context-parallelism;
    ``scan_layers``: docs/models.md#scanned-layers)."""

    hf_path: str = ""
    architecture: ModelConfig | None = None
    init_seed: int = 0
    dtype: Literal["float32", "bfloat16"] | None = None
    param_dtype: Literal["float32", "bfloat16"] | None = None
    remat: Literal["none", "full", "save_dots", "save_attention_out"] | None = None
    attention_impl: Literal["auto", "xla", "chunked", "splash", "cudnn"] | None = None
    attention_block_size: int | None = None
    context_parallel: Literal["auto", "none", "ulysses", "ring"] | None = None
    scan_layers: bool | None = None

    _OVERRIDES = ("dtype", "param_dtype", "remat", "attention_impl", "attention_block_size", "context_parallel",
                  "scan_layers")

    def __post_init__(self):
        if not self.hf_path and self.architecture is None:
            raise ValueError("model: give hf_path (a transformers folder) or architecture (for a random init)")

    def overrides(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in self._OVERRIDES if getattr(self, k) is not None}

    def row_chunks(self) -> int:
        """How many chunks of a row each ``sequence`` shard holds (2 with ``context_parallel: ring``, else 1):
        the trainers' rows are a multiple of this times the shards (``sharding.sequence_row_length``)."""
        mode = self.context_parallel or (self.architecture.context_parallel if self.architecture else "auto")
        return chunks_per_shard(mode)

    def max_positions(self) -> tuple[str, int] | None:
        """The model's ``max_position_embeddings`` as :meth:`size` gives it."""
        return self.size("max_position_embeddings")

    def vocab_size(self) -> tuple[str, int] | None:
        """The model's ``vocab_size`` (embedding rows) as :meth:`size` gives it."""
        return self.size("vocab_size")

    def size(self, field: str) -> tuple[str, int] | None:
        """(the key and value, for messages) of a ``ModelConfig`` count the model is built with, read
        before it is: the checkpoint's config.json (its loader's default when the file has none) or the
        architecture's. None when ``hf_path`` holds no config.json yet (the SFT phase may write it later;
        the loader names it if not)."""
        if not self.hf_path:
            value = getattr(self.architecture, field)
            return f"model.architecture.{field}={value}", value
        config_file = os.path.join(self.hf_path, "config.json")
        if not os.path.isfile(config_file):
            return None
        value = read_hf_config(self.hf_path).get(field, getattr(ModelConfig, field, None))
        if not isinstance(value, int) or isinstance(value, bool):
            return None  # not a count: the checkpoint loader refuses it, naming the file
        return f"{field}={value} in {config_file} (model.hf_path)", value


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """The update of docs/training.md#the-rl-update-loop.

    mini_batches: S optimizer steps per rollout batch (1 = on-policy). epochs: E passes of those S
    steps over the same batch (trajectory reuse, PPO's epochs: E x S updates per batch, later
    ones further off-policy; the clip and the mismatch corrections see the lag). micro_batches: gradient
    accumulation inside each optimizer step (same update as one big batch). Whether ``old_logp``
    is recomputed or bypassed is ``objective.bypass``; recompute_old_logp: "when_needed" (the
    default) skips the learner's recompute where it is redundant (the embedded sampler on the
    learner's own arrays, raw logprobs, one mini-batch, nothing in the objective that needs the
    learner-versus-engine ratio; docs/training.md#skipping-a-redundant-recompute), "always" keeps it.
    reference_metrics: compute the reference model's logprobs for the KL metrics even when the objective has no KL term.
    logprob_chunk_size: tokens per chunk of the learner's LM head, on each device when the batch is split
    over devices (logprobs and entropy are computed chunk by chunk, never as a whole ``[B, T, V]``
    logits array); the SFT step (``jaxrl sft``) uses it too.
    pack: the learner's forwards (the recompute and the update) run on rows that hold several
    samples each (``jaxrl.models.packing``): the same losses, less compute on padding.
    share_prefix (with ``pack``): the samples of one prompt (a GRPO group) lay the prompt out once
    in the packed rows, each completion attending to that one copy: the same losses, and the
    learner's forwards and backward skip ``group_size - 1`` of every ``group_size`` prompt tokens
    (docs/training.md#shared-prompts).
    max_consecutive_skips: an optimizer step whose loss, gradient or update is not
    finite is skipped (parameters and optimizer state kept, ``update/nonfinite_skips`` counts
    it); this many skips in a row stop the run with an error. spike_factor: warn when an
    update's gradient norm exceeds ``spike_factor`` x the median of the last 20, or when an
    update is larger than the parameters it changes (0 disables the warnings).
    routing_replay: rollout routing replay (R3) for MoE models: the recompute, the reference
    logprobs and every update route each token to the experts the engine chose for it
    (``Sample.routed_experts``), with the combine weights from the learner's router
    (docs/training.md#routing-replay). router_z_loss: the coefficient of ST-MoE's router z-loss
    in the update's loss (MoE models; 0 = off; ST-MoE uses 1e-3).
    """

    mini_batches: int = 1
    epochs: int = 1
    micro_batches: int = 1
    recompute_old_logp: Literal["always", "when_needed"] = "when_needed"
    reference_metrics: bool = False
    logprob_chunk_size: int = 1024
    pack: bool = False
    share_prefix: bool = False
    max_consecutive_skips: int = 3
    spike_factor: float = 10.0
    routing_replay: bool = False
    router_z_loss: float = 0.0

    def __post_init__(self):
        if self.mini_batches < 1 or self.micro_batches < 1 or self.epochs < 1:
            raise ValueError(
                f"update.mini_batches ({self.mini_batches}), update.micro_batches ({self.micro_batches}) and "
                f"update.epochs ({self.epochs}) must be >= 1"
            )
        if self.logprob_chunk_size < 1:
            raise ValueError(f"update.logprob_chunk_size must be >= 1, got {self.logprob_chunk_size}")
        if self.share_prefix and not self.pack:
            raise ValueError("update.share_prefix lays each prompt out once in packed rows: set update.pack: true "
                             "as well")
        if not self.router_z_loss >= 0.0:
            raise ValueError(f"update.router_z_loss must be >= 0 (0 = off), got {self.router_z_loss}")
        if self.max_consecutive_skips < 1:
            raise ValueError(f"update.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")
        if self.spike_factor != 0.0 and self.spike_factor <= 1.0:
            raise ValueError(f"update.spike_factor must be > 1 (or 0 to disable), got {self.spike_factor}")


def _check_section(name: str, section, checks: list[tuple[str, bool, str]]) -> None:
    for key, holds, expected in checks:
        if not holds:
            raise FieldError(name, key, getattr(section, key), expected)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax) with linear warm-up, then cosine decay to ``lr * min_lr_ratio`` or constant,
    and global-norm gradient clipping (``clip_norm <= 0`` disables it)."""

    lr: float = 1e-6
    warmup_steps: int = 0
    schedule: Literal["cosine", "constant"] = "constant"
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float = 1.0

    def __post_init__(self):
        _check_section("optimizer", self, [
            ("lr", self.lr > 0, "> 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            ("b1", 0.0 <= self.b1 < 1.0, "in [0, 1)"),
            ("b2", 0.0 <= self.b2 < 1.0, "in [0, 1)"),
            # With eps = 0 a parameter whose gradient is exactly 0 (an unused token's embedding row)
            # gets 0 / 0: every update would be non-finite and skipped.
            ("eps", self.eps > 0, "> 0 (AdamW divides by sqrt(v) + eps)"),
            ("weight_decay", self.weight_decay >= 0, ">= 0")])


@dataclasses.dataclass(frozen=True)
class CriticOptimizerConfig(OptimizerConfig):
    """The critic's AdamW: the ``optimizer`` section's fields, ``lr`` [1e-5, verl's critic default]."""

    lr: float = 1e-5


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The critic of PPO with GAE (``advantage.estimator: gae``; docs/training.md#critic): a value
    model with its own AdamW, ``optimizer`` (the fields of the top-level ``optimizer`` section, its
    ``warmup_steps`` counting critic updates). ``warmup_steps``: RL steps at the start of the run
    during which only the critic trains and the policy is not updated (verl's
    ``critic_warmup``). ``value_clip``: the clip range of the value loss around the values the
    batch was scored with (None: unclipped)."""

    optimizer: CriticOptimizerConfig = CriticOptimizerConfig()
    warmup_steps: int = 0
    value_clip: float | None = 0.2

    def __post_init__(self):
        _check_section("critic", self, [
            ("warmup_steps", self.warmup_steps >= 0, ">= 0 (RL steps of critic-only training)"),
            ("value_clip", self.value_clip is None or self.value_clip > 0, "> 0, or null for no clipping")])


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out reward: every ``every`` steps (and before the first and after the last), on up
    to ``max_prompts`` prompts of ``data.eval_files``, ``samples`` samples each, sampled like
    training (``temperature`` None = the rollout's). ``k``: the pass@k to report besides avg@n
    (``heldout/pass@K``; each ``k <= samples``; docs/evaluation.md#metrics). ``jaxrl eval``
    samples with ``samples``, ``temperature`` and ``k`` too, on every prompt unless told
    ``--max-prompts``; with ``self_verify`` it also has the model verify its own samples and
    reports Best@n and the verifier's accuracy (``SelfVerifyConfig``;
    docs/evaluation.md#self-verification), which the trainer's held-out evaluation does not."""

    every: int = 0
    max_prompts: int = 64
    samples: int = 1
    temperature: float | None = None
    k: tuple[int, ...] = ()
    self_verify: SelfVerifyConfig | None = None

    def __post_init__(self):
        if self.samples < 1 or self.max_prompts < 0:
            raise ValueError(f"eval.samples ({self.samples}) must be >= 1 and eval.max_prompts "
                             f"({self.max_prompts}) >= 0")
        bad = [k for k in self.k if not 1 <= k <= self.samples]
        if bad:
            raise ValueError(f"eval.k={list(self.k)}: pass@k needs 1 <= k <= eval.samples={self.samples}; "
                             f"raise eval.samples or drop k={bad}")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """dump_batch_every: every N steps (0: never) save the step's rollout batch, with the
    engine's and the learner's logprobs, as ``OUTPUT_DIR/batches/step-NNNNNN.npz`` for
    ``jaxrl align report`` (the alignment checker's dump format)."""

    tensorboard: bool = True
    progress: bool = True
    plots: bool = True
    dump_batch_every: int = 0

    def __post_init__(self):
        if self.dump_batch_every < 0:
            raise ValueError(f"logging.dump_batch_every must be >= 0 (0 never dumps), got {self.dump_batch_every}")


@dataclasses.dataclass(frozen=True)
class SFTStage:
    """One stage of the SFT length curriculum: ``steps`` steps on sequences of at most
    ``max_length`` tokens (Motif: 16K -> 32K -> 64K); longer rows wait for a later stage.
    ``mixture``: this stage's weights by ``data.mixture_field`` (None: ``data.mixture``)."""

    steps: int
    max_length: int
    mixture: dict[str, float] | None = None

    def __post_init__(self):
        check_mixture("sft.stages[].mixture", self.mixture)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on prompt/response pairs (loss on response tokens only). pack:
    several pairs per row of the stage's ``max_length`` (``jaxrl.models.packing``)."""

    batch_size: int = 8
    micro_batches: int = 1
    stages: tuple[SFTStage, ...] = ()
    pack: bool = False

    def __post_init__(self):
        if self.batch_size < 1 or self.micro_batches < 1 or self.batch_size % self.micro_batches:
            raise ValueError(
                f"sft.batch_size ({self.batch_size}) must be >= 1 and divisible by sft.micro_batches "
                f"({self.micro_batches})"
            )
        lengths = [s.max_length for s in self.stages]
        if lengths != sorted(lengths):
            raise ValueError(f"sft.stages max_length must not decrease, got {lengths}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run. ``output_dir`` receives metrics, TensorBoard events and plots; checkpoints go
    to ``checkpoint.directory`` (none when it is empty). ``steps``: RL steps (outer iterations of
    docs/training.md#the-rl-update-loop). ``env``: multi-turn rollouts with environments and tools
    (``jaxrl.trainer.stages.rollout.episodes``; None: one model turn per sample). ``critic`` is not
    None exactly when the run has a critic
    (``advantage.estimator: gae``; the section's defaults when it is not given). ``placement``: each
    host's devices for the learner and its SGLang servers (docs/multi-host.md#gpu-clusters; None: the
    mesh takes the first devices, the servers see every GPU). ``filter``: the
    section of ``jaxrl filter`` only (docs/evaluation.md#the-pass-rate-filter). ``judges``: name ->
    the SGLang fleet of a judge model, which ``reward.tasks.<task>.judge.server`` names
    (docs/training.md#generative-verifier-rewards). ``compile_cache_dir``: JAX's persistent
    compilation cache, so a rerun or a resumed run loads its compiled programs ("" turns it off;
    ``JAX_COMPILATION_CACHE_DIR`` wins; docs/training.md#compiled-programs-are-cached)."""

    output_dir: str
    model: PolicyConfig
    data: DataConfig
    steps: int = 100
    seed: int = 0
    hardware: str = ""
    compile_cache_dir: str = "~/.cache/jaxrl/xla"
    mesh: MeshConfig = MeshConfig()
    placement: PlacementConfig | None = None
    reward: RewardConfig = RewardConfig()
    judges: dict[str, JudgeServerConfig] = dataclasses.field(default_factory=dict)
    rollout: RolloutConfig = RolloutConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    critic: CriticConfig | None = None
    env: EnvConfig | None = None
    objective: ObjectiveConfig = ObjectiveConfig()
    update: UpdateConfig = UpdateConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    filter: FilterConfig = FilterConfig()
    logging: LoggingConfig = LoggingConfig()
    sft: SFTConfig = SFTConfig()

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.seed < 0:  # numpy's SeedSequence, from which every step's sampling seed is drawn, takes none
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if "://" in self.output_dir:
            raise ValueError(
                f"output_dir must be a local folder (metrics, TensorBoard and plots are written with plain "
                f"file I/O), got {self.output_dir!r}; put checkpoints on gs:// or other storage with "
                f"checkpoint.directory (Orbax writes there) and keep output_dir local"
            )
        for name, task in self.reward.tasks.items():
            if task.judge is not None and task.judge.server not in self.judges:
                raise ValueError(f"reward.tasks.{name}.judge.server={task.judge.server!r} is not a key of judges "
                                 f"{sorted(self.judges)}; declare the judge's fleet there")
            if task.judge is not None and task.judge.samples > 1 and self.judges[task.judge.server].temperature == 0:
                raise ValueError(f"reward.tasks.{name}.judge.samples={task.judge.samples} draws the same judgement "
                                 f"from a greedy judge (judges.{task.judge.server}.temperature=0): set that "
                                 f"temperature above 0, or judge.samples to 1")
        if self.critic is not None and not self.advantage.needs_critic:
            raise ValueError(
                f"critic.* is set but advantage.estimator={self.advantage.estimator!r} uses no critic; the critic "
                f"exists only with advantage.estimator=gae: set that, or remove the critic section")
        if self.advantage.needs_critic and self.critic is None:  # gae: the critic with its defaults
            object.__setattr__(self, "critic", CriticConfig())
        if self.advantage.estimator in AdvantageConfig.GROUPED and self.rollout.group_size < 2:
            raise ValueError(
                f"advantage.estimator={self.advantage.estimator!r} compares the samples of a prompt's group, "
                f"so rollout.group_size={self.rollout.group_size} gives every sample a zero advantage and "
                f"nothing is learned; set rollout.group_size >= 2 or use advantage.estimator=reinforce")
        if self.advantage.estimator == "passk" and self.advantage.passk_k > self.rollout.group_size:
            raise ValueError(
                f"advantage.passk_k={self.advantage.passk_k} exceeds rollout.group_size={self.rollout.group_size}: "
                f"pass@k needs k <= G samples per prompt; lower advantage.passk_k or raise rollout.group_size")
        if self.env is not None:
            self._check_env_fits_model()
        if self.placement is not None:
            self._check_placement()
        if self.rollout.sglang is not None and self.rollout.sglang.external is not None:
            self._fill_external_model()
        if self.env is not None and self.rollout.max_staleness > 0:
            raise ValueError(f"env (multi-turn rollouts) runs with the synchronous loop for now; set "
                             f"rollout.max_staleness=0 (got {self.rollout.max_staleness})")
        if self.rollout.partial_tokens and (self.env is not None or self.advantage.needs_greedy_baseline):
            other = "env (multi-turn rollouts)" if self.env is not None else \
                f"advantage.estimator={self.advantage.estimator!r} (its greedy baseline)"
            raise ValueError(f"rollout.partial_tokens (partial rollouts) continues single-turn samples across steps, "
                             f"and {other} is not one; set rollout.partial_tokens=0")
        sequences = self.rollout.prompts_per_step * self.rollout.group_size
        split = self.update.mini_batches * self.update.micro_batches
        if sequences % split:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.group_size = {sequences} sequences per step must be "
                f"divisible by update.mini_batches * update.micro_batches = {split}"
            )

    def _fill_external_model(self) -> None:
        """Servers started elsewhere serve the run's initial weights unless their section says otherwise."""
        external = self.rollout.sglang.external
        if external.model_path:
            return
        if not self.model.hf_path:
            raise ValueError("rollout.sglang.external.model_path is empty and so is model.hf_path: give the "
                             "checkpoint folder the servers serve (its config.json names the vocabulary)")
        sglang = dataclasses.replace(self.rollout.sglang,
                                     external=dataclasses.replace(external, model_path=self.model.hf_path))
        object.__setattr__(self, "rollout", dataclasses.replace(self.rollout, sglang=sglang))

    def _check_placement(self) -> None:
        """The layout must fit the mesh and leave the SGLang servers at least one device each."""
        if self.rollout.engine != "sglang" or self.rollout.sglang.external is not None:
            has = (f"rollout.engine={self.rollout.engine!r}" if self.rollout.engine != "sglang"
                   else "servers started elsewhere (rollout.sglang.external)")
            raise ValueError(f"placement lays out the SGLang servers jaxrl starts beside the learner, and this run "
                             f"has {has}; remove the placement section (or use rollout.sglang.server)")
        self.placement.check_mesh(dataclasses.asdict(self.mesh))
        if not self.placement.servers_per_host:
            raise ValueError(f"placement gives every one of the {self.placement.devices_per_host} devices per host "
                             f"to the learner (placement.learner_devices), which leaves none for SGLang servers; "
                             f"give the learner fewer or set placement.colocate=true")
        self.rollout.sglang.server.check_placeable("rollout.sglang.server")

    def _check_env_fits_model(self) -> None:
        """Refuses an env task whose ``limits.max_total_tokens`` (a whole conversation, and so the
        learner's row length) exceeds the model's positions: the model is not made for a longer
        conversation, and rows sized for one cost time and memory for nothing. The task's other token limits
        (an observation, a turn's new tokens) are cut to what ``max_total_tokens`` leaves."""
        known = self.model.max_positions()
        if known is None:
            return
        source, positions = known
        for name, task in self.env.tasks.items():
            key, tokens = f"env.tasks.{name}.limits.max_total_tokens", task.limits.max_total_tokens
            if tokens > positions:
                raise ValueError(f"{key}={tokens} exceeds {source}: a conversation must fit the "
                                 f"model's positions; lower {key} to at most {positions}")
