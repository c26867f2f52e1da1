"""The value model (critic) of PPO with GAE: a decoder trunk and a scalar value head.

A separate network from the policy, as in verl and OpenRLHF (a critic model, not a head on the
policy's trunk): the trunk is the same :class:`~jaxrl.models.decoder.Decoder` (same
``ModelConfig``), typically initialised from the same weights as the policy, and the head maps
the trunk's final hidden state to one number,

    V[b, t] = hidden[b, t] @ w + c,    w: [D, 1] (logical axes ("embed", None)), c: [1]

in float32. The head starts at zero (``w = 0, c = 0``: every value is 0 before the first
update, and the trunk receives no gradient until the head has moved), so the critic begins as
the policy's features with an untrained read-out. The trunk's LM head is dropped when it is not
tied to the embedding: a critic produces no logits.

Alignment: ``values(input_ids, positions, segment_ids)`` gives the value of every position's
state, read from that position's hidden state, which has seen tokens ``0..t``. On the
trainers' next-token rows (column ``t`` holds input token ``t`` and scores target ``t + 1``)
``V[:, t]`` is therefore the value of the state *before the target of column t is generated*:
it lines up with ``targets[:, t]``, ``mask[:, t]`` and the logprob of that target, as verl's
critic reads ``values[:, -response_length - 1:-1]``.

Sharding follows the policy's rules (``jaxrl.models.sharding``): the trunk's parameters carry
their logical axes and the head's ``w`` shards its ``embed`` dimension like every other weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.decoder import Decoder

F32 = jnp.float32


class ValueModel(nnx.Module):
    """``trunk``: a Decoder (its own copy of the parameters); ``value_head`` [D, 1] and
    ``value_bias`` [1], zero-initialised in the trunk's parameter dtype."""

    def __init__(self, trunk: Decoder):
        if not isinstance(trunk, Decoder):
            raise TypeError(f"ValueModel needs a Decoder trunk, got {type(trunk).__name__}")
        c = trunk.config
        self.config = c
        self.trunk = trunk
        if trunk.lm_head is not None:
            trunk.lm_head = None  # never used by a critic; its parameters would only cost memory
        self.value_head = nnx.Param(jnp.zeros((c.hidden_size, 1), c.weight_dtype), logical_axes=("embed", None))
        self.value_bias = nnx.Param(jnp.zeros((1,), c.weight_dtype), logical_axes=(None,))

    @classmethod
    def from_decoder(cls, decoder: Decoder) -> "ValueModel":
        """A critic whose trunk starts from ``decoder``'s parameters (the same arrays: the train
        step copies them into its own state). ``decoder`` itself is left as it was."""
        graphdef, state = nnx.split(decoder)
        return cls(nnx.merge(graphdef, state))

    def values(self, input_ids, positions, segment_ids=None) -> jax.Array:
        """[B, T] float32: the value of each position's state (module docstring for the alignment)."""
        return self.values_and_output(input_ids, positions, segment_ids)[0]

    def values_and_output(self, input_ids, positions, segment_ids=None):
        """(values [B, T] float32, the trunk's DecoderOutput, e.g. for its MoE ``aux_loss``)."""
        out = self.trunk(input_ids, positions, segment_ids)
        values = jnp.einsum("btd,dk->btk", out.hidden.astype(F32), self.value_head[...].astype(F32))[..., 0]
        return values + self.value_bias[...].astype(F32)[0], out

    def __call__(self, input_ids, positions, segment_ids=None) -> jax.Array:
        return self.values(input_ids, positions, segment_ids)
