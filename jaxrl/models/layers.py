"""Building blocks of the decoder: RMSNorm, rotary embedding, GQA attention, SwiGLU, MoE.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names such as "embed",
"heads", "expert"); `jaxrl.models.sharding.LOGICAL_AXIS_RULES` maps those names to mesh axes.
Activations are annotated with `constrain(x, logical names)`. No mesh axis names appear here.

Numerics (SPEC section 5): norms, rotary tables, attention softmax, router logits/softmax and
every matmul accumulation are float32; the matmul inputs are in the config's compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.config import ModelConfig
from jaxrl.models.sharding import constrain

F32 = jnp.float32
INIT_STD = 0.02  # transformers' initializer_range for Qwen3


def make_param(rngs: nnx.Rngs, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], dtype,
               *, ones: bool = False) -> nnx.Param:
    """A parameter of `shape` annotated with one logical axis name per dimension."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"parameter shape {shape} and logical axes {logical_axes} differ in rank")
    value = (jnp.ones(shape, dtype) if ones
             else (INIT_STD * jax.random.normal(rngs.params(), shape, F32)).astype(dtype))
    return nnx.Param(value, logical_axes=tuple(logical_axes))


def matmul(x: jax.Array, w: jax.Array, dims: str, dtype) -> jax.Array:
    """einsum with inputs cast to the compute dtype and float32 accumulation/output."""
    return jnp.einsum(dims, x.astype(dtype), w.astype(dtype), preferred_element_type=F32)


