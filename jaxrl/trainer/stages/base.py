"""The step record and the stage contract: what every stage of an RL step reads, writes and keeps.

One RL step is the list of stages ``jaxrl.trainer.stages.build_stages`` assembles, run in order
over one :class:`StepRecord` by ``RLTrainer`` (``jaxrl.trainer.rl``). A stage:

- is called as ``stage(record, step) -> (record, metrics)`` with the 1-based step number; it
  returns the record with the fields it fills (``record.replace(...)``; records are frozen, so
  a stage cannot change what an earlier stage wrote behind its back) and its metrics, every key
  under its own prefix (``rollout/``, ``reward/``, ...) or ``time/`` for the timing of a part of
  it. The trainer times the whole stage as ``time/<name>`` unless ``timed`` is False;
- keeps whatever state it needs between steps (the rollout queue, the update guard, the
  critic) and checkpoints it: ``checkpoint(step)`` returns a JSON record merged into the
  checkpoint's meta (keys shared by every stage, so each picks names of its own),
  ``checkpoint_items()`` the arrays (name -> pytree) saved beside the policy's state, and
  ``restore(meta, items)`` puts both back on ``--resume``; ``resume_hint`` is appended to the
  error when a checkpoint lacks its items;
- learns that the rollout engine is up through ``start(step)`` (called once, before the first
  step, with the step the run starts from), and releases what it holds in ``close()``.

A stage reads its collaborators from the :class:`StepContext` it was built with, never from
another stage's module: the stages are independent rooms (``tests/test_layout.py``), joined by
``build_stages`` and the record.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import numpy as np

from jaxrl.reward.base import ScoredBatch
from jaxrl.trainer.batch import StepBatch


class PushGap(NamedTuple):
    """|engine - learner logprob| over ``tokens`` generated tokens: its ``largest`` and its ``mean``
    (the push stage's check of a weight push)."""

    largest: float
    mean: float
    tokens: int


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step's state as it travels the stages; each field is filled by the stage named.

    examples: the step's P prompts (data rows), and samples: [P][G] ``Sample``, the engine's
    ``group_size`` samples of each (rollout); greedy: [P][1] greedy samples, the baseline of the
    estimators that need one (ReMax), else None (rollout);
    scored: the [P * G] rewards, prompt-major (``ScoredBatch``: scores, tasks, unparsable, raised,
    timed_out, per-token rewards); greedy_scores: [P] the greedy samples' scores or None; valid:
    [P * G] bool, the samples that enter the loss and their group's baseline (reward);
    batch: the packed :class:`~jaxrl.trainer.batch.StepBatch` (pack), gaining ``old_logp`` /
    ``ref_logp`` (recompute), ``advantages`` and with a critic ``values``, ``returns`` and
    ``token_rewards`` (advantage);
    skip_update: the batch filter's verdict (filter);
    engine_gap: the |learner - engine logprob| (``PushGap``) measured by the update's first
    mini-batch under ``objective.bypass``, or None when it measured nothing: no policy loss ran,
    or none of its tokens entered the loss (update); the push stage's check of the previous push
    reads it.
    """

    examples: list = dataclasses.field(default_factory=list)
    samples: list = dataclasses.field(default_factory=list)
    greedy: list | None = None
    scored: ScoredBatch | None = None
    greedy_scores: np.ndarray | None = None
    valid: np.ndarray | None = None
    batch: StepBatch | None = None
    skip_update: bool = False
    engine_gap: PushGap | None = None

    def replace(self, **changes) -> "StepRecord":
        return dataclasses.replace(self, **changes)

    @property
    def flat(self) -> list[tuple[Any, Any]]:
        """``(example, sample)`` pairs, prompt-major: the order of ``scored`` and of the batch's rows."""
        return [(e, s) for e, group in zip(self.examples, self.samples, strict=True) for s in group]

    @property
    def flat_samples(self) -> list:
        return [s for group in self.samples for s in group]

    @property
    def oldest_weights(self) -> str:
        """The oldest weight version among the samples (partial rollouts mix versions within one)."""
        return str(min(int(s.weight_version) for s in self.flat_samples))


@dataclasses.dataclass
class StepContext:
    """What the stages share, built once by the trainer: the validated ``config``, the run's
    ``objective`` (``recompute.objective_for_run``), the ``learner`` (``jaxrl.trainer.learner``),
    the device ``mesh``, the ``tokenizer`` and the generation's ``stop_token_ids``, the reward
    ``router``, the prompt ``iterator``, the rows' environments ``envs`` (None without an
    ``env`` section), ``warn`` (a line in the log and on the terminal; the run goes on),
    ``on_error`` (a reward function's failure, logged the same way) and, from ``start`` on, the
    rollout ``engine``."""

    config: Any
    objective: Any
    learner: Any
    mesh: Any
    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    router: Any
    iterator: Any
    envs: Any
    warn: Callable[[str], None]
    on_error: Callable[[str], None]
    engine: Any = None


class Stage:
    """One stage of the RL step (the module docstring states the contract); subclasses set
    ``name`` and implement ``__call__``, and override the checkpoint and lifecycle hooks they need."""

    name: str = ""
    timed: bool = True
    resume_hint: str = ""

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        raise NotImplementedError

    def start(self, step: int) -> None:
        """The rollout engine is up (``context.engine``); the run's first step is ``step + 1``."""

    def checkpoint(self, step: int) -> dict[str, Any]:
        """The JSON record saved in the checkpoint's meta after ``step``."""
        return {}

    def checkpoint_items(self) -> dict[str, Any]:
        """Arrays saved beside the policy's state: name -> pytree (also the restore targets)."""
        return {}

    def restore(self, meta: dict[str, Any], items: dict[str, Any]) -> None:
        """Puts back what :meth:`checkpoint` and :meth:`checkpoint_items` saved."""

    def close(self) -> None:
        """Releases threads and other resources the stage holds."""
