"""The RL trainer: one step is the data's path through the stages (docs/training.md#the-rl-update-loop).

Per step k, ``train_step_once`` runs, one stage per line:
1. **rollout**: ``prompts_per_step`` prompts from the Grain iterator, ``group_size`` samples
   each from the rollout engine, and one greedy response per prompt when the advantage
   estimator needs it as a baseline (ReMax); with the current weights, or up to
   ``rollout.max_staleness`` updates older, generated in the background while the learner
   updates (``jaxrl.trainer.rollouts``), or with ``rollout.partial_tokens`` spread over steps
   (``jaxrl.trainer.partial``);
2. **reward**: the per-task reward functions score them; unparsable samples (and samples whose
   reward function raised) leave the gradient and their group's baseline when
   ``reward.mask_unparsable`` (Motif);
3. **pack**: prompts and samples become a :class:`~jaxrl.trainer.batch.StepBatch`;
4. **recompute**: ``old_logp`` on the learner (or the engine's, with ``objective.bypass``) and
   the frozen reference's ``ref_logp`` when the objective's KL needs it
   (``jaxrl.models.scoring``);
5. **advantages** once from the scores (``jaxrl.losses.advantages``); with ``advantage.estimator:
   gae`` the critic first scores the batch, then token-level GAE (``jaxrl.trainer.critic``);
6. **filter**: skip the update when the batch's engine-vs-learner mismatch is too large;
7. **update**: ``update.mini_batches`` (S) optimizer steps over mini-batches of that fixed
   batch, each accumulated over ``update.micro_batches`` (``jaxrl.trainer.update``); the
   critic (when there is one) steps its own optimizer on the same mini-batches, and alone
   during its ``critic.warmup_steps``;
8. **push** the weights to the engine (once the batches of the older weights are generated); the
   next batch made with them verifies the push.

Each stage returns its own metrics under its prefix (``jaxrl.trainer.stages``). Everything
random is derived from ``(config.seed, step)``, so a resumed run reproduces the uninterrupted
one exactly (same samples, same updates) on CPU in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import distributed
from jaxrl.data import BatchIterator, load_examples, load_tokenizer, stop_token_ids
from jaxrl.env import EnvRouter
from jaxrl.evaluation import evaluate
from jaxrl.models import make_mesh
from jaxrl.models.scoring import LogprobScorer
from jaxrl.models.sharding import batch_devices, batch_shardings, sequence_row_length
from jaxrl.rollout.base import LogprobKind, PushVerificationError, RolloutEngine, SamplingParams
from jaxrl.rollout.config import make_engine
from jaxrl.trainer import stages
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.checkpoint import CheckpointMismatchError
from jaxrl.trainer.model import build_model, check_update_options
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.critic import Critic
from jaxrl.trainer.dynamic_sampling import Drawn, fill_with_signal
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.episodes import (environment_metrics, generate_conversations, recording_conversations,
                                    with_environment_rewards)
from jaxrl.trainer.judges import build_reward_router, judge_cache_path
from jaxrl.trainer.lifecycle import check_fresh_start, open_run, run_rl
from jaxrl.trainer.metrics import StageClock
from jaxrl.trainer.partial import PartialRolloutQueue
from jaxrl.trainer.rejection_watch import RejectionWatch
from jaxrl.trainer.rollouts import RolloutBatch, RolloutQueue, sampler_batch, staleness_metrics
from jaxrl.trainer.update import build_optimizer, make_train_step, rl_loss_fn

log = logging.getLogger(__name__)


class RLTrainer:
    """Builds everything from a TrainConfig; ``run()`` trains and returns the final summary."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 engine: RolloutEngine | None = None):
        """``resume``: continue from the newest intact checkpoint. ``overwrite``: delete an earlier
        run's metrics and checkpoints in these folders (without it, a fresh start over an earlier
        run raises RunExistsError before anything is touched). ``engine``: an engine to sample
        with instead of the one ``rollout.engine`` names (the caller closes it)."""
        self.config = config
        check_fresh_start(config.output_dir, config.checkpoint.directory, resume=resume, overwrite=overwrite)
        self.errors: list[str] = []
        data = config.data
        self.tokenizer = load_tokenizer(data.tokenizer)
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
        self.mesh = make_mesh(config.mesh)
        distributed.host_memory.keep_freed_memory(self.mesh)
        model = build_model(config.model, self.mesh)
        self.moe_layers = model.config.moe_layer_indices
        check_update_options(config.update, model, self.mesh)
        longest = data.max_prompt_tokens + config.rollout.max_new_tokens  # a conversation: its env's token limit
        if config.env is not None:
            longest = max(task.limits.max_total_tokens for task in config.env.tasks.values())
        self.length = sequence_row_length(longest - 1, self.mesh)
        # Policy updates: none during the critic's warm-up steps (the LR schedule counts real updates).
        warmup = config.critic.warmup_steps if config.critic is not None else 0
        self.total_updates = max(config.steps - warmup, 0) * config.update.mini_batches * config.update.epochs
        optimizer, self.schedule = build_optimizer(config.optimizer, self.total_updates)
        self.objective, why = stages.objective_for_run(config, builds_engine=engine is None)
        log.info("old_logp: %s", why)
        loss_fn = rl_loss_fn(self.objective, seed=config.seed, micro_batches=config.update.micro_batches,
                             chunk_size=config.update.logprob_chunk_size, router_z_loss=config.update.router_z_loss)
        self.train_step, self.state = make_train_step(model, optimizer, loss_fn, self.mesh)
        # PPO with GAE: a separate value model from the policy's initial weights, its own optimizer.
        self.critic = Critic(config, model, self.mesh, self._warn) if config.critic is not None else None
        sequences = config.rollout.prompts_per_step * config.rollout.group_size
        rows = sequences // (config.update.mini_batches * config.update.micro_batches)
        self.scorer = LogprobScorer(self.train_step.graphdef, self.mesh, rows, config.update.logprob_chunk_size,
                                    pack=config.update.pack, devices=batch_devices(self.mesh))
        needs_reference = config.objective.kl_kind != "none" or config.update.reference_metrics
        # The frozen reference: a copy of the initial parameters, sharded like them, no optimizer state.
        self.reference = _copy(self.state["params"]) if needs_reference else None
        self.step = 0
        self.skipped_updates = 0
        self.guard = UpdateGuard(config.update.max_consecutive_skips, config.update.spike_factor, self._warn)
        self.rejections = RejectionWatch.for_objective(self.objective, self._warn)
        self.rollouts = self._rollout_queue()
        if self.rollouts.background and jax.process_count() > 1:
            raise ValueError(f"rollout.max_staleness={config.rollout.max_staleness} runs with one JAX process only "
                             f"(this run has {jax.process_count()}): the engine's collectives would run in a "
                             "second thread beside the update's; set rollout.max_staleness=0")
        self.checkpointer = open_run(config, resume=resume, overwrite=overwrite)
        if resume:
            self._restore()
        self.manager = None
        self._owns_engine = engine is None  # an engine handed in is the caller's to close
        if engine is None:
            engine, self.manager = make_engine(config.rollout, self.model(), self.mesh, sampler_batch(config))
        self.engine = engine
        # An engine that holds the learner's arrays by reference generating beside the update
        # needs its own copy: the train step donates (deletes) the arrays it updates.
        if self.step > 0 or engine.weight_version != "0" or self._engine_needs_copy():
            self.engine.update_weights(self._engine_weights(), version=str(self.step))
        self.rollouts.fill(self.step)

    def _rollout_queue(self) -> RolloutQueue | PartialRolloutQueue:
        r = self.config.rollout
        if not r.partial_tokens:
            return RolloutQueue(self.iterator, self._generate, r.max_staleness)
        return PartialRolloutQueue(
            self.iterator, lambda prompts, n, budget, seed: self.engine.generate(
                prompts, dataclasses.replace(self._sampling(seed), max_new_tokens=budget), n=n),
            lambda step, draw: _seed(self.config.seed, step, draw), prompts=r.prompts_per_step,
            groups=r.partial_groups or 2 * r.prompts_per_step, group_size=r.group_size,
            partial_tokens=r.partial_tokens, max_new_tokens=r.max_new_tokens)

    def _engine_needs_copy(self) -> bool:
        return self.rollouts.background and self.engine.holds_references

    def _engine_weights(self):
        """What the engine is given: the learner model, over a copy of its parameters when
        :meth:`_engine_needs_copy`."""
        if self._engine_needs_copy():
            return nnx.merge(self.train_step.graphdef, _copy(self.state["params"]))
        return self.model()

    def _warn(self, message: str) -> None:
        """A problem worth a line in the log and on the terminal; the run goes on."""
        log.warning(message)
        self.errors.append(message)

    # ---------------------------------------------------------------- model views
    def model(self):
        """The learner as an nnx module over the current parameters (no copy)."""
        return nnx.merge(self.train_step.graphdef, self.state["params"])

    def _sampling(self, seed: int, temperature: float | None = None, **changes) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            temperature=r.temperature if temperature is None else temperature, top_p=r.top_p, top_k=r.top_k,
            max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_token_ids, seed=seed,
            logprob_kind=r.logprob_kind, **changes,
        )

    # ---------------------------------------------------------------- one step
    def _rollout(self, examples, seed: int, n: int, temperature: float | None = None):
        if self.envs is not None:  # conversations with the rows' environments (config section env)
            return generate_conversations(self.engine, self.envs, examples, self._sampling(seed, temperature), n)
        prompts = [e.prompt_ids.tolist() for e in examples]
        return self.engine.generate(prompts, self._sampling(seed, temperature), n=n)

    def _score(self, examples, samples):
        """The task rewards of the model's tokens (and an environment's own reward)."""
        flat = [(e, s) for e, group in zip(examples, samples, strict=True) for s in group]
        responses = [self.tokenizer.decode(s.model_ids, skip_special_tokens=True) for _, s in flat]
        scored = self.router.score(
            [e.prompt for e, _ in flat], responses, [s.model_ids.tolist() for _, s in flat],
            [e.row for e, _ in flat], on_error=self.errors.append,
        )
        return with_environment_rewards(scored, [s for _, s in flat]), flat

    def _generate(self, examples, index: int, draw: int = 0):
        """Batch ``index``'s samples (and ReMax's greedy baseline responses) with the engine's
        weights; run by the rollout queue, in its worker thread when it has one. ``draw`` > 0:
        dynamic sampling's extra draw of the step, with its own seed."""
        config = self.config
        seed = _seed(config.seed, index, draw)
        samples = self._rollout(examples, seed=seed, n=config.rollout.group_size)
        greedy = None
        if config.advantage.needs_greedy_baseline:
            greedy = self._rollout(examples, seed=seed, n=1, temperature=0.0)
        return samples, greedy

    def _draw(self, examples, index: int, draw: int = 0, greedy=None, samples=None) -> Drawn:
        """Prompts ``examples`` generated (unless ``samples`` are given) and scored."""
        if samples is None:
            samples, greedy = self._generate(examples, index, draw)
        scored, _ = self._score(examples, samples)
        greedy_scores = None if greedy is None else self._score(examples, greedy)[0].scores
        return Drawn(examples, samples, scored, greedy_scores)

    def _valid(self, scored) -> np.ndarray:
        """Which samples enter the loss: all but the unparsable ones when ``reward.mask_unparsable``."""
        return ~scored.unparsable if self.config.reward.mask_unparsable else np.ones(len(scored.scores), bool)

    def train_step_once(self) -> dict[str, Any]:
        config, r, objective = self.config, self.config.rollout, self.objective
        step, clock = self.step + 1, StageClock()
        with clock("rollout"):
            rollout: RolloutBatch = self.rollouts.take(step)
        with clock("reward"):
            drawn = self._draw(rollout.examples, step, greedy=rollout.greedy, samples=rollout.samples)
        dynamic_metrics = {}
        if r.dynamic_sampling:  # more prompts, same weights, until every group has reward variance
            with clock("dynamic_sampling"):
                drawn, dynamic_metrics = fill_with_signal(
                    drawn, lambda j: self._draw(next(self.iterator), step, j), prompts=r.prompts_per_step,
                    group_size=r.group_size, max_extra_draws=r.max_extra_draws, valid=self._valid)
        samples, scored, flat, greedy_scores = drawn.samples, drawn.scored, drawn.flat, drawn.greedy_scores
        batch, valid = self._pack(flat, scored)
        # Bypass without a KL reference runs no learner forward here, so there is no stage to time.
        with clock("recompute", timed=not objective.bypass or self.reference is not None):
            batch, recompute_metrics = stages.recompute(batch, self.scorer, self.state["params"], self.reference,
                                                        bypass=objective.bypass, replay=config.update.routing_replay,
                                                        moe_layers=self.moe_layers,
                                                        share_prefix=config.update.share_prefix)
        if not config.update.routing_replay:  # measured; the update routes by itself
            batch = batch.replace(routed_experts=None)
        self._dump(step, batch)
        if self.critic is None:
            batch, advantage_metrics = stages.advantages(batch, scored.scores, valid, config.advantage, objective,
                                                         r.group_size, greedy_scores)
        else:
            with clock("critic"):
                batch, critic_metrics = self.critic.score(batch)
            batch, advantage_metrics = self.critic.advantages(batch, scored, objective)
            advantage_metrics.update(critic_metrics)
        skip, filter_metrics = stages.batch_filter_stage(batch, objective)
        with clock("update"):
            update_metrics = self._update(batch, step, skip)
        self.rejections.observe(step, {**filter_metrics, **update_metrics})
        # The oldest weights in the batch (partial rollouts mix versions within a sample).
        oldest = str(min(int(s.weight_version) for group in samples for s in group))
        self._verify_previous_push(oldest, batch, update_metrics)
        with clock("rollout_drain"):  # the batches of the weights about to be replaced
            self.rollouts.before_push()
        with clock("weight_push"):
            push_metrics = self._push(step)
        self.rollouts.fill(step, final=step == config.steps)
        self.step = step
        return {
            **stages.rollout_metrics([s for _, s in flat]), **staleness_metrics(rollout, step - 1), **rollout.metrics,
            **dynamic_metrics,
            **stages.reward_metrics(scored, self.router.take_metrics()), **recompute_metrics, **advantage_metrics,
            **filter_metrics, **update_metrics, **push_metrics, **environment_metrics([s for _, s in flat]),
            "data/bad_rows": self.data_report.bad_rows,
            **clock.metrics(tokens=batch.num_tokens), "time/generation": rollout.generate_seconds,
        }

    def _pack(self, flat, scored) -> tuple[StepBatch, np.ndarray]:
        """The step's StepBatch and which samples enter the loss (all but the unparsable ones when
        ``reward.mask_unparsable``)."""
        valid = self._valid(scored)
        batch = StepBatch.from_samples(flat, self.length, self.tokenizer.pad_token_id, valid)
        if self.config.update.routing_replay and batch.routed_experts is None:
            raise ValueError("update.routing_replay needs the engine's routed experts, and the engine returned none: "
                             "start the SGLang servers with rollout.sglang.server.return_routed_experts=true")
        return batch, valid

    def _dump(self, step: int, batch: StepBatch) -> None:
        """Every ``logging.dump_batch_every`` steps, the batch in the alignment checker's format
        (``jaxrl align report`` reads it); learner logprobs are ``old_logp``."""
        every = self.config.logging.dump_batch_every
        if every and step % every == 0 and distributed.is_main_process():
            path = os.path.join(self.config.output_dir, "batches", f"step-{step:06d}.npz")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            meta = {"step": step, "weight_version": self.engine.weight_version, "source": "jaxrl train"}
            batch.token_aligned(meta).save(path)

    def _update(self, batch: StepBatch, step: int, skip: bool) -> dict[str, float]:
        """S optimizer steps over mini-batches of the fixed batch (each micro-batch-accumulated),
        none when the filter said ``skip``; metrics ``update/*``."""
        u = self.config.update
        collected, padding, cells, critic_collected = [], [], [], []
        frozen = self.critic is not None and self.critic.policy_frozen(step)  # the critic's warm-up
        # E passes of the S mini-batches (update.epochs); each update draws from its own key seed.
        minis = (mini for epoch in range(u.epochs) for mini in batch.mini_batches(
            u.mini_batches, self.objective.aggregation, step * u.epochs + epoch, pack=u.pack,
            micro_batches=u.micro_batches, devices=batch_devices(self.mesh), share_prefix=u.share_prefix))
        for mini in minis if not skip else ():
            if mini.packed is not None:
                padding.append(mini.packed.padding_fraction)
                cells.append(mini.packed.real_cells)
            if self.critic is not None:  # the critic's step on the same rows; the policy's needs no values
                critic_collected.append(self.critic.update(mini, step))
                mini = mini.replace(tokens=mini.tokens.replace(values=None, returns=None))
            if frozen:
                continue
            # Placed on the mesh here: jit refuses numpy inputs for arrays spread over processes.
            mini = jax.device_put(mini, batch_shardings(mini, self.mesh))
            self.state, metrics = self.train_step(self.state, mini)
            collected.append(jax.device_get(metrics))
            self.guard.check(step, collected[-1])
        self.skipped_updates += int(skip)
        # Mismatch metrics measured in the loss (bypass) are valid on the first mini-batch only,
        # before any update; everything else is averaged over the S mini-batches.
        averaged = {k: collected[0][k] if k.startswith("mismatch_") else np.mean([m[k] for m in collected])
                    for k in (collected[0] if collected else ())}
        if padding:  # what packing saved: the padding of the rows the learner ran, unpacked and packed
            averaged["padding_fraction"] = float(np.mean(padding))
            averaged["padding_fraction_unpacked"] = 1.0 - batch.num_tokens / np.size(batch.segment_ids)
        if cells and u.share_prefix:  # the tokens the learner did not run again: prompts laid out once
            averaged["shared_prefix_fraction"] = 1.0 - sum(cells) / (u.epochs * batch.num_tokens)
        critic = {} if self.critic is None else self.critic.update_metrics(critic_collected, step, frozen)
        warmup = 0 if self.critic is None else self.critic.warmup_steps
        return {**stages.update_names(averaged), **self.guard.metrics(), **critic,
                "update/lr": float(self.schedule(max((step - warmup) * u.mini_batches * u.epochs - 1, 0))),
                "update/skipped_total": self.skipped_updates}

    def _verify_previous_push(self, version: str, batch: StepBatch, update_metrics: dict) -> None:
        """The logprob spot check of the previous push, on this step's whole batch (only raw
        logprobs are what the learner recomputes; processed ones differ by design). Under bypass
        the first mini-batch's loss measured the gap; during the critic's warm-up no policy loss
        runs, and the weights the engine sampled with are the initial ones, checked after it."""
        r = self.config.rollout
        if not (r.verify_push and r.logprob_kind == LogprobKind.RAW):
            return
        if version != str(self.step):  # sampled with older weights (rollout.max_staleness): not comparable
            return
        if self.objective.bypass and update_metrics.get("critic/warmup"):
            return
        if self.objective.bypass:
            gap = (float(update_metrics.get("mismatch/abs_log_ratio_max", np.nan)),
                   int(update_metrics.get("mismatch/num_tokens", 0)))
        else:
            gap = stages.push_gap(batch)
        stages.check_push(version, *gap, tolerance=self.config.rollout.push_tolerance)

    def _push(self, step: int) -> dict[str, float]:
        push_metrics = self.engine.update_weights(self._engine_weights(), version=str(step)) or {}
        if self.config.rollout.verify_push and self.engine.weight_version != str(step):
            raise PushVerificationError(
                f"pushed weight version {step} but the engine reports {self.engine.weight_version!r}")
        return push_metrics

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out reward, unparsable fraction and pass@``eval.k`` on ``data.eval_files``: the same
        sampling and reward code as training, through ``jaxrl eval``'s (docs/evaluation.md); with an
        ``env`` section the held-out prompts are conversations too, and ``heldout/env/*`` their metrics."""
        if not self.eval_examples:
            return {}
        e = self.config.eval
        # With an env section: the held-out prompts are conversations, recorded for heldout/env/*.
        conversations, played = recording_conversations(self.engine, self.envs)
        result = evaluate(self.engine, self.router, self.tokenizer, self.eval_examples,
                          self._sampling(_seed(self.config.seed, -1), e.temperature), e.samples, e.k,
                          on_error=self.errors.append, generate=conversations)
        return {**result.metrics("heldout"), **{f"heldout/{k}": v for k, v in self.router.take_metrics().items()},
                **{f"heldout/{k}": v for k, v in environment_metrics(played).items()}}

    # ---------------------------------------------------------------- checkpoints
    def _meta(self) -> dict:
        return {"step": self.step, "seed": self.config.seed, **self.rollouts.state(self.step),
                "weight_version": str(self.step), "skipped_updates": self.skipped_updates,
                "guard": self.guard.state(), **({"critic_guard": self.critic.guard.state()} if self.critic else {})}

    def save(self) -> None:
        if self.checkpointer is not None:
            items = {"critic": self.critic.state} if self.critic is not None else None
            self.checkpointer.save(self.step, self.state, self._meta(), items)

    def _restore(self) -> None:
        if self.critic is None:  # a checkpointer exists: check_fresh_start refused --resume without one
            self.state, meta = self.checkpointer.restore(self.state)
        else:
            try:
                self.state, meta, items = self.checkpointer.restore_with_items(
                    self.state, {"critic": self.critic.state})
            except CheckpointMismatchError as e:
                raise CheckpointMismatchError(
                    f"{e}; the critic exists only with advantage.estimator=gae, so resume this run with the "
                    f"advantage.estimator it was started with, or start afresh") from None
            self.critic.state = items["critic"]
            if "critic_guard" in meta:  # absent in checkpoints written before the critic had its guard
                self.critic.guard.restore(meta["critic_guard"])
        if self.reference is not None:
            log.warning("resume: the KL reference is the restored run's initial weights only if model.* points "
                        "at the same initial checkpoint")
        self.step = int(meta["step"])
        self.skipped_updates = int(meta["skipped_updates"])
        if "guard" in meta:  # absent in checkpoints written before the update guard existed
            self.guard.restore(meta["guard"])
        self.rollouts.restore(meta)

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Trains to ``config.steps`` (``lifecycle.run_rl``); returns the summary, ``rejection_watch``'s lines added."""
        return self.rejections.add_to(run_rl(self))

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.rollouts.close()
        self.router.close()
        if self._owns_engine:
            self.engine.close()
        if self.manager is not None:
            self.manager.stop()


def _copy(tree):
    """A copy of the train state's parameters (one sharding per leaf, all on the mesh) in new
    buffers, as one compiled program rather than one per leaf shape."""
    return jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=jax.tree.map(lambda x: x.sharding, tree))(tree)


def _seed(seed: int, step: int, draw: int = 0) -> int:
    """A distinct, reproducible 31-bit sampling seed per (run seed, step[, extra draw])."""
    entropy = [seed, step + 1] + ([draw] if draw else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0] & 0x7FFFFFFF)
