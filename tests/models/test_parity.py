"""Logits, logprobs, entropy and MoE aux loss against transformers' PyTorch Qwen3 / Qwen3-MoE."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, load_hf_checkpoint, make_mesh
from jaxrl.models import megablox
from jaxrl.models.moe import GroupedMatmul
from models_reference import padded_batch, qwen3_config, qwen3_moe_config, random_model, reference_logits

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

TOL = 1e-5


def load_pair(tmp_path, hf_config, seed=0):
    reference = random_model(hf_config, seed)
    reference.save_pretrained(tmp_path)
    return reference, load_hf_checkpoint(str(tmp_path))


@nnx.jit
def _forward(model, ids, positions, segment_ids):
    out = model(ids, positions, segment_ids)
    return model.head(out.hidden), out


def our_logits(model, ids, positions, segment_ids):
    logits, out = _forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segment_ids))
    return np.asarray(logits), out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("left", [True, False])
def test_qwen3_logits_match_transformers(tmp_path, tie, left):
    reference, model = load_pair(tmp_path, qwen3_config(tie=tie))
    assert model.config.tie_word_embeddings == tie and (model.lm_head is None) == tie
    ids, mask, positions = padded_batch(left=left)
    expected = reference_logits(reference, ids, mask, positions).logits.numpy()
    logits, _ = our_logits(model, ids, positions, mask)
    assert np.abs(logits - expected)[mask == 1].max() < TOL


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_logits_and_aux_loss_match_transformers(tmp_path, norm_topk_prob):
    reference, model = load_pair(tmp_path, qwen3_moe_config(norm_topk_prob=norm_topk_prob))
    assert model.config.mlp_types == ("moe", "dense")
    ids, mask, positions = padded_batch(left=True)
    ref = reference_logits(reference, ids, mask, positions, output_router_logits=True)
    logits, out = our_logits(model, ids, positions, mask)
    assert np.abs(logits - ref.logits.numpy())[mask == 1].max() < TOL
    assert abs(float(out.aux_loss) - float(ref.aux_loss)) < 1e-5
    # routed experts equal torch.topk of the reference router's softmax
    router_logits = ref.router_logits[0].reshape(*ids.shape, -1)
    expected = torch.topk(torch.softmax(router_logits, -1), 3, dim=-1).indices.numpy()
    assert out.routed_experts.shape == (*ids.shape, 1, 3)
    np.testing.assert_array_equal(np.asarray(out.routed_experts)[:, :, 0][mask == 1], expected[mask == 1])


def test_packed_segments_equal_separate_sequences(tmp_path):
    """Two sequences packed in one row (segment ids 1, 2, positions restarting) give the logits
    transformers gives for each sequence on its own."""
    reference, model = load_pair(tmp_path, qwen3_moe_config())
    rng = np.random.default_rng(3)
    first, second = rng.integers(0, 128, 5), rng.integers(0, 128, 4)
    ids = np.concatenate([first, second])[None]
    segments = np.array([[1] * 5 + [2] * 4])
    positions = np.array([list(range(5)) + list(range(4))])
    logits, _ = our_logits(model, ids, positions, segments)
    for seq, cols in ((first, slice(0, 5)), (second, slice(5, 9))):
        n = len(seq)
        expected = reference_logits(reference, seq[None], np.ones((1, n), np.int64), np.arange(n)[None]).logits
        assert np.abs(logits[:, cols] - expected.numpy()).max() < TOL


def test_token_logprobs_and_entropy_match_transformers(tmp_path):
    reference, model = load_pair(tmp_path, qwen3_config(tie=False))
    ids, mask, positions = padded_batch(left=True)
    targets = np.roll(ids, -1, axis=1)
    ref = torch.log_softmax(reference_logits(reference, ids, mask, positions).logits.double(), -1)
    expected_logp = torch.gather(ref, -1, torch.tensor(targets)[..., None])[..., 0].numpy()
    expected_entropy = -(ref.exp() * ref).sum(-1).numpy()
    logprobs = nnx.jit(lambda m, *args: m.token_logprobs(*args, chunk_size=7, vocab_chunk_size=48))
    logp, entropy, out = logprobs(model, *map(jnp.asarray, (ids, positions, mask, targets)))
    assert logp.dtype == jnp.float32 and logp.shape == ids.shape
    assert np.abs(np.asarray(logp) - expected_logp)[mask == 1].max() < TOL
    assert np.abs(np.asarray(entropy) - expected_entropy)[mask == 1].max() < TOL
    assert out.hidden.shape == (*ids.shape, 36)


@pytest.fixture(scope="module")
def moe_block():
    config = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_types=("moe",), num_experts=6, num_experts_per_tok=3,
                         moe_intermediate_size=8)
    return create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(0)), make_mesh(MeshConfig()))[0].layers[0].mlp


def test_topk_ties_pick_lower_expert_index(moe_block):
    """All-zero router weights make every expert equally likely: the k chosen are 0..k-1, with equal weights."""
    router = moe_block.router[...]
    moe_block.router[...] = jnp.zeros_like(router)
    probs, weights, experts = nnx.jit(lambda m, x: m.route(x))(moe_block, jnp.ones((5, 32)))
    moe_block.router[...] = router
    np.testing.assert_array_equal(np.asarray(experts), np.tile([0, 1, 2], (5, 1)))
    np.testing.assert_allclose(np.asarray(weights), 1 / 3, rtol=1e-6)


def _grouped_case():
    """Uneven and empty groups plus 4 rows past the groups' total (other devices' assignments under
    expert parallelism): (group sizes, lhs, rhs, float64 per-row reference with zeros for those rows)."""
    rng = np.random.default_rng(0)
    sizes = np.array([5, 0, 17, 1, 0, 9], np.int32)
    rows = int(sizes.sum()) + 4
    lhs = rng.standard_normal((rows, 12)).astype(np.float32)
    rhs = rng.standard_normal((6, 12, 7)).astype(np.float32)
    expert_of_row = np.repeat(np.arange(6), sizes)
    expected = np.einsum("rk,rkn->rn", lhs[:-4].astype(np.float64), rhs[expert_of_row].astype(np.float64))
    return sizes, lhs, rhs, np.concatenate([expected, np.zeros((4, 7))])


@pytest.mark.parametrize("impl", ["ragged_dot", "blocked"])
def test_grouped_matmul_matches_per_row_reference(impl):
    """Each row multiplies its own expert's weight, on both CPU-runnable paths; rows past the groups give 0."""
    sizes, lhs, rhs, expected = _grouped_case()
    grouped = GroupedMatmul(jnp.asarray(sizes), lhs.shape[0], jnp.float32, impl=impl)
    np.testing.assert_allclose(np.asarray(jax.jit(grouped.__call__)(lhs, rhs)), expected, atol=1e-5, rtol=0)


