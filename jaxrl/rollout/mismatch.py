"""A controlled training-inference mismatch, injected on the engine side (docs/experiments.md).

``MismatchEngine`` wraps a real ``JaxSampler``: every weight push hands the sampler a
transformed copy of the learner's weights, and everything else (``generate``, the version,
``close``) is the sampler's own. So a run through it is an ordinary ``RLTrainer`` run
(``RLTrainer(config, engine=MismatchEngine(...))``) whose engine computes something other
than the learner, in one of three ways:

- ``"bf16"``: the weights cast to bfloat16 and the matmuls computed in bfloat16 (the
  model's ``param_dtype`` and ``dtype``), while the learner stays float32;
- ``"noise"``: every parameter matrix plus Gaussian noise of ``scale`` x its own standard
  deviation, a fresh deterministic draw per push (seeded by ``seed`` and the push count);
- ``"stale"``: the weights of ``steps`` pushes ago (before that many pushes, the first ones).

The engine holds only its own copies (the learner's train step donates its arrays), so
``holds_references`` is False. It reports the version of the weights it samples with: a
stale engine's samples carry the older version, so the trainer's ``rollout/staleness_*``
metrics show the lag. Runs through it set ``rollout.verify_push: false``: the mismatch is
deliberate, and the push check would stop the run at the first step.
"""

from __future__ import annotations

import collections
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.rollout.base import RolloutEngine
from jaxrl.rollout.sampler import JaxSampler

KINDS = ("bf16", "noise", "stale")


def perturb(state, scale: float, seed: int = 0):
    """``state`` with every floating matrix (ndim >= 2) plus Gaussian noise of ``scale`` x its std.

    Vectors (norm weights, biases) are left alone: the mismatch a numerics change causes lives
    in the matmuls. The noise of each leaf is drawn from ``seed`` and a hash of its path, so
    the same (state, seed) always gives the same perturbation."""
    key = jax.random.key(seed)

    def one(path, x):
        if jnp.ndim(x) < 2 or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return jnp.copy(x)
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), jnp.shape(x), jnp.float32)
        return (x + scale * jnp.std(x.astype(jnp.float32)) * noise).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, state)


def _params(weights) -> nnx.State:
    """The parameter state of what ``RLTrainer`` pushes: a module, its state, or a train state dict."""
    if isinstance(weights, nnx.Module):
        return nnx.state(weights)
    if isinstance(weights, dict) and "params" in weights:
        return weights["params"]
    return weights


class MismatchEngine(RolloutEngine):
    """A ``JaxSampler`` over transformed learner weights (see the module doc).

    model: the learner's initial model (its weights are copied, never held). kind: one of
    ``KINDS``. scale: the relative noise for ``"noise"``. steps: the lag for ``"stale"``.
    seed: the noise seed. The remaining keywords go to ``JaxSampler``.
    """

    holds_references = False

    def __init__(self, model: nnx.Module, kind: str, *, scale: float = 0.0, steps: int = 1, seed: int = 0,
                 **sampler_options):
        if kind not in KINDS:
            raise ValueError(f"MismatchEngine kind must be one of {KINDS}, got {kind!r}")
        if kind == "stale" and steps < 1:
            raise ValueError(f"MismatchEngine stale steps must be >= 1, got {steps}")
        if kind == "noise" and not scale > 0:
            raise ValueError(f"MismatchEngine noise scale must be > 0, got {scale}")
        self.kind, self.scale, self.steps, self.seed = kind, float(scale), int(steps), int(seed)
        self._pushes = 0
        graphdef, state = nnx.split(model)
        if kind == "bf16":
            # The engine's own model: the same tree, its config computing and storing in bfloat16.
            config = model.config.replace(param_dtype="bfloat16", dtype="bfloat16")
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0))))
        self._graphdef = graphdef
        # (version, weights) of the last ``steps + 1`` pushes, newest last: the stale engine samples the oldest.
        self._history: collections.deque = collections.deque(maxlen=self.steps + 1 if kind == "stale" else 1)
        first = self._transform(state)
        self._history.append(("0", first))
        self.engine = JaxSampler(nnx.merge(graphdef, first), **sampler_options)

    def _transform(self, state):
        if self.kind == "bf16":
            return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating)
                                else jnp.copy(x), state)
        if self.kind == "noise":
            return perturb(state, self.scale, seed=self.seed * 1_000_003 + self._pushes)
        return jax.tree.map(jnp.copy, state)  # stale: a copy survives the train step's donation

    def update_weights(self, params, version: str) -> None:
        self._pushes += 1
        self._history.append((str(version), self._transform(_params(params))))
        held_version, weights = self._history[0] if self.kind == "stale" else self._history[-1]
        self.engine.update_weights(weights, version=held_version)

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    def generate(self, prompts, params, n: int = 1):
        return self.engine.generate(prompts, params, n=n)

    def close(self) -> None:
        self.engine.close()


__all__ = ["KINDS", "MismatchEngine", "perturb"]
