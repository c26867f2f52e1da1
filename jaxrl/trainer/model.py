"""The learner both trainers start from: the policy's Decoder, sharded on the mesh."""

from __future__ import annotations

import jax
from flax import nnx

from jaxrl.models import Decoder, create_sharded_model, load_hf_checkpoint


def build_model(policy, mesh: jax.sharding.Mesh) -> Decoder:
    """The learner's Decoder, sharded on ``mesh``: from ``policy.hf_path`` or a random init."""
    if policy.hf_path:
        return load_hf_checkpoint(policy.hf_path, mesh=mesh, **policy.overrides())
    config = policy.architecture.replace(**policy.overrides())
    model, _ = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(policy.init_seed)), mesh)
    return model
