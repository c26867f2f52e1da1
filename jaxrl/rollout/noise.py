"""The sampler's randomness, bit for bit as ``jax.random`` draws it, in one fused computation.

The embedded sampler draws every token by Gumbel-max with per-row keys
(``jaxrl.rollout.sampler``). ``jax.random`` hashes its counters with Threefry-2x32,
which XLA:CPU receives as a rolled loop of five iterations: in a decode step of a small
model that loop took about as long as the model's forward (measured 0.36 ms of a
0.75 ms step for 16 rows x 512 vocab, 2 layers of width 128). The hash is 20 rounds of
add, rotate and xor, so written out here it compiles to one elementwise fusion.

The streams are jax's own: :func:`fold_in` equals ``jax.random.fold_in`` and
:func:`gumbel` equals ``jax.random.gumbel`` (float32, ``mode="low"``) on raw
``uint32[2]`` keys, with ``jax_threefry_partitionable`` on (JAX's default); with it off
they defer to ``jax.random``. tests/rollout/test_noise.py checks the equality, so a JAX
release that changes its streams fails a test instead of changing samples silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

U32 = jnp.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
    return (x << U32(r)) | (x >> U32(32 - r))


def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 block function (Salmon et al., SC 2011; 20 rounds), unrolled.

    k1, k2: the key words; x1, x2: the counter words; all uint32, broadcast together.
    Returns the two output words.
    """
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x = [x1 + ks[0], x2 + ks[1]]
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ _rotate_left(x[1], r)
        x[0] = x[0] + ks[(block + 1) % 3]
        x[1] = x[1] + ks[(block + 2) % 3] + U32(block + 1)
    return x[0], x[1]


def _partitionable() -> bool:
    return bool(jax.config.jax_threefry_partitionable)


def fold_in(keys: jax.Array, data) -> jax.Array:
    """``jax.random.fold_in`` of each raw key: keys ``[..., 2]`` uint32, data a uint32 scalar."""
    if not _partitionable():
        return jnp.vectorize(lambda k: jax.random.fold_in(k, data), signature="(2)->(2)")(keys)
    y1, y2 = threefry2x32(keys[..., 0], keys[..., 1], jnp.zeros((), U32), jnp.asarray(data, U32))
    return jnp.stack([y1, y2], axis=-1)


def gumbel(keys: jax.Array, width: int) -> jax.Array:
    """Standard Gumbel noise ``[B, width]`` float32, row b as ``jax.random.gumbel(keys[b], (width,))``.

    keys: ``[B, 2]`` uint32 raw keys. The uniform in ``[tiny, 1)`` takes the top 23 bits of
    each 32-bit word as its mantissa (``mode="low"``: events rarer than about 1e-7 are not
    resolved, as with ``jax.random.categorical``'s default).
    """
    if not _partitionable():
        return jax.vmap(lambda k: jax.random.gumbel(k, (width,)))(keys)
    counters = jnp.arange(width, dtype=U32)[None, :]
    y1, y2 = threefry2x32(keys[:, :1], keys[:, 1:], jnp.zeros_like(counters), counters)
    bits = y1 ^ y2
    one = jnp.asarray(np.float32(1.0).view(np.uint32), U32)
    floats = jax.lax.bitcast_convert_type((bits >> U32(9)) | one, jnp.float32) - 1.0
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    uniform = jnp.maximum(tiny, floats * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(uniform))


__all__ = ["fold_in", "gumbel", "threefry2x32"]
