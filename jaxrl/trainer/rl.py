"""The RL trainer: the loop over the step's stages, held-out evaluation and checkpoints.

One step is the data's path through the stages ``jaxrl.trainer.stages.build_stages`` assembles
(docs/training.md#the-rl-update-loop): rollout, reward, pack, recompute, advantage, filter,
update, push. ``train_step_once`` runs them in order over one ``StepRecord``, times each as
``time/<stage>`` and gathers their metrics, each under its stage's prefix. Checkpoints hold the
policy's state (``jaxrl.trainer.learner``) and whatever the stages keep (the rollout queue, the
update guard, a critic). Everything random is derived from ``(config.seed, step)``, so a resumed
run reproduces the uninterrupted one exactly (same samples, same updates) on CPU in float32.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from jaxrl import distributed
from jaxrl.data import BatchIterator, load_examples, load_tokenizer, stop_token_ids
from jaxrl.env import EnvRouter
from jaxrl.evaluation import evaluate
from jaxrl.rollout.base import RolloutEngine
from jaxrl.rollout.config import make_engine
from jaxrl.trainer.checkpoint import CheckpointMismatchError
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.judges import build_reward_router, judge_cache_path
from jaxrl.trainer.learner import Learner
from jaxrl.trainer.learning_watch import LearningWatch
from jaxrl.trainer.lifecycle import COMPLETIONS, check_fresh_start, open_run, run_loop
from jaxrl.trainer.metrics import StageClock
from jaxrl.trainer.model import check_vocabulary, has_experts, learner_mesh, use_compile_cache
from jaxrl.trainer.stages import (Stage, StepContext, StepRecord, build_stages, frozen_policy_steps,
                                  objective_for_run, sampler_batch)
from jaxrl.trainer.stages.rollout import sampling_params, sampling_seed
from jaxrl.trainer.stages.rollout.episodes import environment_metrics, recording_conversations

log = logging.getLogger(__name__)


class RLTrainer:
    """Builds everything from a TrainConfig; ``run()`` trains and returns the final summary."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 engine: RolloutEngine | None = None, extra_stages: Sequence[tuple[str, Stage]] = ()):
        """``resume``: continue from the newest intact checkpoint. ``overwrite``: delete an earlier
        run's metrics and checkpoints in these folders (without it, a fresh start over an earlier
        run raises RunExistsError before anything is touched). ``engine``: an engine to sample
        with instead of the one ``rollout.engine`` names (the caller closes it). ``extra_stages``:
        ``(after, stage)`` pairs, stages of the caller's inserted into the step (``build_stages``)."""
        self.config = config
        check_fresh_start(config.output_dir, config.checkpoint.directory, resume=resume, overwrite=overwrite)
        self.errors: list[str] = []
        data = config.data
        self.tokenizer = load_tokenizer(data.tokenizer)
        check_vocabulary(config.model, self.tokenizer, data.tokenizer)
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.model.hf_path)
        self.router = build_reward_router(config, judge_cache_path(config.output_dir))
        self.examples, self.data_report = load_examples(data.train_files, data, self.tokenizer,
                                                        row_check=self.router.row_problem)
        self.eval_examples = (
            load_examples(data.eval_files, data, self.tokenizer, row_check=self.router.row_problem)[0]
            [: config.eval.max_prompts] if data.eval_files else []
        )
        # Every process reads the same global batch and runs the same host-side loop (sampling
        # requests, rewards, advantages); the device work is sharded over the global mesh. So the
        # batch is the same for any number of processes (jaxrl.distributed).
        self.iterator = BatchIterator(self.examples, config.rollout.prompts_per_step, seed=data.seed,
                                      shuffle=data.shuffle, mixture=data.mixture, mixture_field=data.mixture_field)
        self.envs = EnvRouter(config.env, self.tokenizer) if config.env is not None else None
        use_compile_cache(config.compile_cache_dir)
        self.mesh = learner_mesh(config)
        distributed.host_memory.keep_freed_memory(self.mesh)
        self.objective, why = objective_for_run(config, builds_engine=engine is None,
                                                has_experts=has_experts(config.model))
        log.info("old_logp: %s", why)
        self.learner = Learner(config, self.mesh, self.objective, frozen_policy_steps(config))
        self.context = StepContext(config, self.objective, self.learner, self.mesh, self.tokenizer,
                                   self.stop_token_ids, self.router, self.iterator, self.envs, self._warn,
                                   on_error=self.errors.append)
        self.stages = build_stages(self.context, extra_stages)
        self.watch = LearningWatch.for_objective(self.objective, self._warn)
        self.step = 0
        self.checkpointer = open_run(config, resume=resume, overwrite=overwrite)
        if resume:
            self._restore()
        self.manager = None
        self._owns_engine = engine is None  # an engine handed in is the caller's to close
        if engine is None:
            engine, self.manager = make_engine(config.rollout, self.model(), self.mesh, sampler_batch(config),
                                               config.placement)
        self.engine = engine
        for stage in self.stages:
            stage.start(self.step)

    def _warn(self, message: str) -> None:
        """A problem worth a line in the log and on the terminal; the run goes on."""
        log.warning(message)
        self.errors.append(message)

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine the stages sample with and push to."""
        return self.context.engine

    @engine.setter
    def engine(self, engine: RolloutEngine) -> None:
        self.context.engine = engine

    @property
    def state(self) -> dict:
        """The policy's train state (parameters, optimizer state, update count)."""
        return self.learner.state

    def model(self):
        """The learner as an nnx module over the current parameters (no copy)."""
        return self.learner.model()

    def stage(self, name: str) -> Stage:
        """The step's stage called ``name``."""
        return next(s for s in self.stages if s.name == name)

    # ---------------------------------------------------------------- one step
    def train_step_once(self) -> dict[str, Any]:
        step, clock = self.step + 1, StageClock()
        record, metrics = StepRecord(), {}
        for stage in self.stages:
            with clock(stage.name, timed=stage.timed):
                record, stage_metrics = stage(record, step)
            metrics.update(stage_metrics)
        self.watch.observe(step, metrics)
        self.step = step
        return {**metrics, "data/bad_rows": self.data_report.bad_rows, **clock.metrics(tokens=record.batch.num_tokens)}

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, Any]:
        """Held-out reward, unparsable fraction and pass@``eval.k`` on ``data.eval_files``: the same
        sampling and reward code as training, through ``jaxrl eval``'s (docs/evaluation.md); with an
        ``env`` section the held-out prompts are conversations too, and ``heldout/env/*`` their metrics;
        under ``lifecycle.COMPLETIONS`` a few completions to read (not a metric: the run loop logs them apart)."""
        if not self.eval_examples:
            return {}
        e = self.config.eval
        conversations, played = recording_conversations(self.engine, self.envs)
        params = sampling_params(self.config.rollout, self.stop_token_ids, sampling_seed(self.config.seed, -1),
                                 e.temperature)
        result = evaluate(self.engine, self.router, self.tokenizer, self.eval_examples, params, e.samples, e.k,
                          on_error=self.errors.append, generate=conversations)
        return {**result.metrics("heldout"), **{f"heldout/{k}": v for k, v in self.router.take_metrics().items()},
                **{f"heldout/{k}": v for k, v in environment_metrics(played).items()},
                COMPLETIONS: result.completions}

    # ---------------------------------------------------------------- checkpoints
    def save(self) -> None:
        if self.checkpointer is None:
            return
        meta = {"step": self.step, "seed": self.config.seed, "weight_version": str(self.step)}
        for stage in self.stages:
            meta.update(stage.checkpoint(self.step))
        items = {name: item for stage in self.stages for name, item in stage.checkpoint_items().items()}
        self.checkpointer.save(self.step, self.learner.state, meta, items or None)

    def _restore(self) -> None:
        """The newest intact checkpoint's policy state and every stage's (a checkpointer exists:
        check_fresh_start refused --resume without one)."""
        targets = {name: item for stage in self.stages for name, item in stage.checkpoint_items().items()}
        try:
            self.learner.state, meta, items = self.checkpointer.restore_with_items(self.learner.state, targets)
        except CheckpointMismatchError as e:
            hints = [stage.resume_hint for stage in self.stages if stage.checkpoint_items() and stage.resume_hint]
            raise CheckpointMismatchError("; ".join([str(e), *hints])) from None
        if self.learner.reference is not None:
            log.warning("resume: the KL reference is the restored run's initial weights only if model.* points "
                        "at the same initial checkpoint")
        self.step = int(meta["step"])
        for stage in self.stages:
            stage.restore(meta, items)

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Trains to ``config.steps`` (``lifecycle.run_loop``); returns the summary with
        ``learning_watch``'s lines."""
        evaluate = self._evaluate_watched if self.eval_examples else None
        return self.watch.add_to(run_loop(self, self.config.steps, evaluate))

    def _evaluate_watched(self) -> dict[str, Any]:
        metrics = self.evaluate()
        if self.step == 0:  # the held-out start: is there anything to learn?
            self.watch.observe_start(metrics)
        return metrics

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        for stage in reversed(self.stages):
            stage.close()
        self.router.close()
        if self._owns_engine:
            self.engine.close()
        if self.manager is not None:
            self.manager.stop()
