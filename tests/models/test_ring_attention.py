"""Ring attention (`context_parallel: ring`, docs/models.md#context-parallelism) on 8 CPU devices against
one device's `xla` attention: the kernel with packed rows and padding, values and gradients; the full
forward and gradients of a softmax decoder and of a hybrid one (softmax, lightning, gated DeltaNet, MoE
layers, the linear ones on Ulysses) over meshes sequence=8 and tensor=2 x sequence=4 (heads sharded by
`tensor`, the ring over `sequence`); the zig-zag split's load balance and its layout moves; the switch.

float32, tolerance 1e-5 of each array's largest magnitude as in tests/models/test_context_parallel.py
(the ring sums the softmax over the shards' key blocks in another order than one device's einsum).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_context_parallel import DENSE, HYBRID, assert_close, packed_batch, randomize

from jaxrl.models import Decoder, MeshConfig, make_mesh, ring, shard_model
from jaxrl.models import context_parallel as cp
from jaxrl.models.attention import xla_attention

MESHES = {"sp8": MeshConfig(sequence=8), "tp2-sp4": MeshConfig(tensor=2, sequence=4)}


def ring_plan(mesh, length=32):
    with jax.set_mesh(mesh):
        return cp.plan("ring", 2, length)


def attention_inputs(batch=4, length=32, kv_heads=2, groups=2, dim=8):
    """Random q/k/v [B, T, ...] and the packed segment ids of test_context_parallel's rows (padding first,
    between and after segments; segments crossing the shards)."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, length, kv_heads, groups, dim), jnp.float32)
    k, v = (jax.random.normal(key, (batch, length, kv_heads, dim), jnp.float32) for key in keys[1:])
    return q, k, v, packed_batch()[2]


def weighted_sum(attend, weights, q, k, v, slots, segment_ids):
    """(sum of the real queries' outputs times `weights`, the outputs) of `attend(q, k, v, slots, ...)`;
    padded queries' outputs are never used."""
    out = attend(q, k, v, slots, slots, segment_ids, segment_ids)
    return jnp.sum(jnp.where((segment_ids != 0)[:, :, None, None, None], out * weights, 0.0)), out


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_ring_attention_equals_one_device(mesh_name):
    """The kernel on its zig-zag layout (columns permuted here with numpy, slots = row positions) against
    `xla_attention` on the row: the real queries' outputs and the gradients of q, k, v."""
    q, k, v, segment_ids = attention_inputs()
    batch, length = segment_ids.shape
    slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    weights = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    xla = functools.partial(xla_attention, scale=0.3, dtype=jnp.float32)
    gradient = jax.value_and_grad(weighted_sum, argnums=(2, 3, 4), has_aux=True)
    (_, want_out), want = jax.jit(functools.partial(gradient, xla))(weights, q, k, v, slots, segment_ids)

    mesh = make_mesh(MESHES[mesh_name])
    plan = ring_plan(mesh)
    order = cp.column_positions(plan, length)
    assert sorted(order) == list(range(length)) and list(order) != list(range(length))
    ringed = functools.partial(ring.ring_attention, plan=plan, impl="xla", scale=0.3, dtype=jnp.float32,
                               block_size=8)
    with jax.set_mesh(mesh):
        (_, got_out), got = jax.jit(functools.partial(gradient, ringed))(
            *(x[:, order] for x in (weights, q, k, v, slots, segment_ids)))
    in_row_order = np.argsort(order)
    real = np.asarray(segment_ids != 0)[:, :, None, None, None]
    assert_close(np.where(real, np.asarray(got_out)[:, in_row_order], 0), np.where(real, want_out, 0))
    for have, expected in zip(got, want, strict=True):
        assert_close(np.asarray(have)[:, in_row_order], expected)


# Small to compile fast: one softmax layer of 4 query heads on 2 key/value heads, fewer than the 8 sequence
# shards (Ulysses would repeat and pad heads); a lightning layer (its state runs along the row, so it fails
# unless Ulysses puts the columns back in row order) with a MoE block (its routes come back through the
# layout move) before a softmax one. Gated DeltaNet runs the same Ulysses path (test_context_parallel).
MODELS = {"softmax": DENSE.replace(num_layers=1, num_heads=4, layer_types=("full_attention",), mlp_types=("dense",)),
          "hybrid": HYBRID.replace(num_layers=2, layer_types=("lightning_attention", "full_attention"),
                                   mlp_types=("moe", "dense"))}


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request):
    """The model's one-device logits, gradients and routes on packed, padded rows (`xla` attention)."""
    config = MODELS[request.param]
    model = randomize(Decoder(config.replace(attention_impl="xla"), rngs=nnx.Rngs(1)), seed=2)
    batch = packed_batch()
    outputs, grads = nnx.jit(loss_and_grads)(model, *batch)
    return config, model, batch, jax.tree.map(np.asarray, outputs), jax.tree.map(np.asarray, grads)


