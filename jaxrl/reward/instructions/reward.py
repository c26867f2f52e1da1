"""The ``kind: instructions`` reward: how many of a row's verifiable instructions a response follows.

Score (docs/rewards.md#kind-instructions): each instruction the row names
(``jaxrl.reward.instructions.registry``) is followed or not, in IFEval's strict or loose sense
(``mode``); ``aggregate: fraction`` scores the fraction followed (IFEval's instruction-level
accuracy), ``aggregate: all`` scores 1 when every one is followed, else 0 (its prompt-level
accuracy). A response is never unparsable: not following is itself the graded outcome.
A row whose instructions cannot be read is the data's fault: ``row_problem`` says so when the
data is loaded (the loader skips the row, naming its file and line), and a call on such a row
raises ``InputError`` (reported with the sample, counted unparsable).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Mapping, Sequence

from jaxrl.errors import InputError
from jaxrl.reward.base import RewardResult
from jaxrl.reward.instructions.registry import read_instructions


@dataclasses.dataclass(frozen=True)
class InstructionsConfig:
    """A ``kind: instructions`` task's options (``reward.tasks.<name>.instructions``).

    ids_field: the row field listing the instruction ids [instruction_id_list]; kwargs_field: the
    row field listing each instruction's arguments, at the same positions [kwargs] (IFEval's names);
    mode: "strict" (the response as it is) or "loose" (IFEval's loose variants also tried);
    aggregate: "fraction" (fraction of instructions followed) or "all" (1 when all are, else 0).
    """

    ids_field: str = "instruction_id_list"
    kwargs_field: str = "kwargs"
    mode: Literal["strict", "loose"] = "strict"
    aggregate: Literal["fraction", "all"] = "fraction"

    def __post_init__(self):
        for key in ("ids_field", "kwargs_field"):
            if not getattr(self, key).strip():
                raise ValueError(f"instructions.{key} is blank; name the row field")
        if self.ids_field == self.kwargs_field:
            raise ValueError(f"instructions.ids_field and instructions.kwargs_field are both {self.ids_field!r}; "
                             f"the ids and their arguments are two row fields")


def loose_variants(response: str) -> list[str]:
    """IFEval's loose readings of a response: as it is, without its first line, without its last
    line, without both (a preamble such as "Sure, here it is:" or a closing remark), and each of
    those four with every ``*`` removed (markdown emphasis); blank variants dropped."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return [text for text in cut + [text.replace("*", "") for text in cut] if text.strip()]


def followed(response: str, row: Mapping, config: InstructionsConfig) -> list[bool]:
    """For each instruction of ``row``, in its order: does ``response`` follow it (in ``config.mode``)?
    A blank response follows none, as in IFEval. InputError for a row whose instructions cannot be read."""
    checks = read_instructions(row, config.ids_field, config.kwargs_field)
    variants = loose_variants(response) if config.mode == "loose" else [response] * bool(response.strip())
    return [any(check(text) for text in variants) for _, check in checks]


class InstructionsReward:
    """The reward function of a ``kind: instructions`` task (module docstring)."""

    def __init__(self, config: InstructionsConfig):
        self.config = config

    def row_problem(self, row: Mapping) -> tuple[str, str] | None:
        """("bad_instructions", why) when the row's instructions cannot be read, else None (for the data loader)."""
        try:
            read_instructions(row, self.config.ids_field, self.config.kwargs_field)
        except InputError as e:
            return "bad_instructions", str(e)
        return None

    def __call__(self, prompt: str, response: str, response_ids: Sequence[int], row: Mapping) -> RewardResult:
        results = followed(response, row, self.config)
        if self.config.aggregate == "all":
            return RewardResult(score=float(all(results)))
        return RewardResult(score=sum(results) / len(results))
