"""Token-mixing layers of the hybrid linear-attention models (SPEC section 8), flax NNX.

- `LightningAttention`: MiniMax-Text-01's lightning-attention layer (`MiniMaxLightningAttention`
  in transformers): `q, k, v = silu(x W_qkv)` per head, per-head decay `lambda_h = exp(-slope_h)`
  with the ALiBi-style slopes scaled down with depth, output RMSNorm over all heads, sigmoid
  output gate from x, output projection.
- `GatedDeltaNet`: Qwen3-Next's gated DeltaNet layer (`Qwen3NextGatedDeltaNet`): fused q/k/v/z and
  b/a projections grouped by key head, depthwise causal short convolution + silu over q, k, v,
  `beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)`, L2-normalised q and k
  (q scaled by Dk^-1/2), gated delta rule, per-head RMSNorm gated by silu(z), output projection.
- `GatedAttention`: Qwen3-Next's gated softmax attention (`Qwen3NextAttention`): GQA with per-head
  q/k RMSNorm (weight stored as an offset from 1), partial RoPE, output gated by sigmoid of a
  second half of the q projection.

Every layer has `__call__(x, state)` for training and prefill (the chunked form; `state` None
starts from nothing) and `decode(x, state)` for one new token (the recurrent form), both
returning `(y, new_state)`; `init_state(batch)` builds an empty state. Linear-layer states are
float32. Kernels are stored `[in, out]` (the transpose of torch's `nn.Linear.weight`) with the
torch output layout, so checkpoints convert by a transpose. Every parameter carries logical axis
names: 'embed' (model width), 'heads' (flattened head-major projections, sharded over whole
heads), 'kv_heads', and None for small replicated vectors.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import linear_attention as kernels

_INIT_STD = 0.02


def _param(rngs: nnx.Rngs, shape, names, dtype, init=None) -> nnx.Param:
    init = init or jax.nn.initializers.normal(_INIT_STD)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names)


def _rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) in float32 (the FLA / transformers `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _check_decode_input(x: jax.Array, layer: str) -> None:
    if x.ndim != 3 or x.shape[1] != 1:
        raise ValueError(f"{layer}.decode takes one token, x of shape [batch, 1, hidden]; got {x.shape}.")


def lightning_log_decay(num_heads: int, layer_idx: int, num_layers: int) -> tuple[float, ...]:
    """MiniMax per-head log-decay `-slope_h`: slope_h = 2^(-8 (h+1) / H) * (1 - l / (L - 1 + 1e-5) + 1e-5)."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx={layer_idx} is outside 0..num_layers-1 (num_layers={num_layers}).")
    depth_factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    base = 1 / (2 ** (8 / num_heads))
    return tuple(-(base ** (h + 1)) * depth_factor for h in range(num_heads))