class RMSNorm(nnx.Module):
    """`y = w * x / sqrt(mean(x^2) + eps)`, computed in float32; returns float32."""

    def __init__(self, size: int, eps: float, param_dtype, *, rngs: nnx.Rngs, logical_axis: str = "norm"):
        self.eps = eps
        self.weight = make_param(rngs, (size,), (logical_axis,), param_dtype, ones=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(F32)
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return self.weight[...].astype(F32) * (x * jax.lax.rsqrt(variance + self.eps))


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE as in transformers' Qwen3 (float32 tables, applied in float32).

    x: [B, T, H, Dh]; positions: [B, T] int. Returns float32 [B, T, H, Dh].
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.int32).astype(F32) / head_dim))
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x = x.astype(F32)
    half = head_dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class Attention(nnx.Module):
    """Softmax grouped-query attention with RoPE and per-head q/k RMSNorm (Qwen3).

    Keys are masked by `kv_slot <= q_slot` and equal segment ids, so the same code serves the
    full forward (slots = positions in the sequence) and decoding into a KV cache (slots =
    cache rows). Padding has segment id 0 and never attends to or is attended by real tokens.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.weight_dtype
        self.config = config
        self.q_proj = make_param(rngs, (c.hidden_size, c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), pd)
        self.k_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = make_param(rngs, (c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed"), pd)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, pd, rngs=rngs)

    def init_cache(self, batch: int, max_len: int) -> dict[str, jax.Array]:
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        return {"k": jnp.zeros(shape, c.compute_dtype), "v": jnp.zeros(shape, c.compute_dtype)}

    def __call__(self, x, *, positions, segment_ids, cache=None, kv_segment_ids=None, write_index=None):
        """x: [B, T, D]; positions, segment_ids: [B, T] int. With a cache, `kv_segment_ids` [B, S]
        are the cache's segment ids after this write and `write_index` [B] the first cache row
        written. Returns (y [B, T, D] float32, new cache or None)."""
        c, dtype = self.config, self.config.compute_dtype
        q = matmul(x, self.q_proj[...], "btd,dhk->bthk", dtype)
        k = matmul(x, self.k_proj[...], "btd,dhk->bthk", dtype)
        v = matmul(x, self.v_proj[...], "btd,dhk->bthk", dtype).astype(dtype)
        q = rotary(self.q_norm(q), positions, c.rope_theta).astype(dtype)
        k = rotary(self.k_norm(k), positions, c.rope_theta).astype(dtype)
        q = constrain(q, ("batch", "length", "act_heads", None))
        batch, length = segment_ids.shape
        q_slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if cache is None:
            kv_slot, kv_segment_ids = q_slot, segment_ids
        else:
            write = jax.vmap(lambda buf, new, i: jax.lax.dynamic_update_slice_in_dim(buf, new, i, axis=0))
            cache = {"k": write(cache["k"], k, write_index), "v": write(cache["v"], v, write_index)}
            k, v = cache["k"], cache["v"]
            q_slot = q_slot + write_index[:, None]
            kv_slot = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), kv_segment_ids.shape)
        mask = (kv_slot[:, None, :] <= q_slot[:, :, None]) & (kv_segment_ids[:, None, :] == segment_ids[:, :, None])
        groups = c.num_heads // c.num_kv_heads
        q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=F32) * (c.head_dim ** -0.5)
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(F32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=F32)
        out = out.reshape(batch, length, c.num_heads, c.head_dim)
        y = matmul(out, self.o_proj[...], "bthk,hkd->btd", dtype)
        return constrain(y, ("batch", "length", "act_embed")), cache


class MLP(nnx.Module):
    """SwiGLU: `down(silu(x @ gate) * (x @ up))`."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs: nnx.Rngs):
        pd, d = config.weight_dtype, config.hidden_size
        self.dtype = config.compute_dtype
        self.gate_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd)
        self.up_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd)
        self.down_proj = make_param(rngs, (intermediate_size, d), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = matmul(x, self.gate_proj[...], "...d,di->...i", self.dtype)
        up = matmul(x, self.up_proj[...], "...d,di->...i", self.dtype)
        hidden = constrain((jax.nn.silu(gate) * up).astype(self.dtype), ("batch", "length", "act_mlp"))
        return matmul(hidden, self.down_proj[...], "...i,id->...d", self.dtype)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE), optional shared expert (Qwen2-MoE style, ungated).

    Router logits and softmax in float32; `lax.top_k` breaks ties by the lower expert index;
    top-k weights renormalised when `norm_topk_prob`. The k assignments of every token are
    stably sorted by expert (ties by token, then slot), run through `jax.lax.ragged_dot`
    grouped matmuls, scaled by their weights, un-permuted and summed over the k slots in slot
    order: a fixed permutation and combine order, and no all-experts dense computation.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.weight_dtype
        self.config = config
        e, d, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.router = make_param(rngs, (d, e), ("embed", "expert_router"), pd)
        self.gate_proj = make_param(rngs, (e, d, i), ("expert", "embed", "expert_mlp"), pd)
        self.up_proj = make_param(rngs, (e, d, i), ("expert", "embed", "expert_mlp"), pd)
        self.down_proj = make_param(rngs, (e, i, d), ("expert", "expert_mlp", "embed"), pd)
        self.shared_expert = (MLP(c, c.shared_expert_intermediate_size, rngs=rngs)
                              if c.shared_expert_intermediate_size else None)

    def route(self, x_flat: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x_flat [N, D] -> (router probs [N, E] f32, top-k weights [N, k] f32, top-k experts [N, k] int32)."""
        logits = jnp.dot(x_flat.astype(F32), self.router[...].astype(F32), preferred_element_type=F32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.config.num_experts_per_tok)
        if self.config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights, experts.astype(jnp.int32)

    def __call__(self, x: jax.Array):
        """x: [B, T, D]. Returns (y [B, T, D] float32, probs [B, T, E] f32, experts [B, T, k] int32)."""
        c, dtype = self.config, self.config.compute_dtype
        batch, length, dim = x.shape
        k = c.num_experts_per_tok
        x_flat = x.reshape(batch * length, dim).astype(dtype)
        probs, weights, experts = self.route(x_flat)
        flat_experts = experts.reshape(-1)  # [N*k], assignment a belongs to token a // k
        order = jnp.argsort(flat_experts, stable=True)
        tokens_sorted = x_flat[order // k]
        group_sizes = jnp.bincount(flat_experts, length=c.num_experts).astype(jnp.int32)

        def grouped(lhs, rhs):
            return jax.lax.ragged_dot(lhs.astype(dtype), rhs.astype(dtype), group_sizes, preferred_element_type=F32)

        gate = grouped(tokens_sorted, self.gate_proj[...])
        up = grouped(tokens_sorted, self.up_proj[...])
        out_sorted = grouped((jax.nn.silu(gate) * up).astype(dtype), self.down_proj[...])
        out_sorted = out_sorted * weights.reshape(-1)[order][:, None]
        out = out_sorted[jnp.argsort(order)].reshape(batch * length, k, dim)
        y = out[:, 0]
        for slot in range(1, k):  # explicit left-to-right slot order
            y = y + out[:, slot]
        if self.shared_expert is not None:
            y = y + self.shared_expert(x_flat)
        y = constrain(y.reshape(batch, length, dim), ("batch", "length", "act_embed"))
        return y, probs.reshape(batch, length, -1), experts.reshape(batch, length, k)
