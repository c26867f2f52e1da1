"""The update stage: the optimizer, gradient accumulation and the sharded train step.

- :func:`build_optimizer`: AdamW after global-norm clipping, with a warm-up + cosine or
  constant learning-rate schedule;
- :func:`accumulate`: a loss summed over micro-batches (each rematerialised), so a step over
  N rows costs the activation memory of N / M rows and gives the one-big-batch gradient;
- :class:`TrainStep` (built by :func:`make_train_step` / :func:`build_train_step`): one jitted
  optimizer step over the device mesh, parameters and optimizer moments sharded by the
  models' logical axes, with non-finite updates skipped;
- :func:`abstract_train_state`: the state's shapes and shardings, to lower and measure a step
  without allocating it;
- :func:`rl_loss_fn`: the RL objective of one optimizer step over an ``UpdateBatch``;
- :func:`update_names`: the train step's metric names as the logs show them (``update/*``).

The RL and SFT trainers both update through this module; the models know nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.losses import ObjectiveConfig, entropy_control_selection, is_batch_mean, mismatch_metrics, rl_objective
from jaxrl.models.sharding import batch_shardings, state_shardings
from jaxrl.trainer.batch import UpdateBatch


def learning_rate_schedule(config, total_updates: int) -> optax.Schedule:
    """Linear warm-up from 0 over ``warmup_steps`` optimizer updates, then cosine decay to
    ``lr * min_lr_ratio`` at ``total_updates`` or a constant ``lr``."""
    warmup = config.warmup_steps
    if config.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=config.lr, warmup_steps=warmup,
            decay_steps=max(total_updates, warmup + 1), end_value=config.lr * config.min_lr_ratio,
        )
    if warmup == 0:
        return optax.constant_schedule(config.lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, config.lr, warmup), optax.constant_schedule(config.lr)], [warmup]
    )


def build_optimizer(config, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with the schedule above, after global-norm clipping when ``clip_norm > 0``."""
    schedule = learning_rate_schedule(config, total_updates)
    adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay)
    if config.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), adamw), schedule
    return adamw, schedule


def split_micro_batches(batch, micro_batches: int):
    """Leaves ``[N, ...]`` -> ``[M, N / M, ...]``, micro-batch ``m`` holding rows ``m, m + M, m + 2M, ...``.

    A strided split keeps every micro-batch spread over all data-parallel devices when the rows
    are sharded in contiguous blocks. 0-d leaves are shared: broadcast to ``[M]``.
    """
    def split(x):
        if x.ndim == 0:
            return jnp.broadcast_to(x, (micro_batches,))
        if x.shape[0] % micro_batches:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into {micro_batches} micro-batches")
        return jnp.swapaxes(x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def join_micro_batches(tree):
    """The inverse of :func:`split_micro_batches`: leaves ``[M, N / M, ...]`` -> ``[N, ...]`` in row order."""
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:]), tree)


def accumulate(micro_loss: Callable, micro_batches: int) -> Callable:
    """``loss_fn(model, batch)`` summing ``micro_loss`` over ``micro_batches`` micro-batches.

    ``batch`` leaves are ``[N, ...]`` (0-d leaves are shared by every micro-batch), split by
    :func:`split_micro_batches`. ``micro_loss(model, micro_batch, m) -> (loss, metrics)`` must
    already be normalised by the global batch (the loss library's ``normalizer``), so the sum
    equals the one-big-batch loss and its gradient the big batch's gradient. Each micro-batch's
    forward is rematerialised (``jax.checkpoint``) inside a ``lax.scan``, so the backward pass
    holds the activations of one micro-batch at a time: the memory of gradient accumulation for
    the price of one extra forward per micro-batch. Metrics are averaged over micro-batches.
    ``micro_batches == 1`` calls ``micro_loss`` directly.
    """
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")

    def loss_fn(model, batch):
        if micro_batches == 1:
            return micro_loss(model, batch, 0)
        graphdef, params = nnx.split(model)

        @jax.checkpoint
        def one(params, micro_batch, index):
            return micro_loss(nnx.merge(graphdef, params), micro_batch, index)

        def body(total, xs):
            micro_batch, index = xs
            loss, metrics = one(params, micro_batch, index)
            return total + loss, metrics

        xs = (split_micro_batches(batch, micro_batches), jnp.arange(micro_batches))
        total, metrics = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
        return total, jax.tree.map(lambda m: jnp.mean(m.astype(jnp.float32), axis=0), metrics)

    return loss_fn