class LightningAttention(nnx.Module):
    """MiniMax lightning-attention token mixer; state `[B, H, head_dim, head_dim]` float32."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        layer_idx: int,
        num_layers: int,
        chunk_size: int = 64,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kernels._check_chunk_size(chunk_size)
        self.num_heads, self.head_dim, self.chunk_size, self.norm_eps = num_heads, head_dim, chunk_size, norm_eps
        self.log_decay = lightning_log_decay(num_heads, layer_idx, num_layers)
        width = num_heads * head_dim
        self.qkv_proj = _param(rngs, (hidden_size, 3 * width), ("embed", "heads"), dtype)
        self.output_gate = _param(rngs, (hidden_size, width), ("embed", "heads"), dtype)
        self.out_proj = _param(rngs, (width, hidden_size), ("heads", "embed"), dtype)
        self.norm = _param(rngs, (width,), ("heads",), dtype, jax.nn.initializers.ones)

    def init_state(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), kernels.STATE_DTYPE)

    def _qkv(self, x):
        qkv = jax.nn.silu(x @ self.qkv_proj[...])
        qkv = qkv.reshape(x.shape[:2] + (self.num_heads, 3 * self.head_dim))
        return jnp.split(qkv, 3, axis=-1)

    def _output(self, x, mixed):
        mixed = mixed.reshape(x.shape[:2] + (-1,))
        normed = (self.norm[...] * _rms_normalize(mixed, self.norm_eps).astype(x.dtype))
        return (jax.nn.sigmoid(x @ self.output_gate[...]) * normed) @ self.out_proj[...]

    def __call__(self, x: jax.Array, state: jax.Array | None = None):
        """Chunked form. x `[B, T, hidden]` -> (y `[B, T, hidden]`, state)."""
        q, k, v = self._qkv(x)
        mixed, state = kernels.lightning_attention(
            q, k, v, jnp.asarray(self.log_decay), chunk_size=self.chunk_size, initial_state=state
        )
        return self._output(x, mixed), state

    def decode(self, x: jax.Array, state: jax.Array):
        """Recurrent form for one token. x `[B, 1, hidden]` -> (y `[B, 1, hidden]`, state)."""
        _check_decode_input(x, "LightningAttention")
        q, k, v = (t[:, 0] for t in self._qkv(x))
        mixed, state = kernels.lightning_attention_step(q, k, v, jnp.asarray(self.log_decay), state)
        return self._output(x, mixed[:, None]), state


class DeltaNetState(NamedTuple):
    """Decode state of a GatedDeltaNet layer."""

    conv: jax.Array  # [B, conv_kernel_size - 1, conv_dim]: the last inputs of the short convolution
    recurrent: jax.Array  # [B, value_heads, key_head_dim, value_head_dim] float32


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next gated DeltaNet token mixer (short conv + gated delta rule + gated RMSNorm)."""

    def __init__(
        self,
        hidden_size: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        *,
        conv_kernel_size: int = 4,
        chunk_size: int = 64,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kernels._check_chunk_size(chunk_size)
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"num_value_heads={num_value_heads} must be a multiple of num_key_heads={num_key_heads}."
            )
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.conv_kernel_size, self.chunk_size, self.norm_eps = conv_kernel_size, chunk_size, norm_eps
        self.group = num_value_heads // num_key_heads
        key_width, value_width = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.conv_dim = 2 * key_width + value_width
        self.in_proj_qkvz = _param(rngs, (hidden_size, 2 * key_width + 2 * value_width), ("embed", "heads"), dtype)
        self.in_proj_ba = _param(rngs, (hidden_size, 2 * num_value_heads), ("embed", "heads"), dtype)
        self.conv1d = _param(
            rngs, (conv_kernel_size, self.conv_dim), (None, None), dtype,
            jax.nn.initializers.uniform(1 / math.sqrt(conv_kernel_size)),
        )
        self.dt_bias = _param(rngs, (num_value_heads,), ("heads",), dtype, jax.nn.initializers.ones)
        self.A_log = _param(
            rngs, (num_value_heads,), ("heads",), dtype,
            lambda key, shape, dt: jnp.log(jax.random.uniform(key, shape, dt, 1.0, 16.0)),
        )
        self.norm = _param(rngs, (value_head_dim,), (None,), dtype, jax.nn.initializers.ones)
        self.out_proj = _param(rngs, (value_width, hidden_size), ("heads", "embed"), dtype)

    def init_state(self, batch: int, dtype=jnp.float32) -> DeltaNetState:
        return DeltaNetState(
            jnp.zeros((batch, self.conv_kernel_size - 1, self.conv_dim), dtype),
            jnp.zeros((batch, self.num_value_heads, self.key_head_dim, self.value_head_dim), kernels.STATE_DTYPE),
        )

    def _mix(self, x: jax.Array, state: DeltaNetState | None, recurrent: bool):
        batch, length, _ = x.shape
        state = self.init_state(batch, x.dtype) if state is None else state
        kernels.check_state(state.conv, (batch, self.conv_kernel_size - 1, self.conv_dim), "state.conv")
        hk, hv, dk, dv, group = self.num_key_heads, self.num_value_heads, self.key_head_dim, self.value_head_dim, self.group
        qkvz = (x @ self.in_proj_qkvz[...]).reshape(batch, length, hk, 2 * dk + 2 * group * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + group * dv], axis=-1)
        b, a = jnp.split((x @ self.in_proj_ba[...]).reshape(batch, length, hk, 2 * group), 2, axis=-1)
        mixed = jnp.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)

        # Depthwise causal convolution over [previous inputs, new inputs]; the tail is the next state.
        history = jnp.concatenate([state.conv.astype(mixed.dtype), mixed], axis=1)
        kernel = self.conv1d[...]
        mixed = jax.nn.silu(sum(kernel[j] * history[:, j : j + length] for j in range(self.conv_kernel_size)))
        conv_state = history[:, history.shape[1] - (self.conv_kernel_size - 1) :]

        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
        q, k = (jnp.repeat(t.reshape(batch, length, hk, dk), group, axis=2) for t in (q, k))
        v = v.reshape(batch, length, hv, dv)
        beta = jax.nn.sigmoid(b.reshape(batch, length, hv).astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.reshape(batch, length, hv).astype(jnp.float32) + self.dt_bias[...]
        )
        q = _l2_normalize(q) * dk**-0.5
        k = _l2_normalize(k)
        v = v.astype(jnp.float32)
        if recurrent:
            core, rec = kernels.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent)
            core = core[:, None]
        else:
            core, rec = kernels.gated_delta_rule(
                q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state.recurrent
            )
        gate = jax.nn.silu(z.reshape(batch, length, hv, dv).astype(jnp.float32))
        normed = (self.norm[...] * _rms_normalize(core, self.norm_eps).astype(x.dtype)) * gate
        return normed.astype(x.dtype).reshape(batch, length, -1) @ self.out_proj[...], DeltaNetState(conv_state, rec)

    def __call__(self, x: jax.Array, state: DeltaNetState | None = None):
        """Chunked form. x `[B, T, hidden]` -> (y `[B, T, hidden]`, DeltaNetState)."""
        return self._mix(x, state, recurrent=False)

    def decode(self, x: jax.Array, state: DeltaNetState):
        """Recurrent form for one token. x `[B, 1, hidden]` -> (y `[B, 1, hidden]`, DeltaNetState)."""
        _check_decode_input(x, "GatedDeltaNet")
        return self._mix(x, state, recurrent=True)


