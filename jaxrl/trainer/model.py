"""Pieces the RL and SFT loops share: model and optimizer construction, gradient accumulation,
batched logprob recomputation on the learner, and padding token sequences into arrays."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models import Decoder, create_sharded_model, load_hf_checkpoint
from jaxrl.models.sharding import batch_shardings


def build_model(policy, mesh: jax.sharding.Mesh) -> Decoder:
    """The learner's Decoder, sharded on ``mesh``: from ``policy.hf_path`` or a random init."""
    if policy.hf_path:
        return load_hf_checkpoint(policy.hf_path, mesh=mesh, **policy.overrides())
    config = policy.architecture.replace(**policy.overrides())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(policy.init_seed)), mesh)
    return model


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


class LogprobScorer:
    """Jitted learner recompute: token logprobs and entropy [N, T] of packed sequences, in chunks
    of ``rows`` sequences (bounding activation memory), with any parameter state of the model."""

    def __init__(self, graphdef, mesh: jax.sharding.Mesh, rows: int, chunk_size: int = 1024):
        self.graphdef, self.mesh, self.rows = graphdef, mesh, rows

        def score(params, input_ids, positions, segment_ids, targets):
            model = nnx.merge(graphdef, params)
            logp, entropy, _ = model.token_logprobs(input_ids, positions, segment_ids, targets,
                                                    chunk_size=chunk_size)
            return logp, entropy

        self._score = jax.jit(score, out_shardings=NamedSharding(mesh, PartitionSpec()))

    def __call__(self, params, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        names = ("input_ids", "positions", "segment_ids", "targets")
        n = batch["input_ids"].shape[0]
        rows = min(self.rows, n)
        logps, entropies = [], []
        with jax.set_mesh(self.mesh):
            for start in range(0, n, rows):
                chunk = {k: np.asarray(batch[k][start:start + rows]) for k in names}
                chunk = jax.device_put(chunk, batch_shardings(chunk, self.mesh))
                logp, entropy = self._score(params, *(chunk[k] for k in names))
                logps.append(np.asarray(logp))
                entropies.append(np.asarray(entropy))
        return np.concatenate(logps), np.concatenate(entropies)


def pack_sequences(
    prompts: Sequence[np.ndarray],
    completions: Sequence[np.ndarray],
    length: int,
    pad_id: int,
    completion_values: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Right-padded next-token arrays for sequences ``prompt + completion``.

    Returns ``input_ids, positions, segment_ids, targets`` int32 [N, length] and ``mask``
    float32 [N, length] (1 where the target is a completion token), plus ``values``
    float32 [N, length] holding ``completion_values[i][j]`` at completion token j's target
    position (e.g. the engine's logprobs), when given. A sequence longer than
    ``length + 1`` tokens is an error naming it.
    """
    n = len(prompts)
    arrays = {
        "input_ids": np.full((n, length), pad_id, np.int32),
        "targets": np.full((n, length), pad_id, np.int32),
        "segment_ids": np.zeros((n, length), np.int32),
        "positions": np.tile(np.arange(length, dtype=np.int32), (n, 1)),
        "mask": np.zeros((n, length), np.float32),
    }
    if completion_values is not None:
        arrays["values"] = np.zeros((n, length), np.float32)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(completion, np.int32)])
        if len(tokens) > length + 1:
            raise ValueError(
                f"sequence {i} has {len(tokens)} tokens (prompt {len(prompt)} + completion {len(completion)}) "
                f"but the packed length allows {length + 1}; raise the length or lower max_new_tokens"
            )
        m = len(tokens) - 1
        arrays["input_ids"][i, :m] = tokens[:-1]
        arrays["targets"][i, :m] = tokens[1:]
        arrays["segment_ids"][i, :m] = 1
        start = len(prompt) - 1
        arrays["mask"][i, start:m] = 1.0
        if completion_values is not None:
            arrays["values"][i, start:m] = np.asarray(completion_values[i], np.float32)
    return arrays
