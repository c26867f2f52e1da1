"""Linear-attention token mixers of the hybrid models (docs/models.md#linear-attention), flax NNX.

Both are attention kinds of `jaxrl.models.decoder.ATTENTION_KINDS` ("lightning_attention",
"gated_deltanet"): built as `cls(config, rngs=, layer_index=)`, called as
`attn(x, positions=, segment_ids=, cache=, kv_segment_ids=, write_index=) -> (y, cache)`, with a
fixed-size float32 recurrent state as their decode cache (`init_cache`; `max_len` is unused).
Without a cache the chunked form runs from a zero state and returns no cache; with one, a
prompt of T > 1 tokens runs the chunked form from the cached state and a single token runs the
recurrent form, each returning the new state. Positions and cache rows are not needed: the
state carries the past. Padding (segment id 0) is zeroed at the input, as transformers does.

Packed rows (full forward): a row may hold several segments (ids 1, 2, ...; 0 = padding), and each
gets exactly the outputs it gets alone. Padding is no segment: a token belongs to the last nonzero
segment id at or before it (`carried_segments`): padding continues the segment before it, so a row
holding one sequence, padded anywhere, has no reset and computes the numbers of the cached path. A token
whose carried segment differs from the previous token's starts a new segment: the recurrent state
carried into it is dropped (decay 0, `reset` of the kernels), and GatedDeltaNet's short convolution
reads no token of another segment (its window is masked by carried segment). With a cache (the
sampler's layout) rows hold one sequence each and nothing resets, since a prompt piece cannot tell
padding inside a sequence from a segment start.

- `LightningAttention`: MiniMax-Text-01's layer (`MiniMaxLightningAttention`):
  `q, k, v = silu(x W_qkv)` per head, per-head decay `lambda_h = exp(-slope_h)` with ALiBi-style
  slopes scaled down with depth, RMSNorm over all heads, sigmoid output gate from x, projection.
- `GatedDeltaNet`: Qwen3-Next's layer (`Qwen3NextGatedDeltaNet`): fused q/k/v/z and b/a
  projections grouped by key head, depthwise causal short convolution + silu over q, k, v,
  `beta = sigmoid(b)`, `g = -exp(A_log) softplus(a + dt_bias)`, L2-normalised q and k (q scaled by
  Dk^-1/2), gated delta rule, per-head RMSNorm gated by silu(z), projection.

Context parallelism (docs/models.md#context-parallelism): in the full forward under a mesh that shards
the sequence (`config.context_parallel`), the per-head part of each layer (lightning: the kernel;
GatedDeltaNet: short convolution, gates, normalisation and the delta rule) runs on whole sequences for
a share of the heads (`context_parallel.ulysses`), its segment resets computed from the gathered
segment ids; the projections, norms and gates outside run on the sequence shards.

Projection weights are `[in, out]` (torch's `nn.Linear.weight` transposed, same output layout),
so checkpoints convert by a transpose (`jaxrl.models.hf.LINEAR_LAYER_TENSORS`). Logical axes: 'embed'
(model width), 'heads' (flattened head-major outputs: whole heads per shard when the tensor axis
divides the head count; any split is still correct, the partitioner reshards), 'norm', None.
The lightning chunked form holds every chunk's end state at once ([B, H, T / chunk, Dk, Dv]
float32, from its associative scan): pick `linear_chunk_size` with that in mind at long T.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import context_parallel
from jaxrl.models import linear_attention as kernels
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import INIT_STD, matmul

LIGHTNING_NORM_EPS = 1e-6  # MiniMaxLightningAttention's RMSNorm keeps its default eps, not rms_norm_eps


def _param(rngs: nnx.Rngs, shape, logical_axes, dtype, init=None) -> nnx.Param:
    init = init or jax.nn.initializers.normal(INIT_STD)
    return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(dtype), logical_axes=tuple(logical_axes))


def _rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) in float32 (the FLA / transformers `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def _mask_padding(x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    return x if segment_ids is None else x * (segment_ids != 0)[..., None].astype(x.dtype)


def carried_segments(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`segment_ids [B, T]` -> (carried `[B, T]`, reset `[B, T]` bool): carried_t is the last nonzero
    segment id at or before t (0 before the first), reset_t that carried_t differs from carried_{t-1}
    (never at t = 0: the state before the row is the layer's own)."""
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1]), segment_ids.shape)
    last_real = jax.lax.cummax(jnp.where(segment_ids != 0, index, -1), axis=1)
    carried = jnp.where(last_real >= 0, jnp.take_along_axis(segment_ids, jnp.maximum(last_real, 0), axis=1), 0)
    return carried, jnp.pad(carried[:, 1:] != carried[:, :-1], [(0, 0), (1, 0)])