class KVCache(NamedTuple):
    """Decode state of a softmax attention layer: keys/values written so far."""

    k: jax.Array  # [B, max_len, kv_heads, head_dim]
    v: jax.Array  # [B, max_len, kv_heads, head_dim]
    length: jax.Array  # int32 scalar: positions filled


def partial_rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate the first `rotary_dim` features of x `[B, T, H, D]` by positions `[B, T]` (rotate-half RoPE)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = jnp.split(rot, 2, axis=-1)
    rotated = rot * cos + jnp.concatenate([-second, first], axis=-1) * sin
    return jnp.concatenate([rotated, rest], axis=-1)


class GatedAttention(nnx.Module):
    """Qwen3-Next gated softmax attention (GQA, q/k RMSNorm with 1+w weights, partial RoPE, sigmoid gate)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float = 10000.0,
        partial_rotary_factor: float = 0.25,
        norm_eps: float = 1e-6,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}.")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.rope_theta, self.norm_eps = rope_theta, norm_eps
        self.q_proj = _param(rngs, (hidden_size, 2 * num_heads * head_dim), ("embed", "heads"), dtype)
        self.k_proj = _param(rngs, (hidden_size, num_kv_heads * head_dim), ("embed", "kv_heads"), dtype)
        self.v_proj = _param(rngs, (hidden_size, num_kv_heads * head_dim), ("embed", "kv_heads"), dtype)
        self.o_proj = _param(rngs, (num_heads * head_dim, hidden_size), ("heads", "embed"), dtype)
        self.q_norm = _param(rngs, (head_dim,), (None,), dtype, jax.nn.initializers.zeros)
        self.k_norm = _param(rngs, (head_dim,), (None,), dtype, jax.nn.initializers.zeros)

    def init_state(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        shape = (batch, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def _offset_norm(self, x, weight):
        return (_rms_normalize(x, self.norm_eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)

    def __call__(self, x: jax.Array, state: KVCache | None = None):
        """x `[B, T, hidden]`; attends causally to `state` (if given) then to x; -> (y, KVCache or None)."""
        batch, length, _ = x.shape
        query, gate = jnp.split(
            (x @ self.q_proj[...]).reshape(batch, length, self.num_heads, 2 * self.head_dim), 2, axis=-1
        )
        key = (x @ self.k_proj[...]).reshape(batch, length, self.num_kv_heads, self.head_dim)
        value = (x @ self.v_proj[...]).reshape(batch, length, self.num_kv_heads, self.head_dim)
        start = jnp.zeros((), jnp.int32) if state is None else state.length
        positions = jnp.broadcast_to(start + jnp.arange(length), (batch, length))
        query = partial_rope(self._offset_norm(query, self.q_norm[...]), positions, self.rotary_dim, self.rope_theta)
        key = partial_rope(self._offset_norm(key, self.k_norm[...]), positions, self.rotary_dim, self.rope_theta)
        if state is not None:
            kernels.check_state(state.k, (batch, state.k.shape[1], self.num_kv_heads, self.head_dim), "state.k")
            state = KVCache(
                jax.lax.dynamic_update_slice_in_dim(state.k, key.astype(state.k.dtype), start, axis=1),
                jax.lax.dynamic_update_slice_in_dim(state.v, value.astype(state.v.dtype), start, axis=1),
                start + length,
            )
            key, value = state.k, state.v
        key_positions = jnp.arange(key.shape[1])
        visible = key_positions[None, :] <= (start + jnp.arange(length))[:, None]  # [T, S] causal
        groups = self.num_heads // self.num_kv_heads
        query = query.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", query, key).astype(jnp.float32) * self.head_dim**-0.5
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(value.dtype)
        attended = jnp.einsum("bkgts,bskd->btkgd", probs, value).reshape(batch, length, -1)
        return (attended * jax.nn.sigmoid(gate.reshape(batch, length, -1))) @ self.o_proj[...], state

    def decode(self, x: jax.Array, state: KVCache):
        """One token against the cache. x `[B, 1, hidden]` -> (y `[B, 1, hidden]`, KVCache)."""
        _check_decode_input(x, "GatedAttention")
        return self(x, state)
