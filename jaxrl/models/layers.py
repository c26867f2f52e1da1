"""Building blocks of the decoder: RMSNorm, rotary embedding, GQA attention, SwiGLU, MoE.

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
from jax.sharding import PartitionSpec

from jaxrl.models import context_parallel
from jaxrl.models.attention import attention
from jaxrl.models.config import ModelConfig
from jaxrl.models import megablox
from jaxrl.models.sharding import constrain, logical_to_spec, target_platform

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


def rotary(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Rotate-half RoPE as in transformers' Qwen3 (float32 tables, applied in float32), on the first
    `rotary_dim` features (all by default; Qwen3-Next's partial rotary leaves the rest unchanged).

    x: [B, T, H, Dh]; positions: [B, T] int. Returns float32 [B, T, H, Dh].
    """
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.int32).astype(F32) / dim))
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x = x.astype(F32)
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * jnp.cos(angles) + rotated * jnp.sin(angles), rest], axis=-1)


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
        self.q_proj = make_param(rngs, (c.hidden_size, c.num_heads, q_width), ("embed", "heads", "head_dim"), pd)
        self.k_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd)
        self.v_proj = make_param(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim),
                                 ("embed", "kv_heads", "head_dim"), pd)
        self.o_proj = make_param(rngs, (c.num_heads, c.head_dim, c.hidden_size), ("heads", "head_dim", "embed"), pd)
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
        q = rotary(q, positions, c.rope_theta, self.rotary_dim).astype(dtype)
        k = rotary(k, positions, c.rope_theta, self.rotary_dim).astype(dtype)
        q = constrain(q, ("batch", "length", "act_heads", None))
        batch, length = segment_ids.shape
        q_slot = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        if cache is None:
            kv_slot, kv_segment_ids = q_slot, segment_ids
        else:
            cache = {"k": write_rows(cache["k"], k, write_index), "v": write_rows(cache["v"], v, write_index)}
            k, v = cache["k"], cache["v"]
            q_slot = q_slot + (write_index if write_index.ndim == 0 else write_index[:, None])
            kv_slot = jnp.broadcast_to(jnp.arange(k.shape[1], dtype=jnp.int32), kv_segment_ids.shape)
        groups = c.num_heads // c.num_kv_heads
        q = q.reshape(batch, length, c.num_kv_heads, groups, c.head_dim)
        cp_plan = None if cache is not None else context_parallel.plan(c.context_parallel, batch, length)
        run = (attention if cp_plan is None
               else functools.partial(context_parallel.ulysses_attention, plan=cp_plan))
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
        self.gate_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd)
        self.up_proj = make_param(rngs, (d, intermediate_size), ("embed", "mlp"), pd)
        self.down_proj = make_param(rngs, (intermediate_size, d), ("mlp", "embed"), pd)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = matmul(x, self.gate_proj[...], "...d,di->...i", self.dtype)
        up = matmul(x, self.up_proj[...], "...d,di->...i", self.dtype)
        hidden = constrain((jax.nn.silu(gate) * up).astype(self.dtype), ("batch", "length", "act_mlp"))
        return matmul(hidden, self.down_proj[...], "...i,id->...d", self.dtype)


def ragged_dot_is_sparse() -> bool:
    """Whether this program's target runs `jax.lax.ragged_dot` as a grouped matmul. None does today
    apart from TPUs, which run megablox instead: XLA:CPU rewrites it into a dense dot over all
    groups (E times the FLOPs: bench/moe_step.py), and so does XLA:GPU in jaxlib 0.10.2 (compiled
    for an H100 target, 16384 rows x 128 experts x 2048 -> 768: an [rows, E * 2048] one-hot
    operand, 8,240 MiB of temporaries forward and 22,528 MiB with its gradient, against 2,047 and
    1,988 MiB blocked; docs/gpu-aot.md)."""
    return False


GATHER_BYTES = 256 << 20  # the expert weights the blocked grouped matmul gathers at once


