"""Localisation: an injected perturbation of one layer's weights in one path is found at that layer."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.align.localize import compare_activations, decode_activations, hf_activations, prefill_activations
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.sharding import MeshConfig, make_mesh

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8, max_position_embeddings=128, rope_theta=10000.0)
IDS = np.random.default_rng(0).integers(0, 64, (4, 12))


def perturbed(model, path, scale=1e-3, seed=1):
    """A copy of ``model`` with ``path`` (e.g. ("layers", 2, "mlp", "down_proj")) nudged by relative noise."""
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x, state)  # a new tree; arrays are immutable
    flat = dict(nnx.to_flat_state(state))
    value = np.asarray(flat[path][...])
    noise = np.random.default_rng(seed).standard_normal(value.shape).astype(value.dtype)
    flat[path][...] = value * (1 + scale * noise)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def reference(model):
    return prefill_activations(model, IDS)


@pytest.mark.parametrize("layer, module, path", [
    (2, "mlp", ("layers", 2, "mlp", "down_proj")),
    (1, "attn", ("layers", 1, "attn", "v_proj")),
])
def test_perturbed_layer_is_located_prefill_vs_prefill(model, reference, layer, module, path):
    other = prefill_activations(perturbed(model, path), IDS)
    loc = compare_activations(reference, other, rtol=1e-5, labels=("learner", "perturbed"))
    assert loc.first_divergence.name == f"layers.{layer}.{module}"
    assert loc.first_divergent_layer == layer
    assert not any(r.exceeds for r in loc.rows if r.layer is not None and r.layer < layer)
    assert [r.name for r in loc.rows][:2] == ["embed", "layers.0.attn"] and loc.rows[-1].name == "logits"


def test_prefill_vs_decode_residual_and_located_perturbation(model, reference, tmp_path):
    decode = decode_activations(model, IDS, prompt_length=4)
    loc = compare_activations(reference, decode, rtol=1e-5, labels=("prefill", "decode"))
    print("\n" + loc.table())
    # float32: decode differs from prefill by rounding only (shape-dependent matmul tiling);
    # measured rel <= ~5e-7 per module, well inside 1e-5.
    assert loc.first_divergence is None
    assert max(r.rel_diff for r in loc.rows) < 1e-5
    bad = decode_activations(perturbed(model, ("layers", 3, "mlp", "gate_proj")), IDS, prompt_length=4)
    assert compare_activations(reference, bad, rtol=1e-5).first_divergence.name == "layers.3.mlp"
    path = loc.plot(os.path.join(tmp_path, "localization.png"))
    assert os.path.getsize(path) > 5000


def test_prefill_vs_other_mesh_layout(model, reference):
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    sharded = prefill_activations(model, IDS, mesh=mesh)
    loc = compare_activations(reference, sharded, rtol=1e-5, labels=("1 device", "fsdp2 x tensor2"))
    print("\n" + loc.table())
    assert loc.first_divergence is None
    bad = prefill_activations(perturbed(model, ("layers", 1, "mlp", "up_proj")), IDS, mesh=mesh)
    assert compare_activations(reference, bad, rtol=1e-5).first_divergent_layer == 1


def test_learner_vs_transformers_reference(model, reference, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from jaxrl.models.hf import save_hf_checkpoint

    save_hf_checkpoint(model, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    loc = compare_activations(reference, hf_activations(hf, IDS), rtol=1e-4, labels=("jaxrl", "transformers"))
    print("\n" + loc.table())
    assert loc.first_divergence is None
    with torch.no_grad():
        hf.model.layers[2].self_attn.o_proj.weight.mul_(1.001)
    bad = compare_activations(reference, hf_activations(hf, IDS), rtol=1e-4)
    assert bad.first_divergence.name == "layers.2.attn"


def test_mismatched_captures_are_rejected(reference):
    partial = {k: v for k, v in reference.items() if k != "layers.1.mlp"}
    with pytest.raises(ValueError, match=r"b lacks modules \['layers.1.mlp'\]"):
        compare_activations(reference, partial)
