"""Building blocks of the decoder: RMSNorm, GQA attention, SwiGLU (rotary embedding: rope.py; the MoE layer: moe.py).

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names such as "embed",
"heads", "expert"); `jaxrl.models.sharding.LOGICAL_AXIS_RULES` maps those names to mesh axes.
Activations are annotated with `constrain(x, logical names)`. No mesh axis names appear here.

Numerics (docs/models.md#numerics-and-dtypes): norms, rotary tables, attention softmax, router logits/softmax and
every matmul accumulation are float32; the matmul inputs are in the config's compute dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import context_parallel, ring
from jaxrl.models.attention import attention
from jaxrl.models.config import ModelConfig
from jaxrl.models.rope import rotary
from jaxrl.models.sharding import constrain

F32 = jnp.float32
INIT_STD = 0.02  # transformers' initializer_range for Qwen3


def make_param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], dtype,
               *, ones: bool = False, compute_cast: bool = False) -> nnx.Param:
    """A parameter of `shape` annotated with one logical axis name per dimension. `compute_cast`: every
    use casts it to the compute dtype first (`matmul`, the experts' grouped matmul), so scanned layers
    may stack it in that dtype (`decoder.stack_blocks`): the same values forward and the same
    gradient, for half the stacked copy's memory when the parameters are float32."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"parameter shape {shape} and logical axes {logical_axes} differ in rank")
    value = (jnp.ones(shape, dtype) if ones
             else (INIT_STD * jax.random.normal(rngs.params(), shape, F32)).astype(dtype))
    return nnx.Param(value, logical_axes=tuple(logical_axes), compute_cast=compute_cast)


def matmul(x: jax.Array, w: jax.Array, dims: str, dtype) -> jax.Array:
    """einsum with inputs cast to the compute dtype and float32 accumulation/output.

    A projection (``x``'s leading dims kept, its trailing dims contracted with ``w``'s leading
    ones, ``w``'s trailing dims appended, e.g. ``"btd,dhk->bthk"``) runs as one 2-D matmul on
    flattened operands. The same sums; but XLA:CPU lays a 3-D einsum's backward out with a
    transposed copy of each activation gradient (measured: an MLP's forward and backward at
    752 tokens x 256 x 1024 took 23 ms as einsums, 10 ms as 2-D matmuls).
    """
    x, w = x.astype(dtype), w.astype(dtype)
    plan = _projection_plan(dims, x.ndim, w.ndim)
    if plan is None:
        return jnp.einsum(dims, x, w, preferred_element_type=F32)
    kept, contracted = plan
    rows, inner = x.shape[:x.ndim - contracted], x.shape[x.ndim - contracted:]
    out = jnp.dot(x.reshape(-1, math.prod(inner)), w.reshape(math.prod(inner), -1), preferred_element_type=F32)
    return out.reshape(*rows, *w.shape[contracted:])


@functools.lru_cache(maxsize=None)
def _projection_plan(dims: str, x_rank: int, w_rank: int) -> tuple[int, int] | None:
    """(kept dims of x, contracted dims) when ``dims`` is a projection as :func:`matmul` describes, else None."""
    inputs, out = dims.replace("...", "@").split("->")
    lhs, rhs = inputs.split(",")
    shared = [c for c in lhs if c in rhs]
    contracted = len(shared)
    if ("@" in rhs or not contracted or lhs[len(lhs) - contracted:] != "".join(shared)
            or rhs[:contracted] != "".join(shared) or out != lhs[:len(lhs) - contracted] + rhs[contracted:]):
        return None
    return x_rank - contracted, contracted


class RMSNorm(nnx.Module):
    """`y = w * x / sqrt(mean(x^2) + eps)`, computed in float32; returns float32.
    With `offset` (Qwen3-Next) the scale is `1 + w` and w starts at 0."""

    def __init__(self, size: int, eps: float, param_dtype, *, rngs: nnx.Rngs, logical_axis: str = "norm",
                 offset: bool = False):
        self.eps = eps
        self.offset = 1.0 if offset else 0.0
        self.weight = make_param(rngs, (size,), (logical_axis,), param_dtype, ones=True)
        if offset:
            self.weight[...] = jnp.zeros((size,), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(F32)
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return (self.offset + self.weight[...].astype(F32)) * (x * jax.lax.rsqrt(variance + self.eps))


def write_rows(buffer: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """`buffer [B, S, ...]` with `new [B, T, ...]` written at rows `index .. index + T - 1` along
    axis 1: one row per batch row (`index [B]`) or the same row for all (`index []`, a single
    dynamic-update-slice)."""
    if index.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(buffer, new.astype(buffer.dtype), index, axis=1)
    return jax.vmap(lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n, i, axis=0))(
        buffer, new.astype(buffer.dtype), index)


class Attention(nnx.Module):
    """Softmax grouped-query attention with RoPE and per-head q/k RMSNorm (Qwen3).

    Config switches give the hybrid families' softmax layers: `qk_norm=False` (MiniMax);
    `attention_output_gate` (Qwen3-Next: q_proj yields [query | gate] per head and the output is
    scaled by sigmoid(gate)), `partial_rotary_factor`, `norm_weight_offset` (Qwen3-Next).

    Keys are masked by `kv_slot <= q_slot` and equal segment ids, so the same code serves the
    full forward (slots = positions in the sequence) and decoding into a KV cache (slots =
    cache rows). Padding has segment id 0 and never attends to or is attended by real tokens.
    The softmax itself runs in `jaxrl.models.attention`, the implementation chosen by
    `config.attention_impl` (docs/models.md#attention-implementations). In the full forward under a mesh
    that shards the sequence it runs context parallel (`config.context_parallel`,
    docs/models.md#context-parallelism); decoding with a cache always runs it directly.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_index: int = 0):
        del layer_index  # the same at every depth
        c, pd = config, config.weight_dtype
        self.config = config
        q_width = 2 * c.head_dim if c.attention_output_gate else c.head_dim
        self.q_proj = make_param(rngs, (c.hidden_size, c.num_heads, q_width), ("embed", "heads", "head_dim"), pd,
                                 compute_cast=True)
        self.k_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd, compute_cast=True)
        self.v_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd, compute_cast=True)
        self.o_proj = make_param(rngs, (c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed"), pd,
                                 compute_cast=True)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs, offset=c.norm_weight_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs, offset=c.norm_weight_offset)
        self.rotary_dim = int(c.head_dim * c.partial_rotary_factor)

    def init_cache(self, batch: int, max_len: int) -> dict[str, jax.Array]:
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        return {"k": jnp.zeros(shape, c.compute_dtype), "v": jnp.zeros(shape, c.compute_dtype)}

    def __call__(self, x, *, positions, segment_ids, cache=None, kv_segment_ids=None, write_index=None):
        """x: [B, T, D]; positions, segment_ids: [B, T] int. With a cache, `kv_segment_ids` [B, S]
        are the cache's segment ids after this write and `write_index` [B] the first cache row
        written ([] when all rows share it). Returns (y [B, T, D] float32, new cache or None)."""
        c, dtype = self.config, self.config.compute_dtype
        q = matmul(x, self.q_proj[...], "btd,dhk->bthk", dtype)
        k = matmul(x, self.k_proj[...], "btd,dhk->bthk", dtype)
        v = matmul(x, self.v_proj[...], "btd,dhk->bthk", dtype).astype(dtype)
        if c.attention_output_gate:
            q, gate = jnp.split(q, 2, axis=-1)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rotary(q, positions, c.rope_theta, self.rotary_dim, c.rope_scaling).astype(dtype)
        k = rotary(k, positions, c.rope_theta, self.rotary_dim, c.rope_scaling).astype(dtype)
        q = constrain(q, ("batch", "length", "act_heads", None))
        batch, length = segment_ids.shape
        cp_plan = None if cache is not None else context_parallel.plan(c.context_parallel, batch, length)
        q_slot = jnp.broadcast_to(jnp.asarray(context_parallel.column_positions(cp_plan, length)), (batch, length))
        if cache is None:
            kv_slot, kv_segment_ids = q_slot, segment_ids
        else:
            cache = {"k": write_rows(cache["k"], k, write_index), "v": write_rows(cache["v"], v, write_index)}
            k, v = cache["k"], cache["v"]
            q_slot = q_slot + (write_index if write_index.ndim == 0 else write_index[:, None])
            kv_slot = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), kv_segment_ids.shape)
        groups = c.num_heads // c.num_kv_heads
        q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim)
        run = (attention if cp_plan is None
               else functools.partial(ring.ring_attention if cp_plan.ring else context_parallel.ulysses_attention,
                                      plan=cp_plan))
        out = run(q, k, v, q_slot, kv_slot, segment_ids, kv_segment_ids, impl=c.attention_impl,
                  scale=c.head_dim ** -0.5, dtype=dtype, block_size=c.attention_block_size,
                  **({} if cache is None else {"full_forward": False}))
        out = out.reshape(batch, length, c.num_heads, c.head_dim)
        if c.attention_output_gate:
            out = out * jax.nn.sigmoid(gate)
        y = matmul(out, self.o_proj[...], "bthk,hkd->btd", dtype)
        return constrain(y, ("batch", "length", "act_embed")), cache


class MLP(nnx.Module):
    """SwiGLU: `down(silu(x @ gate) * (x @ up))`."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs: nnx.Rngs):
        pd, d = config.weight_dtype, config.hidden_size
        self.dtype = config.compute_dtype
        self.gate_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd, compute_cast=True)
        self.up_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd, compute_cast=True)
        self.down_proj = make_param(rngs, (intermediate_size, d), ("mlp", "embed"), pd, compute_cast=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = matmul(x, self.gate_proj[...], "...d,di->...i", self.dtype)
        up = matmul(x, self.up_proj[...], "...d,di->...i", self.dtype)
        hidden = constrain((jax.nn.silu(gate) * up).astype(self.dtype), ("batch", "length", "act_mlp"))
        return matmul(hidden, self.down_proj[...], "...i,id->...d", self.dtype)
