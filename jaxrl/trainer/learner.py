"""The RL learner: the policy being trained, as the recompute, update and push stages share it.

:class:`Learner` holds the policy's parameters and optimizer state on the device mesh (``state``,
what checkpoints save), the jitted train step of the run's objective, its learning-rate schedule,
and the frozen KL reference (a copy of the initial parameters, when the objective's KL or
``update.reference_metrics`` needs one). The stages read and replace ``state``; nothing else
owns the policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.losses import ObjectiveConfig
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.model import build_model, check_update_options
from jaxrl.trainer.update import build_optimizer, make_train_step, rl_loss_fn


class Learner:
    """The policy of ``config.model`` on ``mesh``, trained with ``objective``; ``frozen_steps``:
    the first RL steps in which the policy is not updated (a critic's warm-up), which the
    learning-rate schedule does not count."""

    def __init__(self, config: TrainConfig, mesh: jax.sharding.Mesh, objective: ObjectiveConfig, frozen_steps: int):
        u = config.update
        model = build_model(config.model, mesh, packed_rows=u.pack)
        check_update_options(u, model, mesh)
        self.moe_layers = model.config.moe_layer_indices
        self.frozen_steps = frozen_steps
        self.total_updates = max(config.steps - frozen_steps, 0) * u.mini_batches * u.epochs
        optimizer, self.schedule = build_optimizer(config.optimizer, self.total_updates)
        loss_fn = rl_loss_fn(objective, seed=config.seed, micro_batches=u.micro_batches,
                             chunk_size=u.logprob_chunk_size, router_z_loss=u.router_z_loss)
        self.train_step, self.state = make_train_step(model, optimizer, loss_fn, mesh)
        needs_reference = objective.kl_kind != "none" or u.reference_metrics
        self.reference = copy_params(self.state["params"]) if needs_reference else None

    def model(self):
        """The policy as an nnx module over the current parameters (no copy)."""
        return nnx.merge(self.train_step.graphdef, self.state["params"])

    def weights(self, copy: bool):
        """What a rollout engine is given: :meth:`model`, over a copy of the parameters when
        ``copy`` (an engine that holds the arrays by reference while the train step donates them)."""
        if copy:
            return nnx.merge(self.train_step.graphdef, copy_params(self.state["params"]))
        return self.model()


def copy_params(tree):
    """A copy of the train state's parameters (one sharding per leaf, all on the mesh) in new
    buffers, as one compiled program rather than one per leaf shape."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=jax.tree.map(lambda x: x.sharding, tree))(tree)
