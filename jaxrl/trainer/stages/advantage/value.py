"""The critic's numerics: its token rewards, values, GAE and value loss, as functions of arrays.

The critic stage (:mod:`~jaxrl.trainer.stages.advantage.critic`) runs these; they are apart so
each can be read (and tested) without the stage's bookkeeping.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.losses import aggregate_loss, gae_advantages
from jaxrl.losses.gae import whiten_advantages
from jaxrl.losses.value import clipped_value_loss, explained_variance
from jaxrl.reward import ScoredBatch
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.update import accumulate


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
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
def critic_values(graphdef, params, input_ids, positions, segment_ids, *, replicate: bool):
    values = nnx.merge(graphdef, params).values(input_ids, positions, segment_ids)
    if replicate:  # every process reads the whole result, also when the rows are spread over processes
        values = jax.lax.with_sharding_constraint(values, PartitionSpec())
    return values


@functools.partial(jax.jit, static_argnums=(3, 4))
def gae(rewards, values, mask, gamma: float, lam: float):
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