def test_blocked_matmul_in_groups_equals_all_blocks_at_once(monkeypatch):
    """Past ``GATHER_BYTES`` of gathered expert weights the blocks run in groups (lax.map, the backward
    gathering again): forward, input and weight gradients equal the one-einsum path's; rows past the
    groups still give 0."""
    from jaxrl.models import moe

    sizes, lhs, rhs, expected = _grouped_case()
    cotangent = np.random.default_rng(2).standard_normal(expected.shape).astype(np.float32)

    def value_and_grads():
        blocked = GroupedMatmul(jnp.asarray(sizes), lhs.shape[0], jnp.float32, impl="blocked")
        assert blocked.padded_rows // blocked.block > 3  # several groups of 3 blocks and a remainder
        out = jax.jit(blocked.__call__)(lhs, rhs)
        grads = jax.jit(jax.grad(lambda a, b: jnp.sum(blocked(a, b) * cotangent), argnums=(0, 1)))(lhs, rhs)
        return out, grads

    at_once, at_once_grads = value_and_grads()
    monkeypatch.setattr(moe, "GATHER_BYTES", 3 * 12 * 7 * 4)  # three blocks' float32 [12, 7] weights
    grouped, grouped_grads = value_and_grads()
    np.testing.assert_allclose(np.asarray(grouped), expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(at_once), atol=1e-6, rtol=0)
    for got, want in zip(grouped_grads, at_once_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_megablox_gmm_matches_reference_and_blocked_gradients():
    """The TPU kernel (Pallas interpreter on CPU): the per-row reference forward, zeros past the groups
    although the kernel leaves those rows unwritten, and the blocked path's input and weight gradients."""
    sizes, lhs, rhs, expected = _grouped_case()
    gmm = functools.partial(megablox.grouped_matmul, group_sizes=jnp.asarray(sizes), interpret=True)
    np.testing.assert_allclose(np.asarray(jax.jit(gmm)(lhs, rhs)), expected, atol=1e-5, rtol=0)
    blocked = GroupedMatmul(jnp.asarray(sizes), lhs.shape[0], jnp.float32, impl="blocked")
    cotangent = np.random.default_rng(1).standard_normal(expected.shape).astype(np.float32)

    def grads(f):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * cotangent), argnums=(0, 1)))(lhs, rhs)
    for got, want in zip(grads(gmm), grads(blocked.__call__), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_moe_compiled_flops_scale_with_k_over_e(moe_block):
    """The MoE layer's compiled FLOPs are about k/E of running every token through every expert
    (E=6, k=3 here: 0.5 plus block padding); a dense all-experts computation would give >= 1."""
    x = jnp.ones((4, 96, 32))
    moe_flops = jax.jit(lambda x: moe_block(x)[0]).lower(x).compile().cost_analysis()["flops"]
    weights = [moe_block.gate_proj[...], moe_block.up_proj[...], moe_block.down_proj[...]]

    def all_experts(x, gate, up, down):
        h = jax.nn.silu(jnp.einsum("td,edi->tei", x, gate)) * jnp.einsum("td,edi->tei", x, up)
        return jnp.einsum("tei,eid->td", h, down)
    dense_flops = jax.jit(all_experts).lower(x.reshape(-1, 32), *weights).compile().cost_analysis()["flops"]
    assert moe_flops / dense_flops < 0.75
