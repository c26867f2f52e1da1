"""The RL update loop (SPEC section 7): rollout, score, advantages, old/ref logprobs, S updates, push.

Per outer step k:
1. draw ``prompts_per_step`` prompts from the Grain iterator;
2. generate ``group_size`` samples each with the rollout engine (current weights);
3. score them with the per-task reward functions; unparsable samples (and samples whose
   reward function raised) are masked out of the gradient and out of their group's
   baseline when ``reward.mask_unparsable`` (Motif);
4. compute advantages once (SPEC 1) from the scores;
5. recompute ``old_logp`` on the learner, or bypass with the engine's logprobs;
6. compute the reference model's logprobs when the objective's KL term needs them
   (the reference parameters are held sharded, with no optimizer state);
7. run ``update.mini_batches`` (S) optimizer steps over mini-batches of that fixed batch,
   each with gradient accumulation over ``update.micro_batches``; the objective is the
   loss library's ``rl_objective`` assembled from ``config.objective`` (Clip-Cov / KL-Cov
   tokens are chosen once per mini-batch, see ``rl_loss_fn``);
8. push the weights to the engine and verify the push on a probe;
9. log every metric (JSONL, TensorBoard, progress bar), checkpoint every N steps.

Everything random is derived from ``(config.seed, step)``, so a resumed run reproduces the
uninterrupted one exactly (same samples, same updates) on CPU in float32.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import distributed
from jaxrl.data import BatchIterator, load_examples, load_tokenizer
from jaxrl.losses import advantages as advantage_lib
from jaxrl.losses import (ObjectiveConfig, batch_filter, entropy_control_selection, kl_in_reward,
                          loss_normalizer, mismatch_metrics, mismatch_metrics_by_rollout_prob, rl_objective)
from jaxrl.models import make_mesh, make_train_step, save_hf_checkpoint
from jaxrl.models.sharding import batch_shardings
from jaxrl.reward import build_router
from jaxrl.rollout.base import LogprobKind, RolloutEngine, SamplingParams
from jaxrl.trainer.common import (LogprobScorer, accumulate, build_model, build_optimizer, join_micro_batches,
                                  pack_sequences, split_micro_batches)
from jaxrl.trainer.config import AdvantageConfig, TrainConfig
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.lifecycle import StopSignals, check_fresh_start, end_step, open_run
from jaxrl.trainer.metrics import MetricsLogger, read_jsonl
from jaxrl.trainer.plots import fit_run_entropy_law, plot_run

log = logging.getLogger(__name__)

_ADVANTAGES = {
    "grpo": advantage_lib.grpo_advantages,
    "dr_grpo": advantage_lib.dr_grpo_advantages,
    "rloo": advantage_lib.rloo_advantages,
    "reinforce": advantage_lib.reinforce_advantages,
    "reinforce_pp_baseline": advantage_lib.reinforce_pp_baseline_advantages,
}
# Estimators that normalise by a group std take the std clip options.
_STD_OPTIONS = {"grpo": ("std_min", "std_max", "ddof")}


class PushVerificationError(RuntimeError):
    """The engine's logprobs after a weight push disagree with the learner's."""


def sequence_advantages(config, scores: np.ndarray, valid: np.ndarray, group_size: int) -> tuple[np.ndarray, dict]:
    """[N] advantages for N = prompts * G samples in prompt-major order (SPEC 1).

    Samples with ``valid == False`` (unparsable, masked) are moved to an extra group of their
    own so they never shift another sample's baseline; their advantage is set to 0.
    """
    n = len(scores)
    num_prompts = n // group_size
    fn = _ADVANTAGES[config.estimator]
    options = {k: getattr(config, k) for k in _STD_OPTIONS.get(config.estimator, ())}
    rewards = jnp.asarray(scores, jnp.float32)
    if config.estimator in AdvantageConfig.GROUPED:
        group_ids = np.where(valid, np.arange(n) // group_size, num_prompts).astype(np.int32)
        adv, _ = fn(rewards, group_ids=jnp.asarray(group_ids), num_groups=num_prompts + 1, **options)
    else:
        adv, _ = fn(rewards, **options)
    # The estimator's own zero-variance count would include the extra group of invalid samples
    # (and, for "reinforce", the whole batch): the fraction below counts prompt groups, valid samples only.
    adv = np.where(valid, np.asarray(adv), 0.0).astype(np.float32)
    valid_groups = [valid[i * group_size:(i + 1) * group_size] for i in range(num_prompts)]
    zero = sum(
        1 for i, v in enumerate(valid_groups)
        if v.any() and np.ptp(scores[i * group_size:(i + 1) * group_size][v]) == 0
    )
    return adv, {"advantage/zero_variance_group_fraction": zero / max(num_prompts, 1)}


def make_engine(config: TrainConfig, model, mesh) -> tuple[RolloutEngine, Any]:
    """(engine, server manager or None). The embedded sampler reads ``model``'s arrays by
    reference; SGLang servers start from ``rollout.sglang.server.model_path``."""
    r = config.rollout
    if r.engine == "sglang":
        from jaxrl.rollout.sglang import ServerManager, SGLangEngine

        server = r.sglang.server
        if jax.process_count() > 1:
            # Processes that share a host (one per GPU under SLURM) must not share ports: each
            # process starts its own servers, so process p takes the block after process p-1's.
            server = dataclasses.replace(server, base_port=server.base_port + jax.process_index() * server.num_servers)
        manager = ServerManager(server).start()
        return SGLangEngine(manager, push=r.sglang.push, client=r.sglang.client), manager
    from jaxrl.rollout.sampler import JaxSampler

    sequences = r.prompts_per_step * r.group_size
    return JaxSampler(model, mesh=mesh, max_batch=max(sequences, config.eval.max_prompts * config.eval.samples)), None


def dump_alignment_batch(path: str, batch: dict, generated: np.ndarray, prompt_lengths: list[int],
                         meta: dict) -> None:
    """Saves a packed rollout batch in the alignment checker's format (``jaxrl align report``).

    The packed arrays are next-token aligned (column t scores ``targets[:, t]``, the token at
    position t+1); the dump is token-aligned, so every per-token array moves one column right.
    Learner logprobs are ``old_logp`` (the recompute; the engine's own under bypass).
    """
    from jaxrl.align.dump import AlignmentBatch

    def token_aligned(packed, fill=0):
        return np.concatenate([np.full((packed.shape[0], 1), fill, packed.dtype), packed], axis=1)

    os.makedirs(os.path.dirname(path), exist_ok=True)
    model_mask = token_aligned(generated, False)
    tokens = token_aligned(batch["targets"])
    tokens[:, 0] = batch["input_ids"][:, 0]
    AlignmentBatch(
        token_ids=tokens, model_mask=model_mask,
        rollout_logprobs=token_aligned(np.asarray(batch["rollout_logp"], np.float32)),
        learner_logprobs=np.where(model_mask, token_aligned(np.asarray(batch["old_logp"], np.float32)), 0.0),
        turn_ids=np.where(model_mask, 0, -1), prompt_lengths=np.asarray(prompt_lengths),
        lengths=batch["segment_ids"].sum(axis=1) + 1, meta=meta,
    ).save(path)


def rl_loss_fn(objective: ObjectiveConfig, *, seed: int, micro_batches: int, chunk_size: int) -> Callable:
    """``loss_fn(model, batch) -> (loss, metrics)`` of one optimizer step: ``rl_objective`` summed
    over ``micro_batches`` micro-batches (``trainer.common.accumulate``).

    ``batch`` holds the mini-batch's ``input_ids, positions, segment_ids, targets, mask, advantages,
    old_logp, rollout_logp`` (and optionally ``ref_logp``) ``[N, T]``, the 0-d ``normalizer`` of
    the whole mini-batch and the 0-d ``key_seed``; Clip-Cov draws with
    ``fold_in(key(seed), key_seed)``. Clip-Cov and KL-Cov choose tokens from statistics over
    the whole mini-batch (SPEC 4), so with them and more than one micro-batch a no-gradient
    forward over every micro-batch first gives the mini-batch's logprobs, the tokens are chosen
    once from those, and each micro-batch gets its rows of the choice: the update does not
    depend on the split. That extra forward is paid only then; one micro-batch sees the whole
    mini-batch and chooses for itself.
    """
    def selection_key(batch):
        return jax.random.fold_in(jax.random.key(seed), batch["key_seed"])

    def token_logprobs(model, batch):
        return model.token_logprobs(batch["input_ids"], batch["positions"], batch["segment_ids"], batch["targets"],
                                    chunk_size=chunk_size)

    def micro_loss(model, batch, _micro_index):
        """The objective on one micro-batch (normalised by the mini-batch's global normalizer)."""
        logp, entropy, out = token_logprobs(model, batch)
        loss, metrics = rl_objective(
            objective, logp, batch["old_logp"], batch["advantages"], batch["mask"],
            rollout_logp=batch["rollout_logp"], ref_logp=batch.get("ref_logp"), entropy=entropy,
            normalizer=batch["normalizer"], key=selection_key(batch), cov_selection=batch.get("cov_selection"),
        )
        if objective.bypass:
            # No recompute pass: on the first mini-batch the learner's logp *is* the recompute.
            metrics.update(mismatch_metrics(jax.lax.stop_gradient(logp), batch["rollout_logp"], batch["mask"]))
        if model.config.moe_layer_indices:
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss
            metrics = dict(metrics, moe_aux_loss=out.aux_loss)
        return loss, metrics

    accumulated = accumulate(micro_loss, micro_batches)
    if objective.entropy_control == "none" or micro_batches == 1:
        return accumulated

    def loss_fn(model, batch):
        graphdef, params = nnx.split(model)
        frozen = jax.lax.stop_gradient(params)  # the selection is a statistic: no gradient, no residuals

        def micro_logp(micro_batch):
            return token_logprobs(nnx.merge(graphdef, frozen), micro_batch)[0]

        inputs = {k: batch[k] for k in ("input_ids", "positions", "segment_ids", "targets")}
        logp = join_micro_batches(jax.lax.map(micro_logp, split_micro_batches(inputs, micro_batches)))
        selection, selection_metrics = entropy_control_selection(
            objective, logp, batch["advantages"], batch["mask"], key=selection_key(batch))
        loss, metrics = accumulated(model, dict(batch, cov_selection=selection))
        return loss, {**metrics, **selection_metrics}

    return loss_fn


class RLTrainer:
    """Builds everything from a TrainConfig; ``run()`` trains and returns the final summary."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, overwrite: bool = False,
                 engine: RolloutEngine | None = None):
        """``resume``: continue from the newest intact checkpoint. ``overwrite``: delete an earlier
        run's metrics and checkpoints in these folders (without it, a fresh start over an earlier
        run raises RunExistsError before anything is touched)."""
        self.config = config
        check_fresh_start(config.output_dir, config.checkpoint.directory, resume=resume, overwrite=overwrite)
        self.errors: list[str] = []
        data = config.data
        self.tokenizer = load_tokenizer(data.tokenizer)
        self.router = build_router(config.reward)
        self.examples, self.data_report = load_examples(data.train_files, data, self.tokenizer,
                                                        row_check=self.router.row_problem)
        self.eval_examples = (
            load_examples(data.eval_files, data, self.tokenizer, row_check=self.router.row_problem)[0]
            [: config.eval.max_prompts] if data.eval_files else []
        )
        # Every process reads the same global batch and runs the same host-side loop (sampling
        # requests, rewards, advantages); the device work is sharded over the global mesh. So the
        # batch is the same for any number of processes (jaxrl.distributed).
        self.iterator = BatchIterator(
            self.examples, config.rollout.prompts_per_step, seed=data.seed, shuffle=data.shuffle,
        )
        self.mesh = make_mesh(config.mesh)
        model = build_model(config.model, self.mesh)
        self.length = data.max_prompt_tokens + config.rollout.max_new_tokens - 1
        self.total_updates = config.steps * config.update.mini_batches
        optimizer, self.schedule = build_optimizer(config.optimizer, self.total_updates)
        loss_fn = rl_loss_fn(config.objective, seed=config.seed, micro_batches=config.update.micro_batches,
                             chunk_size=config.update.logprob_chunk_size)
        self.train_step, self.state = make_train_step(model, optimizer, loss_fn, self.mesh)
        graphdef = self.train_step.graphdef
        sequences = config.rollout.prompts_per_step * config.rollout.group_size
        rows = sequences // (config.update.mini_batches * config.update.micro_batches)
        self.scorer = LogprobScorer(graphdef, self.mesh, rows, config.update.logprob_chunk_size)
        self.needs_reference = config.objective.kl_kind != "none" or config.update.reference_metrics
        # The frozen reference: a copy of the initial parameters, sharded like them, no optimizer state.
        self.reference = jax.tree.map(jnp.copy, self.state["params"]) if self.needs_reference else None
        self.step = 0
        self.skipped_updates = 0
        self.guard = UpdateGuard(config.update.max_consecutive_skips, config.update.spike_factor, self._warn)
        self.checkpointer = open_run(config, resume=resume, overwrite=overwrite)
        if resume:
            self._restore()
        self.manager = None
        if engine is None:
            engine, self.manager = make_engine(config, self.model(), self.mesh)
        self.engine = engine
        if self.step > 0 or engine.weight_version != "0":
            self.engine.update_weights(self.model(), version=str(self.step))

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
            max_new_tokens=r.max_new_tokens, stop_token_ids=(self.tokenizer.eos_token_id,), seed=seed,
            logprob_kind=r.logprob_kind, **changes,
        )

    # ---------------------------------------------------------------- one step
    def _rollout(self, examples, seed: int, n: int, temperature: float | None = None):
        prompts = [e.prompt_ids.tolist() for e in examples]
        return self.engine.generate(prompts, self._sampling(seed, temperature), n=n)

    def _score(self, examples, samples):
        flat = [(e, s) for e, group in zip(examples, samples) for s in group]
        responses = [self.tokenizer.decode(s.output_ids, skip_special_tokens=True) for _, s in flat]
        return self.router.score(
            [e.prompt for e, _ in flat], responses, [s.output_ids.tolist() for _, s in flat],
            [e.row for e, _ in flat], on_error=self.errors.append,
        ), flat

    def train_step_once(self) -> dict[str, Any]:
        config, r, objective = self.config, self.config.rollout, self.config.objective
        step = self.step + 1
        timings = {}
        t0 = time.perf_counter()
        examples = next(self.iterator)
        samples = self._rollout(examples, seed=_seed(config.seed, step), n=r.group_size)
        timings["rollout"] = time.perf_counter() - t0

        t = time.perf_counter()
        scored, flat = self._score(examples, samples)
        timings["reward"] = time.perf_counter() - t
        valid = ~scored.unparsable if config.reward.mask_unparsable else np.ones(len(flat), bool)
        batch = pack_sequences(
            [e.prompt_ids for e, _ in flat], [s.output_ids for _, s in flat], self.length,
            self.tokenizer.pad_token_id, completion_values=[s.output_logprobs for _, s in flat],
        )
        batch["rollout_logp"] = batch.pop("values")
        generated = batch["mask"] > 0  # every engine token, before unparsable samples leave the gradient
        batch["mask"] = batch["mask"] * valid[:, None]

        t = time.perf_counter()
        metrics: dict[str, Any] = {}
        if objective.bypass:
            batch["old_logp"] = batch["rollout_logp"]
            push_check = None  # measured in the loss, on the first mini-batch
        else:
            batch["old_logp"], entropy = self.scorer(self.state["params"], batch)
            recomputed_entropy = _masked_mean(entropy, batch["mask"])
            pair = (jnp.asarray(batch["old_logp"]), jnp.asarray(batch["rollout_logp"]), jnp.asarray(batch["mask"]))
            metrics.update(mismatch_metrics(*pair))
            metrics.update(_bucketed(mismatch_metrics_by_rollout_prob(*pair)))
            # Every engine token, masked samples included: the push check needs no reward.
            gap = np.abs(batch["old_logp"] - batch["rollout_logp"])[generated]
            push_check = (float(gap.max()) if gap.size else float("nan"), int(gap.size))
        if self.needs_reference:
            batch["ref_logp"] = self.scorer(self.reference, batch)[0]
        timings["recompute"] = time.perf_counter() - t
        every = config.logging.dump_batch_every
        if every and step % every == 0 and distributed.is_main_process():
            dump_alignment_batch(os.path.join(config.output_dir, "batches", f"step-{step:06d}.npz"), batch, generated,
                                 [len(e.prompt_ids) for e, _ in flat],
                                 {"step": step, "weight_version": self.engine.weight_version, "source": "jaxrl train"})

        rewards = scored.scores
        if objective.kl_in_reward_coef > 0:
            rewards = np.asarray(kl_in_reward(
                jnp.asarray(rewards), jnp.asarray(batch["old_logp"]), jnp.asarray(batch["ref_logp"]),
                jnp.asarray(batch["mask"]), coef=objective.kl_in_reward_coef))
        adv, adv_metrics = sequence_advantages(config.advantage, rewards, valid, r.group_size)
        batch["advantages"] = adv[:, None] * batch["mask"]

        skip = False
        if objective.batch_filter_threshold is not None and not objective.bypass:
            skip, filter_metrics = batch_filter(
                jnp.asarray(batch["old_logp"]), jnp.asarray(batch["rollout_logp"]), jnp.asarray(batch["mask"]),
                threshold=objective.batch_filter_threshold, metric=objective.batch_filter_metric)
            skip = bool(skip)
            metrics.update(filter_metrics)
        self.skipped_updates += int(skip)

        t = time.perf_counter()
        if not skip:
            metrics.update(self._update(batch, step))
        if not objective.bypass:
            # The policy's entropy on the whole batch before the update (the loss's is per mini-batch).
            metrics["entropy"] = recomputed_entropy
        if r.verify_push and r.logprob_kind == LogprobKind.RAW:
            # The logprob spot check of the previous push, on this step's whole batch (only raw
            # logprobs are what the learner recomputes; processed ones differ by design).
            if push_check is None:
                push_check = (float(metrics.get("mismatch_abs_log_ratio_max", np.nan)),
                              int(metrics.get("mismatch_num_tokens", 0)))
            self.check_push(samples[0][0].weight_version, *push_check)
        timings["update"] = time.perf_counter() - t

        t = time.perf_counter()
        push_metrics = self.engine.update_weights(self.model(), version=str(step))
        if r.verify_push and self.engine.weight_version != str(step):
            raise PushVerificationError(
                f"pushed weight version {step} but the engine reports {self.engine.weight_version!r}")
        timings["weight_push"] = time.perf_counter() - t
        self.step = step

        lengths = np.asarray([len(s.output_ids) for _, s in flat])
        elapsed = time.perf_counter() - t0
        metrics = {
            **_reward_metrics(scored),
            **adv_metrics,
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            **{_metric_name(k): v for k, v in metrics.items()},
            **(push_metrics or {}),
            "lr": float(self.schedule(max(step * config.update.mini_batches - 1, 0))),
            "update/skipped_total": self.skipped_updates,
            **self.guard.metrics(),
            "data/bad_rows": self.data_report.bad_rows,
            **{f"time/{k}": v for k, v in timings.items()},
            "time/step": elapsed,
            "tokens_per_second": float((batch["segment_ids"] > 0).sum()) / elapsed,
        }
        return metrics

    def _update(self, batch: dict, step: int) -> dict[str, float]:
        """S optimizer steps over mini-batches of the fixed batch (each micro-batch-accumulated)."""
        u = self.config.update
        n = batch["input_ids"].shape[0]
        size = n // u.mini_batches
        keys = ("input_ids", "positions", "segment_ids", "targets", "mask", "advantages", "old_logp",
                "rollout_logp") + (("ref_logp",) if self.needs_reference else ())
        mode = self.config.objective.aggregation
        collected = []
        for s in range(u.mini_batches):
            mini = {k: batch[k][s * size:(s + 1) * size] for k in keys}
            normalizer = float(loss_normalizer(mode, jnp.asarray(mini["mask"])))
            mini["key_seed"] = np.int32(step * u.mini_batches + s)
            mini["normalizer"] = np.float32(normalizer)
            # Placed on the mesh here: jit refuses numpy inputs for arrays spread over processes.
            mini = jax.device_put(mini, batch_shardings(mini, self.mesh))
            self.state, metrics = self.train_step(self.state, mini)
            collected.append(jax.device_get(metrics))
            self.guard.check(step, collected[-1])
        # Mismatch metrics measured in the loss (bypass) are valid on the first mini-batch only,
        # before any update; everything else is averaged over the S mini-batches.
        return {k: float(collected[0][k]) if k.startswith("mismatch_") else float(np.mean([m[k] for m in collected]))
                for k in collected[0]}

    def check_push(self, version: str, largest: float, tokens: int) -> None:
        """Verifies a weight push: the engine's logprobs of the batch sampled with weights ``version``
        agree with the learner's recompute: ``largest`` (max |dlogp| over ``tokens`` generated
        tokens) within ``rollout.push_tolerance``. A check of zero tokens or a NaN fails: it
        proves nothing. Raises PushVerificationError."""
        tolerance = self.config.rollout.push_tolerance
        if tokens == 0:
            raise PushVerificationError(
                f"the push check of weight version {version} compared zero generated tokens, so it proves nothing; "
                f"the engine returned no tokens (or, with objective.bypass, the first mini-batch has none in the "
                f"loss); set rollout.verify_push=false to run without the check")
        if not largest <= tolerance:
            raise PushVerificationError(
                f"the engine sampled with weight version {version} but its logprobs differ from the learner's "
                f"by up to {largest:.3g} nats > rollout.push_tolerance={tolerance}; the engine is not running "
                f"the learner's weights (or raise push_tolerance for low-precision engines)")

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out reward (same reward code as training) on ``data.eval_files``."""
        if not self.eval_examples:
            return {}
        e = self.config.eval
        samples = self._rollout(self.eval_examples, seed=_seed(self.config.seed, -1), n=e.samples,
                                temperature=e.temperature)
        scored, _ = self._score(self.eval_examples, samples)
        return {"heldout/reward": float(scored.scores.mean()),
                "heldout/unparsable": float(scored.unparsable.mean())}

    # ---------------------------------------------------------------- checkpoints
    def _meta(self) -> dict:
        return {"step": self.step, "seed": self.config.seed, "data": self.iterator.state(),
                "weight_version": str(self.step), "skipped_updates": self.skipped_updates,
                "guard": self.guard.state()}

    def save(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.save(self.step, self.state, self._meta())

    def _restore(self) -> None:
        if self.checkpointer is None:
            raise ValueError("--resume needs checkpoint.directory (empty in this config): set it to the folder "
                             "the run saved its checkpoints in, e.g. checkpoint.directory=runs/x/checkpoints")
        self.state, meta = self.checkpointer.restore(self.state)
        if self.needs_reference:
            log.warning("resume: the KL reference is the restored run's initial weights only if model.* points "
                        "at the same initial checkpoint")
        self.step = int(meta["step"])
        self.skipped_updates = int(meta["skipped_updates"])
        if "guard" in meta:  # absent in checkpoints written before the update guard existed
            self.guard.restore(meta["guard"])
        self.iterator.restore(meta["data"])

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        config = self.config
        logger = MetricsLogger(config.output_dir, config.steps, start_step=self.step,
                               progress=config.logging.progress, tensorboard=config.logging.tensorboard)
        summary: dict[str, Any] = {}
        try:
            with StopSignals() as stop:
                if self.step == 0 and self.eval_examples:
                    start = self.evaluate()
                    summary["heldout_start"] = start.get("heldout/reward")
                    logger.log(0, start)
                while self.step < config.steps:
                    metrics = self.train_step_once()
                    final = self.step == config.steps
                    if self.eval_examples and (final or (config.eval.every and self.step % config.eval.every == 0)):
                        metrics.update(self.evaluate())
                    logger.log(self.step, metrics)
                    for message in self.errors:
                        logger.write(message if message.startswith("step ") else f"step {self.step}: {message}")
                    self.errors.clear()
                    end_step(stop, self.checkpointer, self.step, self.save, final)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if config.checkpoint.export_hf:
                save_hf_checkpoint(self.model(), config.checkpoint.export_hf)
                summary["hf_export"] = config.checkpoint.export_hf
        finally:
            logger.close()
        rows = read_jsonl(logger.jsonl_path)
        heldout = [row["heldout/reward"] for row in rows if row.get("heldout/reward") is not None]
        if heldout:
            summary.setdefault("heldout_start", heldout[0])
            summary["heldout_end"] = heldout[-1]
        if config.logging.plots:
            summary["plots"] = plot_run(rows, os.path.join(config.output_dir, "plots"))
        fit = fit_run_entropy_law(rows)
        if fit is not None:
            summary["entropy_law"] = {k: fit[k] for k in ("a", "b", "ceiling", "rmse")}
        summary["metrics"] = logger.jsonl_path
        return summary

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.router.close()
        self.engine.close()
        if self.manager is not None:
            self.manager.stop()


def _seed(seed: int, step: int) -> int:
    """A distinct, reproducible 31-bit sampling seed per (run seed, step)."""
    return int(np.random.SeedSequence([seed, step + 1]).generate_state(1)[0] & 0x7FFFFFFF)


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> float:
    return float((values * mask).sum() / max(float(mask.sum()), 1.0))


def _bucketed(metrics: dict) -> dict[str, float]:
    """Per rollout-probability bucket mismatch stats as scalars ``mismatch_bucket/<stat>/<lo>-<hi>``,
    for the buckets that hold tokens (SPEC 5: the mismatch concentrates on low-probability tokens)."""
    edges = np.asarray(metrics.pop("mismatch_bucket_edges"))
    counts = np.asarray(metrics["mismatch_bucket_num_tokens"])
    out = {}
    for name, values in metrics.items():
        stat = name.removeprefix("mismatch_bucket_")
        for i in np.flatnonzero(counts):
            out[f"mismatch_bucket/{stat}/{edges[i]:.0e}-{edges[i + 1]:.0e}"] = float(np.asarray(values)[i])
    return out


def _metric_name(name: str) -> str:
    """Loss-library metric names -> logged names (``mismatch_k3`` -> ``mismatch/k3``)."""
    for prefix in ("mismatch_", "batch_filter_"):
        if name.startswith(prefix):
            return f"{prefix[:-1]}/{name[len(prefix):]}"
    return name


def _reward_metrics(scored) -> dict[str, float]:
    metrics = {
        "reward/mean": float(scored.scores.mean()),
        "reward/std": float(scored.scores.std()),
        "accuracy": float((scored.scores >= 1.0).mean()),
        "reward/unparsable_fraction": float(scored.unparsable.mean()),
        "reward/raised": float(scored.raised.sum()),
        "reward/timed_out": float(scored.timed_out.sum()),
    }
    tasks = np.asarray(scored.tasks)
    for task in sorted(set(scored.tasks)):
        values = scored.scores[tasks == task]
        metrics[f"reward/{task}/mean"] = float(values.mean())
        metrics[f"reward/{task}/std"] = float(values.std())
    return metrics
