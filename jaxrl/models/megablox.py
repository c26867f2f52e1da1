"""The grouped expert matmul on TPUs: the Pallas megablox `gmm` kernel shipped with JAX.

See docs/models.md#mixture-of-experts.

`gmm` walks only the row tiles that hold some expert's rows (a tile shared by two experts runs
once per expert, masked), so its cost follows the assignments, not E times the rows; its
`custom_vjp` runs `gmm` on the transposed weights for the input gradient and `tgmm` (one
[K, N] product per expert) for the weight gradient.

The kernel needs the row count to be a multiple of its row tile (rows are zero-padded), and it never writes rows past
`sum(group_sizes)` (here: padding, and in expert parallelism the assignments to other devices'
experts). Those rows are zeroed on the way in and on the way out: the output's unwritten rows
are garbage, and so are the input gradient's, which the input mask stops.

A Mosaic kernel cannot be partitioned automatically; `MoE` calls this inside `jax.shard_map`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TILE = 128  # the kernel's row, K and N tiles: the TPU's 128-lane width


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret: bool = False) -> jax.Array:
    """lhs [rows, K] sorted by group, rhs [E, K, N], group_sizes [E] int32 -> [rows, N] float32; rows past
    `sum(group_sizes)` give zeros. `interpret` runs the kernel in the Pallas interpreter (any backend; tests)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    (rows, inner), outer = lhs.shape, rhs.shape[2]

    def up(n):
        return -(-n // TILE) * TILE
    valid = (jnp.arange(rows) < jnp.sum(group_sizes))[:, None]
    lhs = jnp.pad(jnp.where(valid, lhs, jnp.zeros_like(lhs)), ((0, up(rows) - rows), (0, up(inner) - inner)))
    # The backward reuses the tiling with K and N swapped, and TPU blocks must be multiples of
    # 128 lanes: K and N are zero-padded to 128 multiples (a no-op at real model widths).
    rhs = jnp.pad(rhs, ((0, 0), (0, up(inner) - inner), (0, up(outer) - outer)))
    out = gmm(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32,
              tiling=(TILE, TILE, TILE), interpret=interpret)
    return jnp.where(valid, out[:rows, :outer], 0.0)
