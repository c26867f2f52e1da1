"""The critic of PPO with GAE: its value model, its stages in the RL step, its own optimizer.

With ``advantage.estimator: gae`` the RL step (``jaxrl.trainer.rl``) gains three stages, all
here (docs/training.md#critic):

1. **score** (after the recompute): the critic's values of every column of the batch before
   any update, ``StepBatch.values`` (the "old values" of the clipped value loss);
2. **advantages** (instead of the sequence-level estimators): token rewards (the sample's
   score on its last generated token, or the reward function's ``token_rewards``), minus
   ``coef * k1`` per token with ``objective.kl_kind: k1-in-reward``; GAE over the generated
   tokens (``gae_advantages``: ``advantage.gamma``, ``advantage.lam``); the advantages
   whitened over the batch's masked tokens (verl's default for GAE); the returns are the
   critic's targets (``StepBatch.returns``);
3. **update**: one step of the critic's own AdamW on each of the policy's mini-batches (the
   same rows, the same micro-batch split), minimising the clipped value loss
   (``clipped_value_loss``, token-mean over the mini-batch's masked tokens).

During the first ``critic.warmup_steps`` RL steps only the critic updates; the policy's
parameters and optimizer state stay as they are (verl's ``critic_warmup``). A step the batch
filter skips (``objective.batch_filter_threshold``) skips the critic's update too: the filter
judged the batch untrustworthy, and a skipped step changes no learner state at all.

Metrics: ``critic/values_mean`` and ``critic/explained_variance`` (the values the batch was
scored with against its returns, verl's ``vf_explained_var``), ``critic/value_loss``,
``critic/vf_clip_frac``, ``critic/value_error``, ``critic/grad_norm``, ``critic/relative_size``,
``critic/nonfinite``, ``critic/nonfinite_skips``, ``critic/spike_warnings`` (its update guard's
counts, ``jaxrl.trainer.guard``), ``critic/lr``, ``critic/warmup``; ``advantage/raw_mean``,
``advantage/raw_std`` (before whitening), ``advantage/returns_mean``,
``advantage/token_reward_sum`` (mean per valid sample, after any KL penalty).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.losses import ObjectiveConfig, aggregate_loss, gae_advantages, kl_in_reward, loss_normalizer
from jaxrl.losses.gae import whiten_advantages
from jaxrl.losses.value import clipped_value_loss, explained_variance
from jaxrl.models import Decoder
from jaxrl.models.packing import pack_rows
from jaxrl.models.sharding import batch_devices, batch_shardings
from jaxrl.models.value import ValueModel
from jaxrl.reward import ScoredBatch
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.update import accumulate, build_optimizer, make_train_step

# The train step's metric names -> the logged critic/ names (the rest of the loss's are dropped).
_UPDATE_NAMES = {"loss": "critic/value_loss", "grad_norm": "critic/grad_norm", "vf_clip_frac": "critic/vf_clip_frac",
                 "value_error": "critic/value_error", "update/nonfinite": "critic/nonfinite",
                 "update/relative_size": "critic/relative_size"}


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((np.asarray(x, np.float64) * mask).sum() / max(float(mask.sum()), 1.0))


def token_rewards(batch: StepBatch, scored: ScoredBatch) -> np.ndarray:
    """[N, T] float32: each sample's reward on its generated target columns, the score on the
    last one, or ``scored.token_rewards[i][j]`` on its j-th generated token when the reward
    function gave them (ValueError naming the task and the sample when their number is not the
    sample's generated tokens); 0 off the loss's ``mask``."""
    generated = np.asarray(batch.generated)
    rewards = np.zeros(generated.shape, np.float32)
    for i, (score, per_token) in enumerate(zip(scored.scores, scored.token_rewards, strict=True)):
        columns = np.flatnonzero(generated[i])
        if per_token is None:
            if columns.size:
                rewards[i, columns[-1]] = score
            continue
        if len(per_token) != columns.size:
            raise ValueError(
                f"the reward function of task {scored.tasks[i]!r} returned {len(per_token)} token_rewards for "
                f"sample {i} of the batch, which has {columns.size} generated tokens; give one per response token")
        rewards[i, columns] = per_token
    return rewards * np.asarray(batch.mask, np.float32)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("replicate",))
def _values(graphdef, params, input_ids, positions, segment_ids, *, replicate: bool):
    values = nnx.merge(graphdef, params).values(input_ids, positions, segment_ids)
    if replicate:  # every process reads the whole result, also when the rows are spread over processes
        values = jax.lax.with_sharding_constraint(values, PartitionSpec())
    return values


@functools.partial(jax.jit, static_argnums=(3, 4))
def _gae(rewards, values, mask, gamma: float, lam: float):
    """(raw GAE advantages, returns, whitened advantages, explained variance of the values)."""
    raw, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    return raw, returns, whiten_advantages(raw, mask), explained_variance(returns, values, mask)


def value_loss_fn(value_clip: float | None, micro_batches: int):
    """``loss_fn(model: ValueModel, batch: UpdateBatch) -> (loss, metrics)``: the clipped value
    loss of one critic step, token-mean over the mini-batch (``batch.normalizer``), summed over
    ``micro_batches`` micro-batches (``accumulate``); a MoE trunk adds its balance loss."""

    def micro_loss(model, batch: UpdateBatch, _micro_index):
        t = batch.tokens
        if batch.packed is None:
            values, out = model.values_and_output(t.input_ids, t.positions, t.segment_ids)
        else:
            values, out = model.values_and_output(*batch.packed.model_inputs()[:3])
            values = batch.packed.unpack(values)
        token_loss, metrics = clipped_value_loss(values, t.values, t.returns, t.mask, clip=value_clip)
        loss = aggregate_loss(token_loss, t.mask, "token-mean", batch.normalizer)
        if model.config.moe_layer_indices:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
        return loss, metrics

    return accumulate(micro_loss, micro_batches)


class Critic:
    """The value model (initialised from the policy's initial ``decoder``, head at zero:
    ``jaxrl.models.value``) with its own AdamW state and TrainStep on the learner's ``mesh``,
    and the stages of the module docstring. ``state`` is what checkpoints save."""

    def __init__(self, config: TrainConfig, decoder: Decoder, mesh: jax.sharding.Mesh, warn: Callable[[str], None]):
        c, u = config.critic, config.update
        self.config, self.mesh = config, mesh
        # Its own update guard: a critic whose every update is skipped stops the run as the policy's would.
        self.guard = UpdateGuard(u.max_consecutive_skips, u.spike_factor, warn, prefix="critic")
        self.warmup_steps = c.warmup_steps
        optimizer, self.schedule = build_optimizer(c.optimizer(), config.steps * u.mini_batches)
        self.train_step, self.state = make_train_step(
            ValueModel.from_decoder(decoder), optimizer, value_loss_fn(c.value_clip, u.micro_batches), mesh)
        sequences = config.rollout.prompts_per_step * config.rollout.group_size
        self.rows = max(sequences // (u.mini_batches * u.micro_batches), 1)

    def policy_frozen(self, step: int) -> bool:
        """Whether RL step ``step`` (1-based) is a warm-up step: the critic trains, the policy does not."""
        return step <= self.warmup_steps

    # ------------------------------------------------------------ score
    def score(self, batch: StepBatch) -> tuple[StepBatch, dict[str, float]]:
        """``batch.values``: the critic's values [N, T] float32 before the update (0 off ``mask``),
        scored ``rows`` sequences at a time; ``critic/values_mean``."""
        u = self.config.update
        inputs = tuple(np.asarray(x, np.int32) for x in batch.model_inputs())
        chunks = []
        for start in range(0, batch.rows, self.rows):
            chunk = tuple(x[start:start + self.rows] for x in inputs)
            packed = pack_rows(*chunk, devices=batch_devices(self.mesh)) if u.pack else None
            rows = packed.model_inputs()[:3] if packed is not None else chunk[:3]
            with jax.set_mesh(self.mesh):
                rows = jax.device_put(rows, batch_shardings(rows, self.mesh))
                values = _values(self.train_step.graphdef, self.state["params"], *rows, replicate=True)
                if packed is not None:
                    values = packed.unpack(values)
            chunks.append(np.asarray(values, np.float32))
        mask = np.asarray(batch.mask, np.float32)
        values = np.concatenate(chunks) * mask
        return batch.replace(values=values), {"critic/values_mean": _masked_mean(values, mask)}

    # ------------------------------------------------------------ advantages
    def advantages(self, batch: StepBatch, scored: ScoredBatch, objective: ObjectiveConfig
                   ) -> tuple[StepBatch, dict[str, float]]:
        """Token-level GAE from ``batch.values``: ``advantages`` (whitened), ``returns`` and the
        task's ``token_rewards`` on the batch; the module docstring's ``advantage/`` metrics and
        ``critic/explained_variance``."""
        a = self.config.advantage
        mask = jnp.asarray(batch.mask, jnp.float32)
        rewards = token_rewards(batch, scored)
        shaped = jnp.asarray(rewards)
        if objective.kl_in_reward_coef > 0:
            shaped = kl_in_reward(shaped, jnp.asarray(batch.old_logp), jnp.asarray(batch.ref_logp), mask,
                                  coef=objective.kl_in_reward_coef)
        raw, returns, advantages, ev = _gae(shaped, jnp.asarray(batch.values, jnp.float32), mask, a.gamma, a.lam)
        m, raw = np.asarray(mask), np.asarray(raw)
        mean = _masked_mean(raw, m)
        valid = m.any(axis=1)
        metrics = {
            "advantage/raw_mean": mean,
            "advantage/raw_std": float(np.sqrt(_masked_mean(np.square(raw - mean), m))),
            "advantage/returns_mean": _masked_mean(np.asarray(returns), m),
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
        u = self.config.update
        out = {name: float(np.mean([m[key] for m in collected])) for key, name in _UPDATE_NAMES.items()
               if collected and key in collected[0]}
        out["critic/lr"] = float(self.schedule(max(step * u.mini_batches - 1, 0)))
        out["critic/warmup"] = float(frozen)
        return {**out, **self.guard.metrics()}
