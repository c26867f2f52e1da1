"""Random ``jaxrl.models.Decoder`` checkpoints for SGLang tests and benchmarks (no model hub here)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, save_hf_checkpoint


def random_decoder(config: ModelConfig, seed: int = 0, matrix_scale: float = 10.0) -> Decoder:
    """A ``Decoder`` with random weights; matrices scaled by ``matrix_scale``.

    The default init is so small that every next-token distribution is nearly
    uniform, where raw, temperature-scaled and filtered logprobs can hardly be
    told apart; scaled-up matrices give peaked, varied distributions.
    """
    model = Decoder(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * matrix_scale if x.ndim > 1 else x, state))
    return model


def write_random_checkpoint(path: str, config: ModelConfig, seed: int = 0, matrix_scale: float = 10.0) -> Decoder:
    """Writes ``random_decoder(config, seed, matrix_scale)`` as an HF checkpoint to ``path``; returns it."""
    model = random_decoder(config, seed, matrix_scale)
    save_hf_checkpoint(model, path)
    return model
