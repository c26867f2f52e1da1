"""Clip-Cov and KL-Cov choose tokens once per optimizer step, so the update ignores the micro-batch split.

docs/losses.md#clip-cov-and-kl-cov defines ``Cov_i`` over the N masked tokens of the batch and selects
``floor(r * N)`` of them; the trainer's loss (``rl_loss_fn``) must give the same loss and gradient for 1, 2
and 4 micro-batches of one mini-batch with either control on.
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.losses import (ObjectiveConfig, entropy_control_selection, loss_normalizer, token_entropy_from_logits,
                          token_logprobs_from_logits)
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.update import rl_loss_fn

ROWS, LENGTH, PROMPT, VOCAB = 8, 12, 3, 17
SEED = 5
# Wide bands and large ratios so many tokens are chosen and a per-micro-batch choice would differ.
CONTROLS = {
    "clip-cov": ObjectiveConfig(entropy_control="clip-cov", clip_cov_ratio=0.25, clip_cov_omega_low=0.0,
                                clip_cov_omega_high=1e9),
    "kl-cov": ObjectiveConfig(entropy_control="kl-cov", kl_cov_ratio=0.25, kl_cov_beta=1.0),
}
INPUTS = ("input_ids", "positions", "segment_ids", "targets")


class BigramPolicy(nnx.Module):
    """A policy with the Decoder's ``token_logprobs`` interface whose logits at a position are a
    table row of the input token plus a learned per-position offset: row-independent like the
    Decoder, and it compiles in a fraction of the Decoder's ~3 s per accumulation variant."""

    Config = collections.namedtuple("Config", "moe_layer_indices")

    def __init__(self, rngs: nnx.Rngs):
        self.config = self.Config(moe_layer_indices=())
        self.table = nnx.Param(2.0 * jax.random.normal(rngs.params(), (VOCAB, VOCAB)))
        self.offset = nnx.Param(jax.random.normal(rngs.params(), (LENGTH, VOCAB)))

    def token_logprobs(self, input_ids, positions, segment_ids, targets, *, chunk_size):
        logits = self.table[input_ids] + self.offset[positions]
        return token_logprobs_from_logits(logits, targets), token_entropy_from_logits(logits), None


def _batch(model):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, VOCAB, size=(ROWS, LENGTH + 1)).astype(np.int32)
    ends = rng.integers(PROMPT + 2, LENGTH + 1, size=ROWS)
    position = np.arange(LENGTH)
    live = position[None, :] < ends[:, None]
    mask = (live & (position[None, :] >= PROMPT - 1)).astype(np.float32)
    batch = {
        "input_ids": tokens[:, :-1], "targets": tokens[:, 1:],
        "positions": np.tile(position.astype(np.int32), (ROWS, 1)), "segment_ids": live.astype(np.int32),
        "mask": mask, "advantages": rng.normal(size=(ROWS, 1)).astype(np.float32) * mask,
    }
    logp = np.asarray(jax.jit(lambda m, x: m.token_logprobs(*x, chunk_size=16)[0])(model, [batch[k] for k in INPUTS]))
    # Sampled by a slightly different policy: ratios away from 1 and a nonzero KL-Cov gap.
    batch["old_logp"] = (logp + rng.normal(scale=0.1, size=logp.shape)).astype(np.float32) * mask
    batch["rollout_logp"] = batch["old_logp"]
    batch["normalizer"] = np.float32(loss_normalizer("token-mean", jnp.asarray(mask)))
    batch["key_seed"] = np.int32(3)
    return batch


@functools.cache
def _setup():
    """(graphdef, params, mini-batch): a bigram policy and a batch of ragged responses."""
    model = BigramPolicy(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    return graphdef, params, _batch(model)


def _update_batch(batch):
    """The trainer's typed mini-batch of the test's arrays."""
    tokens = StepBatch(**{k: batch[k] for k in (*INPUTS, "mask", "advantages", "old_logp", "rollout_logp")})
    return UpdateBatch(tokens=tokens, normalizer=batch["normalizer"], key_seed=batch["key_seed"])


def _loss_and_grad(objective, graphdef, params, batch, micro_batches):
    loss_fn = rl_loss_fn(objective, seed=SEED, micro_batches=micro_batches, chunk_size=16)
    update_batch = _update_batch(batch)
    value_and_grad = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), update_batch), has_aux=True)
    (loss, metrics), grad = jax.jit(value_and_grad)(params)
    return float(loss), metrics, jax.tree.leaves(grad)


@pytest.mark.parametrize("name", CONTROLS)
def test_selection_made_per_micro_batch_would_differ(name):
    """The data makes the question real: choosing inside each micro-batch picks other tokens."""
    graphdef, params, batch = _setup()
    logp = nnx.merge(graphdef, params).token_logprobs(*(jnp.asarray(batch[k]) for k in INPUTS), chunk_size=16)[0]
    key = jax.random.fold_in(jax.random.key(SEED), batch["key_seed"])
    whole, _ = entropy_control_selection(CONTROLS[name], logp, batch["advantages"], batch["mask"], key=key)
    halves = [entropy_control_selection(CONTROLS[name], logp[rows], batch["advantages"][rows], batch["mask"][rows],
                                        key=key)[0] for rows in (slice(0, None, 2), slice(1, None, 2))]
    assert int(jnp.sum(whole)) >= 4
    assert not (np.array_equal(whole[0::2], halves[0]) and np.array_equal(whole[1::2], halves[1]))


@pytest.mark.parametrize("name", CONTROLS)
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(name):
    graphdef, params, batch = _setup()
    objective = CONTROLS[name]
    whole_loss, whole_metrics, whole_grad = _loss_and_grad(objective, graphdef, params, batch, 1)
    scale = max(float(jnp.max(jnp.abs(g))) for g in whole_grad)
    assert scale > 1e-3  # a real gradient, far above the tolerance below
    # floor(0.25 * N) of the N masked tokens: KL-Cov takes exactly that many, Clip-Cov at most (its band).
    count = f"{name.replace('-', '_')}_count"
    budget = int(0.25 * batch["mask"].sum())
    chosen = int(whole_metrics[count])
    assert chosen == budget if name == "kl-cov" else 0 < chosen <= budget
    for micro_batches in (2, 4):
        loss, metrics, grad = _loss_and_grad(objective, graphdef, params, batch, micro_batches)
        assert int(metrics[count]) == chosen, micro_batches
        np.testing.assert_allclose(loss, whole_loss, rtol=1e-5, atol=1e-7, err_msg=str(micro_batches))
        for a, b in zip(grad, whole_grad, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale, err_msg=str(micro_batches))
