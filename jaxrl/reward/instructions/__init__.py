"""Verifiable instruction-following rewards (``kind: instructions``, IFEval's instructions and row format).

``registry`` names the instruction ids and their arguments and reads a row's instructions,
``checkers`` holds one checker per id, ``text`` what they measure (words, sentences, language),
``reward`` scores a response strictly or loosely. docs/rewards.md#kind-instructions.
"""

from jaxrl.reward.instructions.registry import INSTRUCTIONS, read_instructions
from jaxrl.reward.instructions.reward import InstructionsConfig, InstructionsReward, followed, loose_variants

__all__ = ["INSTRUCTIONS", "InstructionsConfig", "InstructionsReward", "followed", "loose_variants",
           "read_instructions"]
