"""The decoder: embeddings, per-layer (attention kind, MLP kind) blocks, final RMSNorm, LM head.

Three call paths share one `__call__`:
- full forward (training, prefill recompute): `model(input_ids, positions, segment_ids)`;
- decoding: `cache = model.init_cache(B, S)`, then `model(ids, positions, seg, cache=cache)` with
  T prompt tokens (prefill) and then 1 token per step; each row keeps its own positions, and
  padding (segment id 0) is never attended, so left/right-padded and ragged batches work;
- token logprobs and entropy through the chunked LM head (`token_logprobs`), never [B, T, V].
With `ModelConfig.scan_layers` the full forward runs the blocks as one `lax.scan` over their
stacked weights (`stack_blocks`); decoding loops over the blocks either way.

The residual stream is float32 whatever the compute dtype (docs/models.md#numerics-and-dtypes).

Decode vs full forward: both run the same code (same projections, the same masked softmax
over cache rows laid out exactly like the sequence, empty rows contributing exact zeros), but
they are not bit-identical on XLA:CPU: its dot kernels round differently for 1 query row than
for T rows (seen for [1,K]x[K,N] vs [T,K]x[K,N] with K >= 256 and in the attention einsums
even at head_dim 10). Measured in float32 (tests/models/test_decode.py): 8-10.5 ulps of the
row's largest logit, about 2.5e-6 on logits of magnitude 4.5, with ~20-25 % of logits exact.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl.models import context_parallel, ring
from jaxrl.models.config import ModelConfig
from jaxrl.models.layers import F32, MLP, Attention, RMSNorm, make_param, write_rows
from jaxrl.models.moe import MoE
from jaxrl.models.linear_layers import GatedDeltaNet, LightningAttention
from jaxrl.models.lm_head import sharded_token_logprobs_and_entropy
from jaxrl.models.sharding import constrain

# Attention kind (ModelConfig.layer_types entry: the keys are config.ATTENTION_KIND_NAMES) -> module
# class. A kind's class is built as `cls(config, rngs=rngs, layer_index=i)`, has
# `init_cache(batch, max_len)` and is called as
# `attn(x, positions=, segment_ids=, cache=, kv_segment_ids=, write_index=) -> (y, cache)`.
# The linear kinds keep a fixed-size recurrent state as their cache (jaxrl.models.linear_layers).
ATTENTION_KINDS: dict[str, type[nnx.Module]] = {
    "full_attention": Attention,
    "lightning_attention": LightningAttention,
    "gated_deltanet": GatedDeltaNet,
}

# Remat policy (ModelConfig.remat other than "none": the keys are config.REMAT_POLICY_NAMES) -> policy.
REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention_out": jax.checkpoint_policies.save_only_these_names("attention_out"),
}


class DecodeCache(NamedTuple):
    """Per-layer caches (layer i's from its attention kind), the segment id of each cache row
    [B, S] int32 (0 = empty or padding) and the next row to write: per batch row [B] int32, or
    one row shared by every batch row [] int32 (`init_cache(..., shared_index=True)`)."""

    layers: tuple[Any, ...]
    segment_ids: jax.Array
    index: jax.Array


class DecoderOutput(NamedTuple):
    """hidden [B, T, D] float32 after the final norm; aux_loss: scalar load-balancing loss
    (transformers' `load_balancing_loss_func` over all MoE layers, unscaled: multiply by
    `config.router_aux_loss_coef`; 0 without MoE); cache: updated DecodeCache or None;
    routed_experts [B, T, num_moe_layers, k] int32, the experts each MoE layer used, or None;
    activations: dict or None; router_experts: the routers' own top-k in the same layout, which
    differs from ``routed_experts`` only where routes were replayed (None without MoE);
    router_z_loss: scalar, ST-MoE's router z-loss, the mean over MoE layers and real positions
    of ``logsumexp(router logits)^2`` (unscaled; 0 without MoE)."""

    hidden: jax.Array
    aux_loss: jax.Array
    cache: DecodeCache | None
    routed_experts: jax.Array | None
    activations: dict[str, jax.Array] | None
    router_experts: jax.Array | None = None
    router_z_loss: jax.Array | float = 0.0


class Block(nnx.Module):
    """Pre-norm block: `h += attn(norm(h)); h += mlp(norm(h))` with a float32 residual."""

    def __init__(self, config: ModelConfig, layer_index: int, *, rngs: nnx.Rngs):
        c, pd = config, config.weight_dtype
        self.dtype = c.compute_dtype
        self.residual_from_norm = c.residual_from_norm
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, pd, rngs=rngs, offset=c.norm_weight_offset)
        self.attn = ATTENTION_KINDS[c.layer_types[layer_index]](c, rngs=rngs, layer_index=layer_index)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, pd, rngs=rngs,
                                           offset=c.norm_weight_offset)
        self.is_moe = c.mlp_types[layer_index] == "moe"
        self.mlp = MoE(c, rngs=rngs) if self.is_moe else MLP(c, c.intermediate_size, rngs=rngs)

    def __call__(self, h, positions, segment_ids, cache=None, kv_segment_ids=None, write_index=None, routes=None):
        """h: [B, T, D] float32; routes: [B, T, k] experts to replay in a MoE block (or None).
        Returns (h, cache, (attn_out, mlp_out), (router probs, experts, router z terms) or None)."""
        attn_in = self.input_norm(h)
        attn_out, cache = self.attn(attn_in.astype(self.dtype), positions=positions,
                                    segment_ids=segment_ids, cache=cache, kv_segment_ids=kv_segment_ids,
                                    write_index=write_index)
        attn_out = checkpoint_name(attn_out, "attention_out")
        h = (attn_in if self.residual_from_norm else h) + attn_out  # MiniMax: residual after the norm
        mlp_norm = self.post_attention_norm(h)
        mlp_in = mlp_norm.astype(self.dtype)
        routing = None
        if self.is_moe:
            mlp_out, probs, experts = self.mlp(mlp_in, routes)
            routing = (probs, experts, self.mlp.router_z(mlp_in))
        else:
            mlp_out = self.mlp(mlp_in)
        h = constrain((mlp_norm if self.residual_from_norm else h) + mlp_out, ("batch", "length", "act_embed"))
        return h, cache, (attn_out, mlp_out), routing


def load_balancing_loss(probs: list[jax.Array], experts: list[jax.Array], mask: jax.Array,
                        num_experts: int) -> jax.Array:
    """Switch-style balance loss over all MoE layers, as transformers' `load_balancing_loss_func`:
    `E * sum_e f_e P_e` with `f_e` = masked top-k assignments to e / masked rows and `P_e` =
    masked router probability of e / masked rows, both summed over layers before the product.

    probs: per layer [B, T, E] f32; experts: per layer [B, T, k] int; mask: [B, T] bool.
    """
    weight = mask.astype(F32)
    counts = sum(jnp.sum(jax.nn.one_hot(e, num_experts, dtype=F32) * weight[..., None, None], axis=(0, 1, 2))
                 for e in experts)
    prob_sums = sum(jnp.sum(p * weight[..., None], axis=(0, 1)) for p in probs)
    rows = len(probs) * jnp.sum(weight)
    return num_experts * jnp.sum((counts / rows) * (prob_sums / rows))


def stack_blocks(blocks, compute_dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The blocks' shared graph and their weights stacked on a new leading axis (that axis unsharded;
    each weight keeps its own logical sharding); weights every use casts to the compute dtype
    (`make_param(compute_cast=True)`) are stacked in it. ValueError when the blocks differ in structure."""
    split = [nnx.split(block) for block in blocks]
    graphdef = split[0][0]
    for i, (other, _) in enumerate(split[1:], start=1):
        if other != graphdef:
            raise ValueError(f"ModelConfig.scan_layers: block {i} differs from block 0 in structure; "
                             "scanning needs identical layers (one attention kind, one MLP kind, no "
                             "per-depth constants)")

    def stack(*variables: nnx.Variable) -> nnx.Variable:
        cast = variables[0].get_metadata().get("compute_cast", False)
        value = jnp.stack([v[...].astype(compute_dtype) if cast else v[...] for v in variables])
        return variables[0].replace(constrain(value, (None, *variables[0].logical_axes)))

    return graphdef, jax.tree.map(stack, *(state for _, state in split),
                                  is_leaf=lambda x: isinstance(x, nnx.Variable))


class Decoder(nnx.Module):
    """Qwen3 / Qwen3-MoE style decoder configured per layer by `ModelConfig`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.weight_dtype
        self.config = config
        self.embed = make_param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
        self.layers = nnx.List([Block(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, pd, rngs=rngs, offset=c.norm_weight_offset)
        self.lm_head = (None if c.tie_word_embeddings
                        else make_param(rngs, (c.hidden_size, c.vocab_size), ("embed", "vocab"), pd))

    def lm_head_weight(self) -> jax.Array:
        """[D, V] unembedding in the parameter dtype (the embedding transposed when tied)."""
        return self.embed[...].T if self.lm_head is None else self.lm_head[...]

    def init_cache(self, batch: int, max_len: int, *, shared_index: bool = False) -> DecodeCache:
        """An empty decode cache for `batch` rows of at most `max_len` tokens (prompt included).
        Writing past `max_len` is not checked inside jit: size it for prompt + new tokens.

        `shared_index`: every batch row writes the same cache row at each call (left-padded
        prompts, one token per row per decode step, as the embedded sampler runs). The write is
        then one dynamic-update-slice per cache array, where per-row indices compile to scatters
        over the whole cache (bench/vs_tunix.py measures the difference)."""
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"init_cache needs positive batch and max_len, got batch={batch}, max_len={max_len}")
        return DecodeCache(
            layers=tuple(block.attn.init_cache(batch, max_len) for block in self.layers),
            segment_ids=jnp.zeros((batch, max_len), jnp.int32),
            index=jnp.zeros(() if shared_index else (batch,), jnp.int32))

    def __call__(self, input_ids, positions, segment_ids=None, *, cache: DecodeCache | None = None,
                 capture: bool = False, routed_experts: jax.Array | None = None) -> DecoderOutput:
        """input_ids, positions, segment_ids: [B, T] int (segment ids: 0 = padding, equal ids attend
        causally, so packed sequences take distinct ids; None = one sequence per row).
        routed_experts: [B, T, num_moe_layers, k] int, the experts each MoE layer uses at each
        position instead of its own top-k (rollout routing replay, ``MoE``; -1 where none were
        recorded), or None.

        With ring attention (``context_parallel: ring``, docs/models.md#context-parallelism) the full
        forward runs on the row's zig-zag layout: the [B, T, ...] inputs move into it here and the
        per-token outputs move back, so callers see the row in order."""
        if input_ids.ndim != 2 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids {input_ids.shape} and positions {positions.shape} must both be [B, T]")
        if segment_ids is None:
            segment_ids = jnp.ones_like(input_ids, dtype=jnp.int32)
        elif segment_ids.shape != input_ids.shape:
            raise ValueError(f"segment_ids {segment_ids.shape} must match input_ids {input_ids.shape}")
        plan = None if cache is not None else context_parallel.plan(self.config.context_parallel, *input_ids.shape)
        if plan is None or not plan.ring:
            return self._forward(input_ids, positions, segment_ids, cache, capture, routed_experts)

        def to_ring(x):
            return None if x is None else ring.to_ring_layout(x, plan)

        def back(x):
            return None if x is None else ring.from_ring_layout(x, plan)

        out = self._forward(to_ring(input_ids), to_ring(positions), to_ring(segment_ids), None, capture,
                            to_ring(routed_experts))
        return out._replace(hidden=back(out.hidden), routed_experts=back(out.routed_experts),
                            router_experts=back(out.router_experts),
                            activations=None if out.activations is None else jax.tree.map(back, out.activations))

    def _forward(self, input_ids, positions, segment_ids, cache, capture, routed_experts) -> DecoderOutput:
        """`__call__` on the layout the layers run (row order, or ring's zig-zag columns)."""
        c = self.config
        segment_ids = segment_ids.astype(jnp.int32)
        moe_layers = [i for i, kind in enumerate(c.mlp_types) if kind == "moe"]
        want = (*input_ids.shape, len(moe_layers), c.num_experts_per_tok)
        if routed_experts is not None and tuple(routed_experts.shape) != want:
            raise ValueError(f"routed_experts {tuple(routed_experts.shape)} must be [B, T, MoE layers, k] = {want}")
        h = jnp.take(self.embed[...], input_ids, axis=0).astype(F32)
        h = constrain(h, ("batch", "length", "act_embed"))
        activations = {"embed": h} if capture else None
        write_index = kv_segment_ids = None
        if cache is not None:
            write_index = cache.index
            kv_segment_ids = write_rows(cache.segment_ids, segment_ids, write_index)
        layer_caches, probs, experts, z_terms, captured = [], [], [], [], []  # captured: per layer (attn, mlp, out)
        if c.scan_layers and cache is None:
            h, routings, stacked_captures = self._scan_blocks(h, positions, segment_ids, routed_experts, capture)
            if routings is not None:
                probs, experts, z_terms = (list(stacked) for stacked in routings)
            if capture:
                captured = list(zip(*stacked_captures, strict=True))
        else:
            remat = c.remat != "none" and cache is None
            block_call = (nnx.remat(Block.__call__, policy=REMAT_POLICIES[c.remat]) if remat else Block.__call__)
            for i, block in enumerate(self.layers):
                layer_cache = None if cache is None else cache.layers[i]
                replayed = routed_experts is not None and i in moe_layers
                routes = routed_experts[:, :, moe_layers.index(i)] if replayed else None
                h, layer_cache, (attn_out, mlp_out), routing = block_call(
                    block, h, positions, segment_ids, layer_cache, kv_segment_ids, write_index, routes)
                layer_caches.append(layer_cache)
                if routing is not None:
                    probs.append(routing[0])
                    experts.append(routing[1])
                    z_terms.append(routing[2])
                if capture:
                    captured.append((attn_out, mlp_out, h))
        hidden = self.final_norm(h)
        if capture:
            for i, (attn_out, mlp_out, out) in enumerate(captured):
                activations.update({f"layers.{i}.attn": attn_out, f"layers.{i}.mlp": mlp_out, f"layers.{i}.out": out})
            activations["final_norm"] = hidden
        aux_loss = (load_balancing_loss(probs, experts, segment_ids != 0, c.num_experts) if probs
                    else jnp.zeros((), F32))
        new_cache = None if cache is None else DecodeCache(
            tuple(layer_caches), kv_segment_ids, write_index + input_ids.shape[1])
        real = (segment_ids != 0).astype(F32)
        z_loss = (sum(jnp.sum(z * real) for z in z_terms) / (len(z_terms) * jnp.maximum(jnp.sum(real), 1.0))
                  if z_terms else jnp.zeros((), F32))
        used = jnp.stack(experts, axis=2) if experts else None
        own = used
        if routed_experts is not None and experts:  # what each router would have chosen itself
            own = jnp.stack([jax.lax.top_k(p, c.num_experts_per_tok)[1] for p in probs], axis=2).astype(jnp.int32)
        return DecoderOutput(hidden, aux_loss, new_cache, used, activations, own, z_loss)

    def _scan_blocks(self, h, positions, segment_ids, routed_experts, capture):
        """The full forward's blocks as one ``lax.scan`` over their weights stacked on a leading layer
        axis (``ModelConfig.scan_layers``, MaxText's ``scan_layers``): XLA compiles one block body, so
        compile time and the compiler's memory no longer grow with depth. The stacking copies the
        blocks' weights once per forward (and their gradient once per backward), the matrices in the
        compute dtype (`stack_blocks`: a 30B-A3B train step needed 14.7 GiB less per H100); the parameter tree
        stays per layer, so checkpoints, weight pushes and HF loading do not change.
        Returns (h, (probs, experts, z terms) each stacked [L, ...] or None, (attn, mlp, out) stacked
        [L, B, T, D] when ``capture`` else None)."""
        graphdef, stacked = stack_blocks(self.layers, self.config.compute_dtype)
        routes = None if routed_experts is None else jnp.moveaxis(routed_experts, 2, 0)  # [L, B, T, k]

        def body(h, layer):
            state, layer_routes = layer
            h, _, (attn_out, mlp_out), routing = nnx.merge(graphdef, state)(
                h, positions, segment_ids, routes=layer_routes)
            return h, (routing, (attn_out, mlp_out, h) if capture else None)

        if self.config.remat != "none":
            body = jax.checkpoint(body, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False)
        h, (routings, captured) = jax.lax.scan(body, h, (stacked, routes))
        return h, routings, captured

    def head(self, hidden: jax.Array) -> jax.Array:
        """Full logits [..., V] float32 from final hidden states (compute-dtype inputs, f32 accumulation).
        For a few positions (decode) or tests; training uses `token_logprobs`."""
        dtype = self.config.compute_dtype
        return jnp.einsum("...d,dv->...v", hidden.astype(dtype), self.lm_head_weight().astype(dtype),
                          preferred_element_type=F32)

    def logits(self, input_ids, positions, segment_ids=None) -> jax.Array:
        """[B, T, V] float32 logits of the full forward (small models and tests only)."""
        return self.head(self(input_ids, positions, segment_ids).hidden)

    def token_logprobs(self, input_ids, positions, segment_ids, targets, *, chunk_size: int = 1024,
                       vocab_chunk_size: int | None = 16384, routed_experts: jax.Array | None = None):
        """log p(targets) and next-token entropy, each [B, T] float32, via the chunked LM head
        (`jaxrl.models.lm_head`, each device on its own tokens), plus the DecoderOutput;
        ``routed_experts`` as in ``__call__`` (routing replay)."""
        out = self(input_ids, positions, segment_ids, routed_experts=routed_experts)
        dtype = self.config.compute_dtype
        logp, entropy = sharded_token_logprobs_and_entropy(
            out.hidden.astype(dtype), self.lm_head_weight(), targets, compute_dtype=dtype,
            chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
        return logp, entropy, out
