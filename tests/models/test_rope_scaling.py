"""rope_scaling (yarn, linear, llama3) against transformers: the tables, logits past the pretrained window, the
config.json round trip and the errors that name the key (the embedded sampler against the learner with YaRN:
tests/rollout/test_sampler.py)."""

import json
import os

import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxrl.config import ConfigError, load_config
from jaxrl.models import ModelConfig, load_hf_checkpoint, save_hf_checkpoint
from jaxrl.models.rope import RopeScaling, rope_tables
from jaxrl.trainer.config import TrainConfig
from models_reference import VOCAB, forward, qwen3_config, random_model, reference_logits

pytestmark = pytest.mark.fully_optimised  # compared with transformers at float32 rounding (conftest.py)

WINDOW, LENGTH = 32, 96  # the tiny model's pretrained window and the sequences run past it
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The logits cases: rope_theta 100 (not 10,000) puts several of head_dim 10's five frequencies inside YaRN's ramp
# and llama3's blend at a window of 32, so those branches are exercised, not only their ends.
LOGITS_CASES = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}, 10000.0),
    "yarn-ramp-mscale": ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": WINDOW,
                          "beta_fast": 8.0, "beta_slow": 0.25, "mscale": 1.0, "mscale_all_dim": 0.5,
                          "truncate": False}, 100.0),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 10000.0),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": WINDOW,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 100.0),
}


def hf_rope_config(rope: dict, theta: float, **fields) -> transformers.Qwen3Config:
    return qwen3_config(tie=False, max_position_embeddings=LENGTH + 32,
                        rope_parameters={**rope, "rope_theta": theta}, **fields)


@pytest.mark.parametrize("rope,theta,head_dim,partial", [
    # Qwen3's own 128K recipe: head_dim 128, theta 1e6, yarn 4 x 32,768
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1e6, 128, 1.0),
    ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
      "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False}, 1e4, 64, 1.0),
    # Qwen3-Next's partial rotary: the ramp over the 64 rotated features only
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536}, 1e7, 256, 0.25),
    ({"rope_type": "linear", "factor": 2.5}, 1e6, 128, 1.0),
    # Llama 3.1's rope_scaling
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0}, 500000.0, 128, 1.0),
], ids=["qwen3-yarn", "yarn-all-keys", "partial-yarn", "linear", "llama3"])
def test_tables_equal_transformers(rope, theta, head_dim, partial):
    hf = transformers.Qwen3Config(head_dim=head_dim, max_position_embeddings=2 * 32768, partial_rotary_factor=partial,
                                  rope_parameters={**rope, "rope_theta": theta})
    expected_freq, expected_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    scaling = RopeScaling.from_hf(rope, "rope_parameters", 2 * 32768)
    inv_freq, factor = rope_tables(int(head_dim * partial), theta, scaling)
    np.testing.assert_allclose(np.asarray(inv_freq), expected_freq.numpy(), rtol=2e-7, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)
    assert not np.allclose(inv_freq, rope_tables(int(head_dim * partial), theta, None)[0])  # it does scale


@pytest.mark.parametrize("case", LOGITS_CASES)
def test_logits_past_the_window_equal_transformers(tmp_path, case):
    rope, theta = LOGITS_CASES[case]
    reference = random_model(hf_rope_config(rope, theta))
    reference.save_pretrained(tmp_path)
    model = load_hf_checkpoint(str(tmp_path))
    assert model.config.rope_scaling == RopeScaling(**rope)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(2, LENGTH))
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: its positions count from its first token
    positions = np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 1)
    expected = reference_logits(reference, ids, mask, positions).logits.numpy()
    logits = np.asarray(forward(model, ids, positions, mask))
    past = (mask == 1) & (positions >= WINDOW)
    assert past.sum() > 100
    assert np.abs(logits - expected)[mask == 1].max() < 1e-5
    # the scaling changes the logits past the window well beyond that tolerance: the comparison can fail
    plain = random_model(qwen3_config(tie=False, max_position_embeddings=LENGTH + 32,
                                      rope_parameters={"rope_type": "default", "rope_theta": theta}))
    unscaled = reference_logits(plain, ids, mask, positions).logits.numpy()
    assert np.abs(unscaled - expected)[past].max() > 1e-2