def loss_and_grads(model, ids, positions, segment_ids):
    """((logits, routes), gradients) of next-token NLL over the real tokens plus the load-balancing loss."""
    def loss(model):
        out = model(ids, positions, segment_ids)
        logits = model.head(out.hidden)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.roll(ids, -1, axis=1)[..., None], axis=-1)[..., 0]
        mask = (segment_ids != 0).astype(jnp.float32)
        return -jnp.sum(logp * mask) / jnp.sum(mask) + 0.1 * out.aux_loss, (logits, out.routed_experts)

    (_, outputs), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return outputs, nnx.state(grads)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_ring_decoder_forward_and_gradients_equal_one_device(reference, mesh_name, monkeypatch):
    config, model, batch, (logits, routes), grads = reference
    ringed = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Decoder(config.replace(context_parallel="ring"),
                                                                  rngs=nnx.Rngs(0)))),
                       nnx.state(nnx.clone(model)))
    mesh = make_mesh(MESHES[mesh_name])
    sharded, _ = shard_model(ringed, mesh)
    rings, original = [], ring.ring_attention
    monkeypatch.setattr(ring, "ring_attention", lambda *a, **k: rings.append(1) or original(*a, **k))
    with jax.set_mesh(mesh):
        (got_logits, got_routes), got_grads = nnx.jit(loss_and_grads)(sharded, *batch)
    assert rings == [1]  # the softmax layer ran the ring
    assert np.abs(logits).max() > 1.0
    assert_close(got_logits, logits)
    np.testing.assert_array_equal(got_routes, routes)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    for path, have, want in zip(paths, jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
        assert np.abs(want).max() > 0, path
        assert_close(have, want)


def causal_work(order: np.ndarray, shards: int) -> np.ndarray:
    """Per shard, the (query, key) pairs under the causal mask of the queries it holds: a query at row
    position p sees p + 1 keys."""
    return np.sum(order.reshape(shards, -1) + 1, axis=1)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_split_gives_every_shard_the_same_causal_work(shards):
    mesh = make_mesh(MeshConfig(sequence=shards))
    for length in (2 * shards, 64 * shards):
        order = cp.column_positions(ring_plan(mesh, length), length)
        work = causal_work(order, shards)
        assert np.abs(work - work.mean()).max() <= 0.1 * work.mean(), work
        contiguous = causal_work(np.arange(length), shards)  # what the split is for: this fails the bound
        assert np.abs(contiguous - contiguous.mean()).max() > 0.1 * contiguous.mean()


def test_layout_moves_are_the_zigzag_permutation_and_its_inverse():
    mesh = make_mesh(MeshConfig(data=2, sequence=4))
    x = jnp.arange(4 * 32 * 3).reshape(4, 32, 3)
    plan = ring_plan(mesh)
    with jax.set_mesh(mesh):
        there = jax.jit(lambda x: ring.to_ring_layout(x, plan))(x)
        back = jax.jit(lambda x: ring.from_ring_layout(x, plan))(there)
    np.testing.assert_array_equal(there, np.asarray(x)[:, cp.column_positions(plan, 32)])
    np.testing.assert_array_equal(back, x)


def test_switch():
    with jax.set_mesh(make_mesh(MeshConfig(sequence=8))):
        assert cp.plan("ring", 2, 32) == cp.Plan(("sequence",), ("tensor",), 8, 8, ring=True)
        assert not cp.plan("auto", 2, 32).ring  # auto stays Ulysses
        with pytest.raises(ValueError, match=r"context_parallel = 'ring'.*must divide 2 chunks of the sequence "
                                             r"length 40"):
            cp.plan("ring", 2, 40)  # 8 shards divide 40 but not into 16 chunks
    with jax.set_mesh(make_mesh(MeshConfig(data=8))):
        with pytest.raises(ValueError, match=r"'ring' passes keys and values .* needs mesh.sequence > 1"):
            cp.plan("ring", 8, 32)
    with pytest.raises(ValueError, match="context_parallel = 'ring' needs a mesh"):
        cp.plan("ring", 2, 32)
    assert [cp.chunks_per_shard(mode) for mode in ("auto", "ulysses", "ring")] == [1, 1, 2]
    assert DENSE.replace(context_parallel="ring").context_parallel == "ring"
