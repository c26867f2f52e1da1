"""The trainer: RL update loop (docs/training.md#the-rl-update-loop), SFT, checkpoints, metrics and plots.

``jaxrl train CONFIG [key=value ...] [--resume]`` runs :class:`jaxrl.trainer.rl.RLTrainer`;
``jaxrl sft CONFIG ...`` runs :class:`jaxrl.trainer.sft.SFTTrainer`. Modules import lazily
(the loop needs the models, losses and rollout packages; checkpoints, metrics and plots don't).
"""

from jaxrl.errors import require_modules

# Checked here because the modules import lazily: without the [train] extra, ``import jaxrl.trainer.cli``
# (which itself needs none of these) would start a run that fails on a bare ModuleNotFoundError later.
require_modules("jaxrl.trainer", "flax", "optax", "orbax", "grain", "transformers", "yaml")