class GroupedMatmul:
    """`out[r] = lhs[r] @ rhs[expert of row r]` for rows sorted by expert (`group_sizes` [E] rows each);
    rows past `sum(group_sizes)` give zeros.

    `impl` (default: by the target platform): "gmm", the megablox Pallas kernel on TPU
    (`jaxrl.models.megablox`; under a multi-device mesh only inside `jax.shard_map`);
    "ragged_dot", `jax.lax.ragged_dot` where the backend runs it sparsely (none yet:
    `ragged_dot_is_sparse`); "blocked" elsewhere (CPU, GPU), a grouped matmul of the same FLOPs
    order: each expert's rows are padded to a multiple of a block of `block` rows, every block
    holds one expert's rows, and the blocks run as one batched matmul against their expert's
    weight, `2 (rows + E (block - 1)) D N` FLOPs instead of `2 rows E D N`. All are deterministic
    (fixed row order, one dot per row).
    """

    def __init__(self, group_sizes: jax.Array, rows: int, dtype, *, impl: str | None = None):
        self.group_sizes, self.dtype = group_sizes, dtype
        if impl is None:
            impl = "gmm" if target_platform() == "tpu" else "ragged_dot" if ragged_dot_is_sparse() else "blocked"
        self.impl = impl
        if impl != "blocked":
            return
        experts = group_sizes.shape[0]
        # a block small enough that padding stays under ~1/4 of the rows, at most 128
        self.block = int(max(1, min(128, 2 ** int(math.log2(max(1, rows // (4 * experts)))))))
        padded_sizes = -(-group_sizes // self.block) * self.block
        padded_ends = jnp.cumsum(padded_sizes)
        self.padded_rows = -(-(rows + experts * (self.block - 1)) // self.block) * self.block
        expert_of_row = jnp.repeat(jnp.arange(experts), group_sizes, total_repeat_length=rows)
        rank_in_group = jnp.arange(rows) - (jnp.cumsum(group_sizes) - group_sizes)[expert_of_row]
        # rows past the groups' total (assignments to other devices' experts) go out of bounds: dropped
        in_groups = jnp.arange(rows) < jnp.sum(group_sizes)
        self.destination = jnp.where(in_groups, (padded_ends - padded_sizes)[expert_of_row] + rank_in_group,
                                     self.padded_rows + jnp.arange(rows))
        block_starts = jnp.arange(self.padded_rows // self.block) * self.block
        self.block_expert = jnp.minimum(
            jnp.searchsorted(padded_ends, block_starts, side="right", method="compare_all"), experts - 1)

    def __call__(self, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        """lhs [rows, K] sorted by expert, rhs [E, K, N] -> [rows, N] float32."""
        lhs, rhs = lhs.astype(self.dtype), rhs.astype(self.dtype)
        if self.impl == "gmm":
            return megablox.grouped_matmul(lhs, rhs, self.group_sizes)
        if self.impl == "ragged_dot":
            return jax.lax.ragged_dot(lhs, rhs, self.group_sizes, preferred_element_type=F32)
        padded = jnp.zeros((self.padded_rows, lhs.shape[1]), lhs.dtype).at[self.destination].set(
            lhs, unique_indices=True, mode="drop")
        blocks = padded.reshape(-1, self.block, lhs.shape[1])
        # Each block multiplies its expert's weights, gathered per block: [blocks, K, N] in one go is a copy
        # of the weights per block (16 GB a matrix for a Qwen3-30B-A3B layer at 10K tokens a GPU). Past
        # GATHER_BYTES, the blocks go in groups and the backward gathers again instead of saving the copies.
        at_once = max(1, GATHER_BYTES // (rhs.shape[1] * rhs.shape[2] * rhs.dtype.itemsize))
        if at_once >= blocks.shape[0]:
            out = jnp.einsum("jbk,jkn->jbn", blocks, rhs[self.block_expert], preferred_element_type=F32)
        else:
            @jax.checkpoint
            def group_matmul(group):
                group_blocks, experts = group
                return jnp.einsum("bk,kn->bn", group_blocks, rhs[experts], preferred_element_type=F32)

            out = jax.lax.map(group_matmul, (blocks, self.block_expert), batch_size=at_once)
        return out.reshape(self.padded_rows, -1).at[self.destination].get(mode="fill", fill_value=0)


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (Qwen3-MoE), optional shared expert (Qwen2-MoE style, ungated).

    Router logits and softmax in float32; `lax.top_k` breaks ties by the lower expert index;
    top-k weights renormalised when `norm_topk_prob`. Rollout routing replay (R3): given
    `routes` [B, T, k], a position whose k entries are all >= 0 uses those experts instead of its
    top-k, with combine weights from the current router (its probabilities of those experts,
    renormalised when `norm_topk_prob`, as the top-k's are), so the router still gets
    gradients; positions with -1 (padding, unrecorded) route as usual. The k assignments of every token are
    stably sorted by expert (ties by token, then slot), run through grouped matmuls
    (`GroupedMatmul`: `jax.lax.ragged_dot`, or a blocked equivalent on CPU), scaled by their
    weights, un-permuted and summed over the k slots in slot order: a fixed permutation and
    combine order, and no all-experts dense computation.
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
        self.shared_expert_gate = (make_param(rngs, (d, 1), ("embed", None), pd)
                                   if self.shared_expert is not None and c.shared_expert_gate else None)

    def router_logits(self, x_flat: jax.Array, router: jax.Array | None = None) -> jax.Array:
        """x_flat [N, D] -> the router's logits [N, E] float32."""
        router = self.router[...] if router is None else router
        return jnp.dot(x_flat.astype(F32), router.astype(F32), preferred_element_type=F32)

    def router_z(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T] float32: the squared log-partition of the router logits,
        ``(log sum_e exp(z_e))^2``, the per-token term of ST-MoE's router z-loss (Zoph et al.,
        2022, eq. 5), which keeps the logits small so the router's softmax stays stable."""
        batch, length, dim = x.shape
        logits = self.router_logits(x.reshape(batch * length, dim).astype(self.config.compute_dtype))
        return (jax.nn.logsumexp(logits, axis=-1) ** 2).reshape(batch, length)

    def route(self, x_flat: jax.Array, router: jax.Array | None = None, replay: jax.Array | None = None
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x_flat [N, D], replay [N, k] int or None -> (router probs [N, E] f32, combine weights
        [N, k] f32, experts [N, k] int32): the top-k, or the replayed experts where given."""
        probs = jax.nn.softmax(self.router_logits(x_flat, router), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.config.num_experts_per_tok)
        if replay is not None:
            given = jnp.all(replay >= 0, axis=-1, keepdims=True)
            experts = jnp.where(given, replay.astype(experts.dtype), experts)
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if self.config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights, experts.astype(jnp.int32)

    def __call__(self, x: jax.Array, routes: jax.Array | None = None):
        """x: [B, T, D]; routes: [B, T, k] int experts to replay (-1: none) or None. Returns
        (y [B, T, D] float32, probs [B, T, E] f32, experts used [B, T, k] int32)."""
        dtype = self.config.compute_dtype
        batch, length, dim = x.shape
        mesh = jax.sharding.get_abstract_mesh()
        batch_axes = logical_to_spec(("batch",), x.shape[:1], mesh)[0] if not mesh.empty else None
        if not mesh.empty and mesh.shape.get("expert", 1) > 1 and "expert" in (batch_axes or ()):
            y, probs, experts = self._expert_parallel(x, mesh, routes)
            y, probs, experts = y.reshape(batch * length, dim), probs.reshape(batch * length, -1), experts
        elif target_platform() == "tpu" and not mesh.empty and not mesh.are_all_axes_manual:
            y, probs, experts = self._tokens_local(x, mesh, routes)
            y, probs, experts = y.reshape(batch * length, dim), probs.reshape(batch * length, -1), experts
        else:
            y, probs, experts = self._routed(x, routes, self.router[...], self.gate_proj[...], self.up_proj[...],
                                             self.down_proj[...])
        if self.shared_expert is not None:
            shared = self.shared_expert(x.astype(dtype))  # [B, T, D]: its activation hints name batch and length
            if self.shared_expert_gate is not None:
                shared = shared * jax.nn.sigmoid(matmul(x, self.shared_expert_gate[...], "btd,dg->btg", dtype))
            y = y + shared.reshape(batch * length, dim)
        y = constrain(y.reshape(batch, length, dim), ("batch", "length", "act_embed"))
        return y, probs.reshape(batch, length, -1), experts.reshape(batch, length, -1)

    def _routed(self, x, routes, router, gate_w, up_w, down_w):
        """Route x [B, T, D] (routes to replay [B, T, k] or None) through all experts: (y [B*T, D] f32,
        probs [B*T, E] f32, experts [B*T, k] int32)."""
        x_flat = x.reshape(-1, x.shape[-1]).astype(self.config.compute_dtype)
        replay = None if routes is None else routes.reshape(x_flat.shape[0], -1)
        probs, weights, experts = self.route(x_flat, router, replay)
        return self._experts(x_flat, weights, experts, gate_w, up_w, down_w, 0), probs, experts

    def _tokens_local(self, x, mesh, routes):
        """The plain (no expert parallelism) path inside `jax.shard_map`, which the TPU's Mosaic `gmm`
        kernel needs: every device routes its own tokens (split as "batch" and "length" split them)
        through all experts, whose weights are gathered whole on each device, layer by layer (FSDP
        style; tensor-parallel "expert_mlp" shards are gathered too). Returns [B, T, ...] outputs."""
        spec = logical_to_spec(("batch", "length", "act_embed"), x.shape, mesh)
        spec = PartitionSpec(spec[0], spec[1], None)  # tokens, probs, routes: rows split, last dim whole

        def local(x_local, routes_local, *weights):
            b, t, d = x_local.shape
            y, probs, experts = self._routed(x_local, routes_local, *weights)
            return y.reshape(b, t, d), probs.reshape(b, t, -1), experts.reshape(b, t, -1)

        return jax.shard_map(local, in_specs=(spec, None if routes is None else spec) + (PartitionSpec(),) * 4,
                             out_specs=(spec, spec, spec), check_vma=False)(
            x, routes, self.router[...], self.gate_proj[...], self.up_proj[...], self.down_proj[...])

    def _experts(self, x_flat, weights, experts, gate_w, up_w, down_w, first_expert) -> jax.Array:
        """Contribution of experts `first_expert ...` (as many as `gate_w` holds) to each token.

        x_flat [N, D]; weights, experts [N, k]; gate_w, up_w [E_local, D, I]; down_w [E_local, I, D].
        Assignments to other experts sort last and contribute 0. Returns [N, D] float32.
        """
        dtype, k = self.config.compute_dtype, self.config.num_experts_per_tok
        local_count = gate_w.shape[0]
        local = experts.reshape(-1) - first_expert  # [N*k], assignment a belongs to token a // k
        mine = (local >= 0) & (local < local_count)
        local = jnp.where(mine, local, local_count)
        order = jnp.argsort(local, stable=True)
        tokens_sorted = x_flat[order // k]
        group_sizes = jnp.bincount(local, length=local_count + 1)[:local_count].astype(jnp.int32)
        grouped = GroupedMatmul(group_sizes, tokens_sorted.shape[0], dtype)
        gate = grouped(tokens_sorted, gate_w)
        up = grouped(tokens_sorted, up_w)
        out_sorted = grouped((jax.nn.silu(gate) * up).astype(dtype), down_w)
        out_sorted = out_sorted * jnp.where(mine, weights.reshape(-1), 0.0)[order][:, None]
        out = out_sorted[jnp.argsort(order)].reshape(x_flat.shape[0], k, -1)
        y = out[:, 0]
        for slot in range(1, k):  # explicit left-to-right slot order
            y = y + out[:, slot]
        return y

    def _expert_parallel(self, x: jax.Array, mesh, routes: jax.Array | None = None):
        """Expert parallelism over the mesh axis "expert" (tokens sharded over it as part of "batch").

        Each device routes its own tokens, all-gathers tokens and routing over "expert", runs only
        its E / ep local experts on the assignments to them, and a reduce-scatter over "expert"
        sums the experts' contributions and hands every device back its own tokens. Expert
        weights stay sharded over "expert" (other axes are gathered, FSDP style). Shapes are
        static, so the blocked (CPU) grouped matmul is sized for all gathered assignments: there
        EP saves expert-weight memory, not FLOPs; ragged_dot need not touch other experts' rows.
        Only used when "expert" shards the batch (otherwise XLA partitions the plain path).
        Routes to replay (or None) are sharded like the tokens. Returns (y [B, T, D] f32, probs
        [B, T, E] f32, experts [B, T, k] int32).
        """
        c, dtype = self.config, self.config.compute_dtype
        local_count = c.num_experts // mesh.shape["expert"]
        x_spec = logical_to_spec(("batch", "length", "act_embed"), x.shape, mesh)
        row_spec = PartitionSpec(x_spec[0], x_spec[1], None)
        expert_spec = PartitionSpec("expert", None, None)

        def local(x_local, routes_local, router, gate_w, up_w, down_w):
            b, t, d = x_local.shape
            x_flat = x_local.reshape(b * t, d).astype(dtype)
            replay = None if routes_local is None else routes_local.reshape(b * t, -1)
            probs, weights, experts = self.route(x_flat, router, replay)
            gather = functools.partial(jax.lax.all_gather, axis_name="expert", tiled=True)
            y_all = self._experts(gather(x_flat), gather(weights), gather(experts), gate_w, up_w, down_w,
                                  jax.lax.axis_index("expert") * local_count)
            y = jax.lax.psum_scatter(y_all, "expert", scatter_dimension=0, tiled=True)
            return y.reshape(b, t, d), probs.reshape(b, t, -1), experts.reshape(b, t, -1)

        return jax.shard_map(local, in_specs=(x_spec, None if routes is None else row_spec, PartitionSpec(),
                                              expert_spec, expert_spec, expert_spec),
                             # a Pallas kernel's output carries no varying-axes type for the check
                             out_specs=(x_spec, row_spec, row_spec), check_vma=target_platform() != "tpu")(
            x, routes, self.router[...], self.gate_proj[...], self.up_proj[...], self.down_proj[...])
