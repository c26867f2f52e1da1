"""The mixture-of-experts layer (Qwen3-MoE): top-k routing, the experts' grouped matmul per platform
(megablox on TPU, blocked elsewhere), expert parallelism (docs/models.md#mixture-of-experts).

Parameters carry logical axes ("expert", "expert_mlp", ...) as in layers.py; no mesh axis names appear
here. Router logits and softmax and every matmul accumulation are float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.models import megablox
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import F32, MLP, make_param, matmul
from jaxrl.models.sharding import constrain, logical_to_spec, target_platform


def ragged_dot_is_sparse() -> bool:
    """Whether this program's target runs `jax.lax.ragged_dot` as a grouped matmul. None does today
    apart from TPUs, which run megablox instead: XLA:CPU rewrites it into a dense dot over all
    groups (E times the FLOPs: bench/moe_step.py), and so does XLA:GPU in jaxlib 0.10.2 (compiled
    for an H100 target, 16384 rows x 128 experts x 2048 -> 768: an [rows, E * 2048] one-hot
    operand, 8,240 MiB of temporaries forward and 22,528 MiB with its gradient, against 408 and
    596 MiB blocked: bench/gpu_moe_aot.py)."""
    return False


GATHER_BYTES = 256 << 20  # the expert weights the blocked grouped matmul gathers at once
# Expert parallelism runs the gathered assignments in this many chunks per expert shard: the device's
# share (about 1/ep of them) fills about two, so routing can be uneven by a chunk before a third runs.
# 0 runs them as one chunk, sized for every gathered assignment.
CHUNKS_PER_EXPERT_SHARD = 2


def _vary_alike(*arrays: jax.Array) -> list[jax.Array]:
    """The arrays, each cast to vary over every mesh axis any of them varies over (shard_map's
    types; no change outside shard_map or without its check)."""
    varying = [jax.typeof(a).manual_axis_type.varying for a in arrays]
    axes = set().union(*varying)
    return [jax.lax.pcast(a, tuple(sorted(axes - vma)), to="varying") if axes - vma else a
            for a, vma in zip(arrays, varying, strict=True)]


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
        self.gate_proj = make_param(rngs, (e, d, i), ("expert", "embed", "expert_mlp"), pd, compute_cast=True)
        self.up_proj = make_param(rngs, (e, d, i), ("expert", "embed", "expert_mlp"), pd, compute_cast=True)
        self.down_proj = make_param(rngs, (e, i, d), ("expert", "expert_mlp", "embed"), pd, compute_cast=True)
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

    def _experts(self, x_flat, weights, experts, gate_w, up_w, down_w, first_expert, chunks=1) -> jax.Array:
        """Contribution of experts `first_expert ...` (as many as `gate_w` holds) to each token.

        x_flat [N, D]; weights, experts [N, k]; gate_w, up_w [E_local, D, I]; down_w [E_local, I, D].
        Assignments sort by local expert, other experts' last (they contribute 0). With `chunks` > 1
        the sorted assignments run `ceil(N k / chunks)` at a time and a chunk holding none of this
        device's skips its matmuls: the buffers are sized for a chunk, not for every assignment,
        which expert parallelism needs (N k gathered assignments, about 1/ep of them its own).
        Each chunk adds its tokens' contributions in slot order. Returns [N, D] float32.
        """
        dtype, k = self.config.compute_dtype, self.config.num_experts_per_tok
        local_count = gate_w.shape[0]
        local = experts.reshape(-1) - first_expert  # [N*k], assignment a belongs to token a // k
        mine = (local >= 0) & (local < local_count)
        local = jnp.where(mine, local, local_count)
        order = jnp.argsort(local, stable=True)
        group_sizes = jnp.bincount(local, length=local_count + 1)[:local_count].astype(jnp.int32)
        group_ends = jnp.cumsum(group_sizes)
        chunk = -(-order.shape[0] // chunks)
        padding = chunks * chunk - order.shape[0]  # past every group: zeros, weight 0
        order_padded = jnp.pad(order, (0, padding))
        row_weights = jnp.pad(jnp.where(mine, weights.reshape(-1), 0.0)[order], (0, padding))
        position = jnp.argsort(order).reshape(x_flat.shape[0], k)  # where assignment (token, slot) sorted to

        y = jnp.zeros(x_flat.shape, F32)
        if chunks > 1:
            # The weights' gradients are summed over the chunks in float32 (the weights may come in
            # the compute dtype, stacked so by scanned layers).
            gate_w, up_w, down_w = (w.astype(jnp.promote_types(w.dtype, F32)) for w in (gate_w, up_w, down_w))
            # Inside shard_map every operand varies over the same mesh axes before the loop: otherwise
            # the backward sums an operand broadcast over an axis (the expert weights over fsdp) inside
            # the branch, which only the devices whose chunk holds assignments take: they wait forever.
            y, x_flat, gate_w, up_w, down_w, order_padded, row_weights, position, group_sizes, group_ends = (
                _vary_alike(y, x_flat, gate_w, up_w, down_w, order_padded, row_weights, position, group_sizes,
                            group_ends))

        def add_chunk(y, start):
            """y [N, D] f32 plus the contributions of sorted assignments start ... start + chunk."""
            rows = jax.lax.dynamic_slice_in_dim(order_padded, start, chunk)
            end = start + chunk
            sizes = jnp.clip(group_ends, start, end) - jnp.clip(group_ends - group_sizes, start, end)
            grouped = GroupedMatmul(sizes, chunk, dtype)
            tokens = x_flat[rows // k]
            hidden = (jax.nn.silu(grouped(tokens, gate_w)) * grouped(tokens, up_w)).astype(dtype)
            out = grouped(hidden, down_w) * jax.lax.dynamic_slice_in_dim(row_weights, start, chunk)[:, None]
            in_chunk = position - start
            in_chunk = jnp.where((in_chunk >= 0) & (in_chunk < chunk), in_chunk, chunk)  # elsewhere: fill 0
            for slot in range(k):  # explicit left-to-right slot order, one [N, D] gather a slot
                y = y + out.at[in_chunk[:, slot]].get(mode="fill", fill_value=0)
            return y

        if chunks == 1:
            return add_chunk(y, 0)

        @jax.checkpoint  # the backward recomputes a chunk instead of saving every chunk's buffers
        def step(y, start):
            return jax.lax.cond(start < group_ends[-1], add_chunk, lambda y, start: y, y, start), None

        return jax.lax.scan(step, y, jnp.arange(chunks) * chunk)[0]

    def _expert_parallel(self, x: jax.Array, mesh, routes: jax.Array | None = None):
        """Expert parallelism over the mesh axis "expert" (tokens sharded over it as part of "batch").

        Each device routes its own tokens, all-gathers tokens and routing over "expert", runs only
        its E / ep local experts on the assignments to them, and a reduce-scatter over "expert"
        sums the experts' contributions and hands every device back its own tokens. Expert
        weights stay sharded over "expert" (other axes are gathered, FSDP style). The gathered
        assignments run in `CHUNKS_PER_EXPERT_SHARD` x ep chunks of the expert-sorted order and only
        chunks holding this device's run their matmuls, so buffers and FLOPs follow the device's share
        (about 1/ep, plus a chunk for uneven routing), not every gathered assignment; none is dropped.
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
                                  jax.lax.axis_index("expert") * local_count,
                                  chunks=max(1, CHUNKS_PER_EXPERT_SHARD * mesh.shape["expert"]))
            y = jax.lax.psum_scatter(y_all, "expert", scatter_dimension=0, tiled=True)
            return y.reshape(b, t, d), probs.reshape(b, t, -1), experts.reshape(b, t, -1)

        return jax.shard_map(local, in_specs=(x_spec, None if routes is None else row_spec, PartitionSpec(),
                                              expert_spec, expert_spec, expert_spec),
                             # a Pallas kernel's output carries no varying-axes type for the check
                             out_specs=(x_spec, row_spec, row_spec), check_vma=target_platform() != "tpu")(
            x, routes, self.router[...], self.gate_proj[...], self.up_proj[...], self.down_proj[...])
