"""The critic of PPO with GAE: the advantage stage's variant, with its value model and its own optimizer.

With ``advantage.estimator: gae`` the critic replaces the sequence-level advantage stage and
joins the update stage as a co-learner; everything it does is here (docs/training.md#critic):

1. **score** (the stage's first half): the critic's values of every column of the batch before
   any update, ``StepBatch.values`` (the "old values" of the clipped value loss);
2. **advantages** (its second half): token rewards (the sample's
   score on its last generated token, or the reward function's ``token_rewards``), minus
   ``coef * k1`` per token with ``objective.kl_kind: k1-in-reward``; GAE over the generated
   tokens (``gae_advantages``: ``advantage.gamma``, ``advantage.lam``); the advantages
   whitened over the batch's masked tokens (verl's default for GAE); the returns are the
   critic's targets (``StepBatch.returns``);
3. **update** (called by the update stage, ``jaxrl.trainer.stages.update``): one step of the
   critic's own AdamW on each of the policy's mini-batches (the same rows, the same micro-batch
   split), minimising the clipped value loss (``clipped_value_loss``, token-mean over the
   mini-batch's masked tokens).

During the first ``critic.warmup_steps`` RL steps only the critic updates; the policy's
parameters and optimizer state stay as they are (verl's ``critic_warmup``). A step the batch
filter skips (``objective.batch_filter_threshold``) skips the critic's update too: the filter
judged the batch untrustworthy, and a skipped step changes no learner state at all.
Checkpoints hold the critic's parameters and optimizer state (item ``critic``) and its update
guard (``critic_guard`` in the meta).

Metrics: ``critic/values_mean`` and ``critic/explained_variance`` (the values the batch was
scored with against its returns, verl's ``vf_explained_var``), ``critic/value_loss``,
``critic/vf_clip_frac``, ``critic/value_error``, ``critic/grad_norm``, ``critic/relative_size``,
``critic/nonfinite``, ``critic/nonfinite_skips``, ``critic/spike_warnings`` (its update guard's
counts, ``jaxrl.trainer.guard``), ``critic/lr``, ``critic/warmup``; ``advantage/raw_mean``,
``advantage/raw_std`` (before whitening), ``advantage/returns_mean``,
``advantage/token_reward_sum`` (mean per valid sample, after any KL penalty).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.losses import ObjectiveConfig, kl_in_reward, loss_normalizer
from jaxrl.models.packing import pack_rows
from jaxrl.models.sharding import batch_devices, batch_shardings
from jaxrl.models.value import ValueModel
from jaxrl.reward import ScoredBatch
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.stages.advantage.value import critic_values, gae, masked_mean, token_rewards, value_loss_fn
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord
from jaxrl.trainer.update import build_optimizer, make_train_step

# The train step's metric names -> the logged critic/ names (the rest of the loss's are dropped).
_UPDATE_NAMES = {"loss": "critic/value_loss", "grad_norm": "critic/grad_norm", "vf_clip_frac": "critic/vf_clip_frac",
                 "value_error": "critic/value_error", "update/nonfinite": "critic/nonfinite",
                 "update/relative_size": "critic/relative_size"}


class CriticStage(Stage):
    """The value model (initialised from the policy's initial weights, head at zero:
    ``jaxrl.models.value``) with its own AdamW state and TrainStep on the learner's mesh, and the
    steps of the module docstring. ``state`` is its train state (what checkpoints save)."""

    name = "advantage"
    resume_hint = ("the critic exists only with advantage.estimator=gae, so resume this run with the "
                   "advantage.estimator it was started with, or start afresh")

    def __init__(self, context: StepContext):
        config, c, u = context.config, context.config.critic, context.config.update
        self.context, self.mesh = context, context.mesh
        # Its own update guard: a critic whose every update is skipped stops the run as the policy's would.
        self.guard = UpdateGuard(u.max_consecutive_skips, u.spike_factor, context.warn, prefix="critic")
        self.warmup_steps = c.warmup_steps
        optimizer, self.schedule = build_optimizer(c.optimizer, config.steps * u.mini_batches)
        self.train_step, self.state = make_train_step(
            ValueModel.from_decoder(context.learner.model()), optimizer,
            value_loss_fn(c.value_clip, u.micro_batches), context.mesh)
        sequences = config.rollout.prompts_per_step * config.rollout.group_size
        self.rows = max(sequences // (u.mini_batches * u.micro_batches), 1)

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        batch, score_metrics = self.score(record.batch)
        batch, metrics = self.advantages(batch, record.scored, self.context.objective)
        return record.replace(batch=batch), {**metrics, **score_metrics}

    def policy_frozen(self, step: int) -> bool:
        """Whether RL step ``step`` (1-based) is a warm-up step: the critic trains, the policy does not."""
        return step <= self.warmup_steps

    # ------------------------------------------------------------ checkpoints
    def checkpoint(self, step: int) -> dict:
        return {"critic_guard": self.guard.state()}

    def checkpoint_items(self) -> dict:
        return {"critic": self.state}

    def restore(self, meta: dict, items: dict) -> None:
        self.state = items["critic"]
        if "critic_guard" in meta:  # absent in checkpoints written before the critic had its guard
            self.guard.restore(meta["critic_guard"])

    # ------------------------------------------------------------ score
    def score(self, batch: StepBatch) -> tuple[StepBatch, dict[str, float]]:
        """``batch.values``: the critic's values [N, T] float32 before the update (0 off ``mask``),
        scored ``rows`` sequences at a time; ``critic/values_mean``."""
        u = self.context.config.update
        inputs = tuple(np.asarray(x, np.int32) for x in batch.model_inputs())
        chunks = []
        for start in range(0, batch.rows, self.rows):
            chunk = tuple(x[start:start + self.rows] for x in inputs)
            packed = pack_rows(*chunk, devices=batch_devices(self.mesh)) if u.pack else None
            rows = packed.model_inputs()[:3] if packed is not None else chunk[:3]
            with jax.set_mesh(self.mesh):
                rows = jax.device_put(rows, batch_shardings(rows, self.mesh))
                values = critic_values(self.train_step.graphdef, self.state["params"], *rows, replicate=True)
                if packed is not None:
                    values = packed.unpack(values)
            chunks.append(np.asarray(values, np.float32))
        mask = np.asarray(batch.mask, np.float32)
        values = np.concatenate(chunks) * mask
        return batch.replace(values=values), {"critic/values_mean": masked_mean(values, mask)}

    # ------------------------------------------------------------ advantages
    def advantages(self, batch: StepBatch, scored: ScoredBatch, objective: ObjectiveConfig
                   ) -> tuple[StepBatch, dict[str, float]]:
        """Token-level GAE from ``batch.values``: ``advantages`` (whitened), ``returns`` and the
        task's ``token_rewards`` on the batch; the module docstring's ``advantage/`` metrics and
        ``critic/explained_variance``."""
        a = self.context.config.advantage
        mask = jnp.asarray(batch.mask, jnp.float32)
        rewards = token_rewards(batch, scored)
        shaped = jnp.asarray(rewards)
        if objective.kl_in_reward_coef > 0:
            shaped = kl_in_reward(shaped, jnp.asarray(batch.old_logp), jnp.asarray(batch.ref_logp), mask,
                                  coef=objective.kl_in_reward_coef)
        raw, returns, advantages, ev = gae(shaped, jnp.asarray(batch.values, jnp.float32), mask, a.gamma, a.lam)
        m, raw = np.asarray(mask), np.asarray(raw)
        mean = masked_mean(raw, m)
        valid = m.any(axis=1)
        metrics = {
            "advantage/raw_mean": mean,
            "advantage/raw_std": float(np.sqrt(masked_mean(np.square(raw - mean), m))),
            "advantage/returns_mean": masked_mean(np.asarray(returns), m),
            "advantage/token_reward_sum": float(np.asarray(shaped * mask).sum(axis=1)[valid].mean())
            if valid.any() else 0.0,
            "critic/explained_variance": float(ev),
        }
        batch = batch.replace(advantages=np.asarray(advantages, np.float32), returns=np.asarray(returns, np.float32),
                              token_rewards=rewards)
        return batch, metrics

    # ------------------------------------------------------------ update
    def update(self, mini: UpdateBatch, step: int) -> dict[str, float]:
        """One critic step on a policy mini-batch (host arrays): its rows, its micro-batch split,
        the token-mean normaliser of its own mask, judged by the critic's guard (NonFiniteUpdateError
        after ``update.max_consecutive_skips`` skipped updates in a row). Returns the step's
        metrics, unprefixed."""
        tokens = mini.tokens.replace(rollout_logp=None, old_logp=None, ref_logp=None, advantages=None,
                                     routed_experts=None)
        normalizer = np.float32(loss_normalizer("token-mean", jnp.asarray(tokens.mask)))
        view = mini.replace(tokens=tokens, normalizer=normalizer, cov_selection=None)
        view = jax.device_put(view, batch_shardings(view, self.mesh))
        self.state, metrics = self.train_step(self.state, view)
        metrics = jax.device_get(metrics)
        self.guard.check(step, metrics)
        return metrics

    def update_metrics(self, collected: list[dict], step: int, frozen: bool) -> dict[str, float]:
        """The step's ``critic/`` update metrics: each averaged over its mini-batches (none when
        the step was skipped), the learning rate and whether the policy sat out (warm-up)."""
        u = self.context.config.update
        out = {name: float(np.mean([m[key] for m in collected])) for key, name in _UPDATE_NAMES.items()
               if collected and key in collected[0]}
        out["critic/lr"] = float(self.schedule(max(step * u.mini_batches - 1, 0)))
        out["critic/warmup"] = float(frozen)
        return {**out, **self.guard.metrics()}
