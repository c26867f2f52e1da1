"""Loss aggregation: how token losses become one scalar, the same for every micro-batch split
(docs/losses.md#loss-aggregation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.losses import _validate

Array = jax.Array

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_normalizer(mode: str, mask: Array, *, max_length: int | None = None) -> Array:
    """The divisor of :func:`aggregate_loss` for ``mode``, computed on the GLOBAL batch mask
    (docs/losses.md#loss-aggregation).

    * "token-mean": number of masked tokens;
    * "seq-mean-token-sum", "seq-mean-token-mean": number of sequences with at
      least one masked token;
    * "seq-mean-token-sum-norm" (Dr.GRPO): that sequence count times the
      constant ``max_length`` (default ``T``, the padded length).

    Args: mask ``[B, T]`` of the whole batch (all micro-batches together).
    Returns: float32 scalar, at least 1.

    Example (3 masked tokens in 2 sequences, ``T = 2``):
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import loss_normalizer
      >>> mask = jnp.array([[1, 1], [1, 0]])
      >>> [float(loss_normalizer(m, mask)) for m in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")]
      [3.0, 2.0, 4.0]
    """
    _validate.check_choice("mode", mode, AGGREGATION_MODES)
    _validate.check_mask("mask", mask)
    _validate.check_rank("mask", mask, 2)
    live = jnp.asarray(mask, jnp.float32)
    if mode == "token-mean":
        count = jnp.sum(live)
    else:
        count = jnp.sum(jnp.any(live > 0, axis=-1)).astype(jnp.float32)
        if mode == "seq-mean-token-sum-norm":
            length = jnp.shape(mask)[1] if max_length is None else max_length
            _validate.check_positive("max_length", length)
            count = count * length
    return jnp.maximum(count, 1.0)


def aggregate_loss(token_loss: Array, mask: Array, mode: str, normalizer: Array | float) -> Array:
    """Reduces a ``[B, T]`` token loss to a scalar: ``sum_{b,t} m l / N`` or, for "seq-mean-token-mean",
    ``sum_b (sum_t m l / sum_t m) / N`` (docs/losses.md#loss-aggregation).

    ``normalizer`` ``N`` comes from :func:`loss_normalizer` on the global batch,
    so the sum of this over micro-batches equals the full-batch value (and
    gradient) for every split.

    Args: token_loss float ``[B, T]``; mask ``[B, T]``; mode in
      ``AGGREGATION_MODES``; normalizer a positive scalar.
    Returns: float32 scalar.

    Example: token-mean ``(1 + 3 + 4) / 3``; seq-mean-token-mean ``((1 + 3) / 2 + 4 / 1) / 2``:
      >>> import jax.numpy as jnp
      >>> from jaxrl.losses import aggregate_loss
      >>> loss, mask = jnp.array([[1.0, 3.0], [4.0, 9.0]]), jnp.array([[1, 1], [1, 0]])
      >>> round(float(aggregate_loss(loss, mask, "token-mean", 3.0)), 4)
      2.6667
      >>> round(float(aggregate_loss(loss, mask, "seq-mean-token-mean", 2.0)), 4)
      3.0
    """
    _validate.check_choice("mode", mode, AGGREGATION_MODES)
    _validate.check_floating("token_loss", token_loss)
    _validate.check_mask("mask", mask)
    _validate.check_rank("token_loss", token_loss, 2)
    _validate.check_same_shape(token_loss=token_loss, mask=mask)
    _validate.check_rank("normalizer", normalizer, 0)
    live = jnp.asarray(mask).astype(bool)
    values = jnp.where(live, jnp.asarray(token_loss, jnp.float32), 0.0)
    if mode == "seq-mean-token-mean":
        counts = jnp.sum(live, axis=-1).astype(jnp.float32)
        total = jnp.sum(jnp.sum(values, axis=-1) / jnp.maximum(counts, 1.0))
    else:
        total = jnp.sum(values)
    return total / jnp.asarray(normalizer, jnp.float32)
