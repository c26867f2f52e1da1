"""ModelConfig validation and the transformers config.json translation."""

import pytest

from jaxrl.models import ModelConfig
from models_reference import qwen3_config, qwen3_moe_config

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8)


def test_defaults_fill_per_layer_kinds():
    config = ModelConfig(**BASE)
    assert config.layer_types == ("full_attention",) * 2 and config.mlp_types == ("dense",) * 2
    assert hash(config) == hash(ModelConfig(**BASE))


@pytest.mark.parametrize("changes,pattern", [
    (dict(num_heads=6, num_kv_heads=4), r"num_heads \(6\).*num_kv_heads \(4\)"),
    (dict(head_dim=7), r"head_dim.*7"),
    (dict(layer_types=("full_attention",)), r"layer_types has 1 entries.*num_layers=2"),
    (dict(layer_types=("full_attention", "mamba")), r"layer_types\[1\] = 'mamba'"),
    (dict(mlp_types=("dense", "moe")), r"num_experts=0"),
    (dict(mlp_types=("moe", "moe"), num_experts=4, moe_intermediate_size=8, num_experts_per_tok=5),
     r"num_experts_per_tok \(5\).*num_experts=4"),
    (dict(dtype="float16"), r"dtype = 'float16'"),
    (dict(remat="sometimes"), r"remat = 'sometimes'"),
    (dict(vocab_size=0), r"vocab_size.*0"),
])
def test_bad_configs_name_the_key_and_numbers(changes, pattern):
    with pytest.raises(ValueError, match=pattern):
        ModelConfig(**{**BASE, **changes})


@pytest.mark.parametrize("hf", [qwen3_config(tie=True), qwen3_moe_config(norm_topk_prob=False)], ids=["dense", "moe"])
def test_hf_config_round_trip(hf):
    hf_dict = hf.to_dict()
    hf_dict["architectures"] = ["Qwen3MoeForCausalLM" if hf.model_type == "qwen3_moe" else "Qwen3ForCausalLM"]
    config = ModelConfig.from_hf(hf_dict)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.rope_theta) == (6, 2, 10, 10000.0)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    if hf.model_type == "qwen3_moe":
        assert config.mlp_types == ("moe", "dense") and not config.norm_topk_prob
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 3, 16)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert type(hf).from_dict(config.to_hf()).to_dict()["num_key_value_heads"] == 2


def test_other_architecture_is_named():
    with pytest.raises(ValueError, match="'llama'.*LlamaForCausalLM"):
        ModelConfig.from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_decoder_maps_exactly_the_config_names():
    """ModelConfig validates names against its tuples; the decoder maps the same names to classes and policies."""
    from jaxrl.models import config, decoder

    assert tuple(decoder.ATTENTION_KINDS) == config.ATTENTION_KIND_NAMES
    assert tuple(decoder.REMAT_POLICIES) == config.REMAT_POLICY_NAMES

