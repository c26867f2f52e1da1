"""Hugging Face checkpoint load/save: round trips, transformers re-loading our files, bad checkpoints."""

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl.models import MeshConfig, load_hf_checkpoint, make_mesh, save_hf_checkpoint
from models_reference import padded_batch, qwen3_config, qwen3_moe_config, random_model, reference_logits

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

FSDP = ("fsdp", "sequence")  # the "embed" rule: parameters shard over fsdp and context-parallel devices


def read_tensors(folder):
    tensors = {}
    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), framework="numpy") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def assert_same_tensors(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("hf_config", [qwen3_config(tie=True), qwen3_moe_config()], ids=["qwen3-tied", "qwen3-moe"])
def test_save_load_save_is_bit_identical_and_transformers_reloads_it(tmp_path, hf_config):
    reference = random_model(hf_config, seed=1)
    reference.save_pretrained(tmp_path / "hf")
    save_hf_checkpoint(load_hf_checkpoint(str(tmp_path / "hf")), str(tmp_path / "a"))
    save_hf_checkpoint(load_hf_checkpoint(str(tmp_path / "a")), str(tmp_path / "b"))
    first, second = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert_same_tensors(first, second)
    original = read_tensors(tmp_path / "hf")
    if hf_config.tie_word_embeddings:
        original.pop("lm_head.weight", None)  # we do not write the tied copy
    assert_same_tensors(first, original)
    with open(tmp_path / "a" / "config.json") as f:
        assert json.load(f)["architectures"] == reference.config.architectures
    reloaded = type(reference).from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    ids, mask, positions = padded_batch()
    torch.testing.assert_close(reference_logits(reloaded, ids, mask, positions).logits,
                               reference_logits(reference, ids, mask, positions).logits, rtol=0, atol=0)


def test_bfloat16_round_trip_and_sharded_index(tmp_path):
    reference = random_model(qwen3_moe_config(), seed=2).to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    model = load_hf_checkpoint(str(tmp_path / "hf"))
    assert model.config.param_dtype == "bfloat16" and model.embed[...].dtype == jax.numpy.bfloat16
    save_hf_checkpoint(model, str(tmp_path / "a"))
    assert_same_tensors(read_tensors(tmp_path / "a"), read_tensors(tmp_path / "hf"))


def test_load_onto_a_mesh_shards_parameters(tmp_path):
    random_model(qwen3_moe_config(), seed=3).save_pretrained(tmp_path)
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    model = load_hf_checkpoint(str(tmp_path), mesh=mesh)
    single = load_hf_checkpoint(str(tmp_path))
    gate = model.layers[0].mlp.gate_proj[...]  # [E, D, I]: expert, embed, expert_mlp
    assert gate.sharding.spec == jax.sharding.PartitionSpec("expert", FSDP, "tensor")
    assert gate.addressable_shards[0].data.shape == (4, 18, 8)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(single.layers[0].mlp.gate_proj[...]))


def test_other_architecture_is_named(tmp_path):
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama.*LlamaForCausalLM"):
        load_hf_checkpoint(str(tmp_path))


def test_unknown_and_missing_tensors_are_named(tmp_path):
    random_model(qwen3_config(tie=False)).save_pretrained(tmp_path / "hf")
    tensors = read_tensors(tmp_path / "hf")
    for folder, change, pattern in (
            ("extra", lambda t: t.update(stray=np.zeros(3, np.float32)), "stray"),
            ("missing", lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"),
             r"model\.layers\.1\.self_attn\.k_norm"),
            ("shape", lambda t: t.update({"model.norm.weight": np.ones(5, np.float32)}),
             r"model\.norm\.weight.*\(5,\)")):
        os.makedirs(tmp_path / folder)
        os.link(tmp_path / "hf" / "config.json", tmp_path / folder / "config.json")
        changed = dict(tensors)
        change(changed)
        save_file(changed, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=pattern):
            load_hf_checkpoint(str(tmp_path / folder))


@pytest.mark.parametrize("hf_config,dtype", [(qwen3_config(tie=True), torch.float32),
                                             (qwen3_moe_config(), torch.bfloat16)],
                         ids=["qwen3-tied", "qwen3-moe-bf16"])
def test_in_memory_push_hands_over_the_checkpoint_tensors(tmp_path, hf_config, dtype):
    """The in-memory SGLang push copies host views of the parameters (``hf_tensor_stream``, mostly
    transposed) straight into its shared buffers and hands them over in chunks: what a server
    reads back from all chunks is transformers' own saved tensors, bit for bit, in either dtype,
    each once; every chunk but the last holds at least the chunk size, and only the last says so."""
    from jaxrl.models.hf import hf_tensor_stream
    from jaxrl.rollout.sglang.tensors import SharedTensors, read_payload

    chunk_bytes = 6000

    def handed(views):
        chunks = [(read_payload(shared.payload(names)), last) for names, last in shared.chunks(views, chunk_bytes)]
        assert [last for _, last in chunks] == [False] * (len(chunks) - 1) + [True]
        sizes = [sum(t.nbytes for t in tensors.values()) for tensors, _ in chunks]
        assert len(chunks) > 2 and min(sizes[:-1]) >= chunk_bytes, sizes
        merged = {name: t for tensors, _ in chunks for name, t in tensors.items()}
        assert len(merged) == sum(len(tensors) for tensors, _ in chunks)  # each tensor once
        return merged

    random_model(hf_config, seed=4).to(dtype).save_pretrained(tmp_path)
    original = read_tensors(tmp_path)
    if hf_config.tie_word_embeddings:
        original.pop("lm_head.weight", None)  # we do not write the tied copy
    shared = SharedTensors()
    model = load_hf_checkpoint(str(tmp_path))
    assert_same_tensors(handed(hf_tensor_stream(model)), original)
    # The buffers are rewritten in place by the next push: another model's tensors replace these.
    random_model(hf_config, seed=5).to(dtype).save_pretrained(tmp_path / "other")
    assert_same_tensors(handed(hf_tensor_stream(load_hf_checkpoint(str(tmp_path / "other")))),
                        {k: v for k, v in read_tensors(tmp_path / "other").items() if k in original})