@dataclasses.dataclass
class TrainStep:
    """A pjit training step over a mesh: `state, metrics = step(state, batch)`.

    `state` is `{"params": nnx.State, "opt_state": optax state, "step": int32}`; it is donated
    and comes back with the same shardings. A step whose loss, gradient norm or update norm
    is not finite leaves the state unchanged and reports `update/nonfinite = 1`;
    `update/relative_size` is |update| / |params| (both global L2 norms).
    `loss_fn(model, batch) -> (loss, metrics)` sees the model rebuilt from the params. Build with `make_train_step`.
    """

    graphdef: Any
    shardings: Any
    mesh: jax.sharding.Mesh
    optimizer: optax.GradientTransformation
    loss_fn: Callable
    _compiled: dict = dataclasses.field(default_factory=dict)

    def _step(self, state, batch):
        def loss_of(params):
            return self.loss_fn(nnx.merge(self.graphdef, params), batch)

        (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(state["params"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm, param_norm = optax.tree.norm(grads), optax.tree.norm(state["params"])
        update_norm = optax.tree.norm(updates)
        # A non-finite loss, gradient or update keeps the old parameters and optimizer state: one bad
        # batch must not turn the whole model into NaN. The caller sees `update/nonfinite` and decides.
        # A finite update norm bounds every entry by 1.8e19 (its square is finite), so finite
        # parameters stay finite without a pass over the new ones.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = {"params": keep(params, state["params"]), "opt_state": keep(opt_state, state["opt_state"]),
                     "step": state["step"] + finite.astype(state["step"].dtype)}
        metrics = dict(metrics, loss=loss, grad_norm=grad_norm, **{
            "update/nonfinite": 1.0 - finite.astype(jnp.float32),
            "update/relative_size": update_norm / jnp.maximum(param_norm, 1e-30)})
        return new_state, metrics

    def jitted(self, batch):
        """The jitted step for this batch's structure (shardings derived from its shapes)."""
        key = jax.tree.structure(batch), tuple(np.shape(x) for x in jax.tree.leaves(batch))
        if key not in self._compiled:
            replicated = NamedSharding(self.mesh, PartitionSpec())
            self._compiled[key] = jax.jit(
                self._step, in_shardings=(self.shardings, batch_shardings(batch, self.mesh)),
                out_shardings=(self.shardings, replicated), donate_argnums=(0,))
        return self._compiled[key]

    def __call__(self, state, batch):
        with jax.set_mesh(self.mesh):
            return self.jitted(batch)(state, batch)

    def lower(self, state, batch):
        """`jax.jit(...).lower` of the step, for compiled cost/memory analysis."""
        with jax.set_mesh(self.mesh):
            return self.jitted(batch).lower(state, batch)


def optimizer_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of `optimizer.init(params)`: every sub-tree shaped like the params (moments)
    is sharded like them; anything else (step counts, scalars) is replicated."""
    params_structure = jax.tree.structure(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(
        lambda node: param_shardings if jax.tree.structure(node) == params_structure else replicated,
        jax.eval_shape(optimizer.init, params),
        is_leaf=lambda node: jax.tree.structure(node) == params_structure)


def build_train_step(graphdef, params, optimizer: optax.GradientTransformation, loss_fn: Callable,
                     mesh: jax.sharding.Mesh) -> TrainStep:
    """The TrainStep for parameters `params` (real or abstract, e.g. from `nnx.eval_shape`):
    parameter shardings from their logical axes, optimizer state sharded like them."""
    param_shardings = state_shardings(params, mesh)
    with jax.set_mesh(mesh):
        opt_shardings = optimizer_shardings(optimizer, params, param_shardings, mesh)
    shardings = {"params": param_shardings, "opt_state": opt_shardings,
                 "step": NamedSharding(mesh, PartitionSpec())}
    return TrainStep(graphdef, shardings, mesh, optimizer, loss_fn)


def make_train_step(model: nnx.Module, optimizer: optax.GradientTransformation, loss_fn: Callable,
                    mesh: jax.sharding.Mesh):
    """Shard `model` on `mesh`, initialise the optimizer state sharded like the params.

    Returns (train_step, state). The state holds a sharded copy of the parameters (the caller's
    model stays valid); optimizer moments are sharded like the parameters (`optimizer_shardings`).
    """
    graphdef, params = nnx.split(model, nnx.Param)
    if len(jax.tree.leaves(nnx.split(model)[1])) != len(jax.tree.leaves(params)):
        raise ValueError("make_train_step expects a model whose only variables are nnx.Param")
    step = build_train_step(graphdef, params, optimizer, loss_fn, mesh)
    # A copy: the state is donated at every step and must not alias the caller's model buffers
    # (device_put may reuse a buffer even with may_alias=False when the mesh changes).
    params = jax.tree.map(jnp.copy, params)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, step.shardings["params"])
        opt_state = jax.jit(optimizer.init, out_shardings=step.shardings["opt_state"])(params)
    state = {"params": params, "opt_state": opt_state, "step": jax.device_put(np.int32(0), step.shardings["step"])}
    return step, state


def abstract_train_state(step: TrainStep, params) -> dict:
    """ShapeDtypeStructs (with shardings) of the state `step` takes, for `step.lower` without memory."""
    def spec(x, sharding):
        if isinstance(x, nnx.Variable):
            return x.replace(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def with_shardings(tree, shardings):
        return jax.tree.map(spec, tree, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))

    return {"params": with_shardings(params, step.shardings["params"]),
            "opt_state": with_shardings(jax.eval_shape(step.optimizer.init, params), step.shardings["opt_state"]),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=step.shardings["step"])}


def rl_loss_fn(objective: ObjectiveConfig, *, seed: int, micro_batches: int, chunk_size: int,
               router_z_loss: float = 0.0) -> Callable:
    """``loss_fn(model, batch: UpdateBatch) -> (loss, metrics)`` of one RL optimizer step:
    ``rl_objective`` summed over ``micro_batches`` micro-batches (:func:`accumulate`); for MoE
    models plus the load-balancing loss (``router_aux_loss_coef``) and ``router_z_loss`` x the
    router z-loss.

    The objective is normalised by the whole mini-batch's ``normalizer``; Clip-Cov draws with
    ``fold_in(key(seed), key_seed)``. Clip-Cov and KL-Cov choose tokens from statistics over
    the whole mini-batch (docs/losses.md#clip-cov-and-kl-cov), so with them and more than one micro-batch a no-gradient
    forward over every micro-batch first gives the mini-batch's logprobs, the tokens are chosen
    once from those, and each micro-batch gets its rows of the choice: the update does not
    depend on the split. That extra forward is paid only then; one micro-batch sees the whole
    mini-batch and chooses for itself.
    """
    def selection_key(batch: UpdateBatch):
        return jax.random.fold_in(jax.random.key(seed), batch.key_seed)

    def micro_loss(model, batch: UpdateBatch, _micro_index, mini_batch_is_mean=None):
        """The objective on one micro-batch (normalised by the mini-batch's global normalizer)."""
        tokens = batch.tokens
        logp, entropy, out = batch.token_logprobs(model, chunk_size)
        loss, metrics = rl_objective(
            objective, logp, tokens.old_logp, tokens.advantages, tokens.mask, rollout_logp=tokens.rollout_logp,
            ref_logp=tokens.ref_logp, entropy=entropy, normalizer=batch.normalizer, key=selection_key(batch),
            cov_selection=batch.cov_selection, is_batch_mean=mini_batch_is_mean,
        )
        if objective.bypass:
            # No recompute pass: on the first mini-batch the learner's logp *is* the recompute.
            metrics.update(mismatch_metrics(jax.lax.stop_gradient(logp), tokens.rollout_logp, tokens.mask))
        if model.config.moe_layer_indices:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss + router_z_loss * out.router_z_loss
            metrics = dict(metrics, moe_aux_loss=out.aux_loss, moe_z_loss=out.router_z_loss)
        return loss, metrics

    if objective.is_batch_normalize and micro_batches > 1:
        # The IS weights' mean is a statistic of the whole mini-batch (no parameters involved), so
        # every micro-batch divides by the same number and the split changes nothing.
        def normalized_micro_loss(model, batch: UpdateBatch):
            t = batch.tokens
            mean = is_batch_mean(objective, t.old_logp, t.rollout_logp, t.mask)
            return accumulate(functools.partial(micro_loss, mini_batch_is_mean=mean), micro_batches)(model, batch)

        accumulated = normalized_micro_loss
    else:
        accumulated = accumulate(micro_loss, micro_batches)
    if objective.entropy_control == "none" or micro_batches == 1:
        return accumulated

    def loss_fn(model, batch: UpdateBatch):
        graphdef, params = nnx.split(model)
        frozen = jax.lax.stop_gradient(params)  # the selection is a statistic: no gradient, no residuals

        def micro_logp(micro: UpdateBatch):
            return micro.token_logprobs(nnx.merge(graphdef, frozen), chunk_size)[0]

        logp = join_micro_batches(jax.lax.map(micro_logp, split_micro_batches(batch, micro_batches)))
        selection, selection_metrics = entropy_control_selection(
            objective, logp, batch.tokens.advantages, batch.tokens.mask, key=selection_key(batch))
        loss, metrics = accumulated(model, batch.replace(cov_selection=selection))
        return loss, {**metrics, **selection_metrics}

    return loss_fn


def update_names(metrics: dict[str, Any]) -> dict[str, float]:
    """The train step's and the loss's metric names -> the logged ``update/<name>``; the loss's
    mismatch measurement (under bypass) keeps its own ``mismatch/`` family."""
    out = {}
    for name, value in metrics.items():
        if name.startswith("mismatch_"):
            out[f"mismatch/{name.removeprefix('mismatch_')}"] = float(value)
        else:
            out[name if name.startswith("update/") else f"update/{name}"] = float(value)
    return out