def _segments(segment_ids, cache) -> tuple[jax.Array | None, jax.Array | None]:
    """(carried, reset) for the full forward of a row that may be packed; (None, None) with a cache or
    without segment ids (one sequence per row)."""
    return (None, None) if cache is not None or segment_ids is None else carried_segments(segment_ids)


def lightning_log_decay(num_heads: int, layer_idx: int, num_layers: int) -> tuple[float, ...]:
    """MiniMax per-head log-decay `-slope_h`: slope_h = 2^(-8 (h+1) / H) * (1 - l / (L - 1 + 1e-5) + 1e-5)."""
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx={layer_idx} is outside 0..num_layers-1 (num_layers={num_layers}).")
    depth_factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    base = 1 / (2 ** (8 / num_heads))
    return tuple(-(base ** (h + 1)) * depth_factor for h in range(num_heads))


class LightningAttention(nnx.Module):
    """MiniMax lightning-attention token mixer (config.num_heads x config.head_dim); state
    `[B, H, head_dim, head_dim]` float32."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_index: int):
        c, pd = config, config.weight_dtype
        self.num_heads, self.head_dim, self.chunk_size = c.num_heads, c.head_dim, c.linear_chunk_size
        self.dtype, self.context_parallel = c.compute_dtype, c.context_parallel
        self.log_decay = lightning_log_decay(c.num_heads, layer_index, c.num_layers)
        width = c.num_heads * c.head_dim
        self.qkv_proj = _param(rngs, (c.hidden_size, 3 * width), ("embed", "heads"), pd)
        self.output_gate = _param(rngs, (c.hidden_size, width), ("embed", "heads"), pd)
        self.out_proj = _param(rngs, (width, c.hidden_size), ("heads", "embed"), pd)
        self.norm = _param(rngs, (width,), ("heads",), pd, jax.nn.initializers.ones)

    def init_cache(self, batch: int, max_len: int = 0) -> jax.Array:
        return jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), kernels.STATE_DTYPE)

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None, kv_segment_ids=None, write_index=None):
        """x `[B, T, hidden]` -> (y `[B, T, hidden]` float32, state or None)."""
        batch, length, _ = x.shape
        cp_plan = None if cache is not None else context_parallel.plan(self.context_parallel, batch, length)
        x = _mask_padding(x, segment_ids)
        qkv = jax.nn.silu(matmul(x, self.qkv_proj[...], "btd,de->bte", self.dtype))
        q, k, v = jnp.split(qkv.reshape(batch, length, self.num_heads, 3 * self.head_dim), 3, axis=-1)
        log_decay = jnp.asarray(self.log_decay, jnp.float32)
        if cache is not None and length == 1:
            mixed, state = kernels.lightning_attention_step(q[:, 0], k[:, 0], v[:, 0], log_decay, cache)
            mixed = mixed[:, None]
        elif cp_plan is not None:
            mixed, state = self._context_parallel(q, k, v, log_decay, segment_ids, cp_plan), None
        else:
            mixed, state = kernels.lightning_attention(q, k, v, log_decay, chunk_size=self.chunk_size,
                                                       initial_state=cache, reset=_segments(segment_ids, cache)[1])
        normed = self.norm[...].astype(jnp.float32) * _rms_normalize(mixed.reshape(batch, length, -1),
                                                                     LIGHTNING_NORM_EPS)
        gated = jax.nn.sigmoid(matmul(x, self.output_gate[...], "btd,de->bte", self.dtype)) * normed
        return matmul(gated, self.out_proj[...], "bte,ed->btd", self.dtype), (None if cache is None else state)

    def _context_parallel(self, q, k, v, log_decay, segment_ids, plan) -> jax.Array:
        """The chunked kernel from a zero state on whole sequences, heads split over the devices
        (`context_parallel.ulysses`). -> `[B, T, H, D]`."""

        def local(tokens, rows, head_values):
            reset = carried_segments(rows[0])[1]
            return (kernels.lightning_attention(*tokens, head_values[0], chunk_size=self.chunk_size, reset=reset)[0],)

        return context_parallel.ulysses(local, (q, k, v), (_segment_ids_or_ones(segment_ids, q),), (log_decay,),
                                        plan=plan)[0]


def _segment_ids_or_ones(segment_ids, like):
    return jnp.ones(like.shape[:2], jnp.int32) if segment_ids is None else segment_ids


def _short_conv(history: jax.Array, kernel: jax.Array, carried: jax.Array | None) -> jax.Array:
    """silu of the depthwise causal convolution `y_t = sum_j kernel_j x_{t-K+1+j}` over `history [B, K-1+T,
    C]` (K-1 earlier inputs, then the T new ones), `kernel [K, C]`. With `carried [B, T]` (packed
    rows) a tap whose token lies in another carried segment reads 0, as before a sequence's start
    (the K-1 earlier slots, zeros in the full forward, are masked too)."""
    width, length = kernel.shape[0], history.shape[1] - kernel.shape[0] + 1
    taps = [history[:, j : j + length] for j in range(width)]
    if carried is not None:
        source = jnp.pad(carried, [(0, 0), (width - 1, 0)], constant_values=-1)
        taps = [jnp.where((source[:, j : j + length] == carried)[..., None], tap, 0.0) for j, tap in enumerate(taps)]
    return jax.nn.silu(sum(kernel[j] * tap for j, tap in enumerate(taps)))


def _gated_delta(q, k, v, b, a, conv, a_log, dt_bias, conv_state, recurrent, carried, reset, *, chunk_size: int,
                 step: bool):
    """Short convolution, gates, normalisation and gated delta rule of `h` key heads, each serving `group`
    value heads: q, k `[B, T, h, dk]`, v `[B, T, h, group * dv]`, b, a `[B, T, h, group]`; conv `[Kc, C]`
    over the channels (q, k, v) each flattened head-major, `C = h (2 dk + group dv)`; a_log, dt_bias
    `[h * group]`; conv_state `[B, Kc - 1, C]`, recurrent `[B, h * group, dk, dv]` the state before; carried,
    reset `[B, T]` or None. The recurrent step when `step` (decoding one token), else the chunked
    form. Returns (core `[B, T, h * group, dv]` float32, recurrent, conv_state)."""
    batch, length, heads, dk = q.shape
    group = b.shape[-1]
    mixed = jnp.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
    # Depthwise causal convolution over [previous inputs, new inputs]; the tail is the next state.
    history = jnp.concatenate([conv_state, mixed], axis=1)
    mixed = _short_conv(history, conv.astype(jnp.float32), carried)
    conv_state = history[:, history.shape[1] - (conv.shape[0] - 1) :]

    q, k, v = jnp.split(mixed, [heads * dk, 2 * heads * dk], axis=-1)
    q, k = (jnp.repeat(t.reshape(batch, length, heads, dk), group, axis=2) for t in (q, k))
    v = v.reshape(batch, length, heads * group, -1)
    beta = jax.nn.sigmoid(b.reshape(batch, length, heads * group))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.reshape(batch, length, heads * group) + dt_bias.astype(jnp.float32))
    q = _l2_normalize(q) * dk**-0.5
    k = _l2_normalize(k)
    if step:
        core, recurrent = kernels.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
        return core[:, None], recurrent, conv_state
    core, recurrent = kernels.gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=recurrent,
                                               reset=reset)
    return core, recurrent, conv_state


class DeltaNetState(NamedTuple):
    """Decode state of a GatedDeltaNet layer."""

    conv: jax.Array  # [B, conv_kernel - 1, conv_dim]: the last inputs of the short convolution
    recurrent: jax.Array  # [B, value_heads, key_head_dim, value_head_dim] float32


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next gated DeltaNet token mixer (short conv + gated delta rule + gated RMSNorm)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_index: int = 0):
        del layer_index  # the same at every depth
        c, pd = config, config.weight_dtype
        self.num_key_heads, self.num_value_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.key_head_dim, self.value_head_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.conv_kernel_size, self.chunk_size = c.linear_conv_kernel_dim, c.linear_chunk_size
        self.norm_eps = c.rms_norm_eps
        self.dtype, self.context_parallel = c.compute_dtype, c.context_parallel
        self.group = self.num_value_heads // self.num_key_heads
        key_width = self.num_key_heads * self.key_head_dim
        value_width = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * key_width + value_width
        self.in_proj_qkvz = _param(rngs, (c.hidden_size, 2 * key_width + 2 * value_width), ("embed", "heads"), pd)
        self.in_proj_ba = _param(rngs, (c.hidden_size, 2 * self.num_value_heads), ("embed", "heads"), pd)
        self.conv1d = _param(rngs, (self.conv_kernel_size, self.conv_dim), (None, None), pd,
                             jax.nn.initializers.uniform(1 / math.sqrt(self.conv_kernel_size)))
        self.dt_bias = _param(rngs, (self.num_value_heads,), ("heads",), pd, jax.nn.initializers.ones)
        self.A_log = _param(rngs, (self.num_value_heads,), ("heads",), pd,
                            lambda key, shape, dt: jnp.log(jax.random.uniform(key, shape, dt, 1.0, 16.0)))
        self.norm = _param(rngs, (self.value_head_dim,), ("norm",), pd, jax.nn.initializers.ones)
        self.out_proj = _param(rngs, (value_width, c.hidden_size), ("heads", "embed"), pd)

    def init_cache(self, batch: int, max_len: int = 0) -> DeltaNetState:
        return DeltaNetState(
            jnp.zeros((batch, self.conv_kernel_size - 1, self.conv_dim), jnp.float32),
            jnp.zeros((batch, self.num_value_heads, self.key_head_dim, self.value_head_dim), kernels.STATE_DTYPE),
        )

    def __call__(self, x, *, positions=None, segment_ids=None, cache=None, kv_segment_ids=None, write_index=None):
        """x `[B, T, hidden]` -> (y `[B, T, hidden]` float32, DeltaNetState or None)."""
        batch, length, _ = x.shape
        state = self.init_cache(batch) if cache is None else cache
        kernels.check_state(state.conv, (batch, self.conv_kernel_size - 1, self.conv_dim), "cache.conv",
                            "[batch, conv_kernel - 1, conv_dim]")
        hk, hv, group = self.num_key_heads, self.num_value_heads, self.group
        dk, dv = self.key_head_dim, self.value_head_dim
        x = _mask_padding(x, segment_ids)
        qkvz = matmul(x, self.in_proj_qkvz[...], "btd,de->bte", self.dtype)
        q, k, v, z = jnp.split(qkvz.reshape(batch, length, hk, 2 * dk + 2 * group * dv),
                               [dk, 2 * dk, 2 * dk + group * dv], axis=-1)
        ba = matmul(x, self.in_proj_ba[...], "btd,de->bte", self.dtype)
        b, a = jnp.split(ba.reshape(batch, length, hk, 2 * group), 2, axis=-1)
        cp_plan = None if cache is not None else context_parallel.plan(self.context_parallel, batch, length)
        if cp_plan is not None:
            core, new_state = self._context_parallel(q, k, v, b, a, segment_ids, cp_plan), None
        else:
            carried, reset = _segments(segment_ids, cache)
            core, recurrent, conv_state = _gated_delta(
                q, k, v, b, a, self.conv1d[...], self.A_log[...], self.dt_bias[...], state.conv, state.recurrent,
                carried, reset, chunk_size=self.chunk_size, step=cache is not None and length == 1)
            new_state = None if cache is None else DeltaNetState(conv_state, recurrent)
        gate = jax.nn.silu(z.reshape(batch, length, hv, dv))
        normed = self.norm[...].astype(jnp.float32) * _rms_normalize(core, self.norm_eps) * gate
        y = matmul(normed.reshape(batch, length, -1), self.out_proj[...], "bte,ed->btd", self.dtype)
        return y, new_state

    def _context_parallel(self, q, k, v, b, a, segment_ids, plan) -> jax.Array:
        """`_gated_delta` from zero states on whole sequences, heads split over the devices. The split unit
        is a key head with its value heads; when the devices outnumber them, each key head is repeated
        `repeat` times (`context_parallel.kv_repeat`), copy i serving value heads i*group/repeat .. of its
        group (the q/k convolution is then computed on `repeat` devices); `ulysses` pads what still does
        not divide. -> core `[B, T, value heads, dv]` float32."""
        batch, length, hk, dk = q.shape
        group, dv, width = self.group, self.value_head_dim, self.conv_kernel_size
        repeat = context_parallel.kv_repeat(hk, group, plan.head_shards)
        heads, sub = hk * repeat, group // repeat
        # conv taps per key head [hk, Kc, channels of the head], then regrouped like the activations
        conv_q, conv_k, conv_v = (jnp.moveaxis(w.reshape(width, hk, -1), 1, 0) for w in
                                  jnp.split(self.conv1d[...], [hk * dk, 2 * hk * dk], axis=1))
        conv_v = jnp.moveaxis(conv_v.reshape(hk, width, repeat, -1), 2, 1).reshape(heads, width, -1)
        tokens = [jnp.repeat(q, repeat, axis=2), jnp.repeat(k, repeat, axis=2)] + [
            t.reshape(batch, length, heads, -1) for t in (v, b, a)]
        per_head = [jnp.repeat(conv_q, repeat, axis=0), jnp.repeat(conv_k, repeat, axis=0), conv_v] + [
            p[...].reshape(heads, sub) for p in (self.A_log, self.dt_bias)]

        def local(tokens, rows, head_values):
            q, k, v, b, a = tokens
            conv_q, conv_k, conv_v, a_log, dt_bias = head_values
            rows_here, local_heads = q.shape[0], q.shape[2]
            conv = jnp.concatenate([jnp.moveaxis(w, 0, 1).reshape(width, -1) for w in (conv_q, conv_k, conv_v)], 1)
            carried, reset = carried_segments(rows[0])
            core, _, _ = _gated_delta(
                q, k, v, b, a, conv, a_log.reshape(-1), dt_bias.reshape(-1),
                jnp.zeros((rows_here, width - 1, conv.shape[1]), jnp.float32),
                jnp.zeros((rows_here, local_heads * sub, dk, dv), kernels.STATE_DTYPE),
                carried, reset, chunk_size=self.chunk_size, step=False)
            return (core.reshape(rows_here, length, local_heads, sub, dv),)

        (core,) = context_parallel.ulysses(local, tokens, (_segment_ids_or_ones(segment_ids, q),), per_head,
                                           plan=plan)
        return core.reshape(batch, length, hk * group, dv)