def test_checkpoint_round_trip_keeps_the_scaling(tmp_path):
    """An older checkpoint's rope_scaling (key `type`, `original_max_position_embeddings` left to its default)
    is read, written back as transformers 5's rope_parameters, and read alike by jaxrl and transformers."""
    random_model(hf_rope_config({"rope_type": "default"}, 10000.0)).save_pretrained(tmp_path / "old")
    with open(tmp_path / "old" / "config.json") as f:
        old = json.load(f)
    old.pop("rope_parameters")
    old.update(rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 16})
    with open(tmp_path / "old" / "config.json", "w") as f:
        json.dump(old, f)
    model = load_hf_checkpoint(str(tmp_path / "old"))
    assert model.config.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=LENGTH + 32,
                                                    beta_fast=16)
    save_hf_checkpoint(model, str(tmp_path / "new"))
    with open(tmp_path / "new" / "config.json") as f:
        saved = json.load(f)
    assert saved["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": LENGTH + 32, "beta_fast": 16}
    assert ModelConfig.from_hf(saved) == model.config
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "new").rope_parameters
    assert {k: theirs[k] for k in saved["rope_parameters"]} == saved["rope_parameters"]


def test_yaml_sets_the_scaling_through_the_config_loader():
    yarn = ["model.architecture.rope_scaling.rope_type=yarn", "model.architecture.rope_scaling.factor=4",
            "model.architecture.rope_scaling.original_max_position_embeddings=16"]
    config = load_config(TrainConfig, os.path.join(REPO, "configs", "demo_sft.yaml"), yarn)
    assert config.model.architecture.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=16)


@pytest.mark.parametrize("change,message", [
    (["factor=0.5"], "model.architecture.rope_scaling.factor=0.5 must be a number >= 1"),
    (["rope_type=dynamic"], "rope_type='dynamic' must be one of .*'yarn'.*dynamic is refused: its frequencies depend"),
    (["rope_type=longrope"], "rope_type='longrope' must be one of"),
    (["original_max_position_embeddings=null"], "original_max_position_embeddings=None must be given for rope_type"),
    (["beta_fast=0.5"], r"beta_fast=0.5 must be >= beta_slow \(1\)"),
    (["low_freq_factor=1"], "low_freq_factor=1.0 must be left out: rope_type yarn reads only"),
    (["rope_type=llama3", "low_freq_factor=4", "high_freq_factor=1"], "high_freq_factor=1.0 must be > low_freq"),
    (["attention_factor=1.2"], "unknown key model.architecture.rope_scaling.attention_factor"),
])
def test_bad_values_name_the_key(change, message):
    keys = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 16}
    keys.update(item.split("=") for item in change)
    overrides = [f"model.architecture.rope_scaling.{k}={v}" for k, v in keys.items()]
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, os.path.join(REPO, "configs", "demo_sft.yaml"), overrides)


@pytest.mark.parametrize("rope,message", [
    ({"type": "dynamic", "factor": 2.0}, r"config.json rope_scaling.rope_type='dynamic' must be one of"),
    ({"rope_type": "yarn"}, "config.json rope_scaling.factor=None must be given for rope_type yarn"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.9},
     "config.json rope_scaling.attention_factor is not supported: SGLang ignores it"),
    ({"rope_type": "linear", "factor": -2}, r"config.json rope_scaling.factor=-2 must be a number >= 1"),
])
def test_bad_checkpoint_scaling_is_named(rope, message):
    hf = {**ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                        head_dim=8).to_hf(), "rope_scaling": rope}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf)
