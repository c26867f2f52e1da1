"""Supervised fine-tuning on prompt/response pairs, with a length curriculum by stages.

Same data, model, mesh, optimizer and checkpoint machinery as RL. The loss is the
token-mean negative log-likelihood of the response tokens (prompt, padding and, in a
multi-turn response, the environment's turns masked out), normalised over the whole
batch so gradient accumulation changes nothing. ``sft.stages`` is the length curriculum
(Motif: 16K -> 32K -> 64K): stage ``i`` trains ``steps`` steps on the pairs whose prompt +
response fit in its ``max_length``; pairs too long for every stage are skipped and counted.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.data import BatchIterator, load_examples, load_tokenizer
from jaxrl.distributed import host_memory
from jaxrl.losses.aggregation import aggregate_loss
from jaxrl.models.sharding import batch_devices, batch_shardings, sequence_row_length
from jaxrl.trainer.batch import StepBatch, UpdateBatch
from jaxrl.trainer.model import build_model, check_vocabulary, learner_mesh, use_compile_cache
from jaxrl.trainer.config import TrainConfig
from jaxrl.trainer.guard import UpdateGuard
from jaxrl.trainer.lifecycle import check_fresh_start, open_run, run_loop
from jaxrl.trainer.update import update_names
from jaxrl.trainer.update import accumulate, build_optimizer, make_train_step

log = logging.getLogger(__name__)


def _sft_micro_loss(model, batch: UpdateBatch, micro_index, *, chunk_size: int):
    logp, entropy, _ = batch.token_logprobs(model, chunk_size=chunk_size)
    live = batch.tokens.mask
    loss = aggregate_loss(-logp, live, "token-mean", batch.normalizer)
    count = jnp.maximum(jnp.sum(live), 1.0)
    return loss, {"nll": jnp.sum(-logp * live) / count, "entropy": jnp.sum(entropy * live) / count}


def sft_loss_fn(micro_batches: int, chunk_size: int):
    """The SFT train step's ``loss_fn(model, batch)``: the response tokens' mean NLL over the batch,
    accumulated over ``micro_batches``, the LM head in chunks of ``chunk_size`` tokens per device
    (``update.logprob_chunk_size``, as in RL; ``jaxrl compile`` lowers the same function)."""
    return accumulate(functools.partial(_sft_micro_loss, chunk_size=chunk_size), micro_batches)


def stage_row_length(max_length: int, mesh, policy) -> int:
    """The learner's row length for a stage of ``max_length`` tokens: ``max_length - 1`` next-token
    columns, rounded up so that the mesh's sequence shards (``policy``'s chunks per shard) divide it."""
    return sequence_row_length(max_length - 1, mesh, policy.row_chunks())


class SFTTrainer:
    """``run()`` trains through every stage of ``config.sft.stages`` and returns a summary."""

    def __init__(self, config: TrainConfig, *, resume: bool = False, overwrite: bool = False):
        """``resume`` and ``overwrite`` as for ``RLTrainer``."""
        if not config.sft.stages:
            raise ValueError("sft.stages is empty; give at least one stage, e.g. [{steps: 100, max_length: 512}]")
        self.config = config
        check_fresh_start(config.output_dir, config.checkpoint.directory, resume=resume, overwrite=overwrite)
        self.errors: list[str] = []
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        check_vocabulary(config.model, self.tokenizer, config.data.tokenizer)
        self.examples, self.data_report = load_examples(
            config.data.train_files, config.data, self.tokenizer, with_response=True)
        lengths = np.asarray([len(e.prompt_ids) + len(e.response_ids) for e in self.examples])
        self.too_long = int((lengths > config.sft.stages[-1].max_length).sum())
        self.lengths = lengths
        use_compile_cache(config.compile_cache_dir)
        self.mesh = learner_mesh(config)
        host_memory.keep_freed_memory(self.mesh)
        model = build_model(config.model, self.mesh, packed_rows=config.sft.pack)
        self.total_steps = sum(s.steps for s in config.sft.stages)
        optimizer, self.schedule = build_optimizer(config.optimizer, self.total_steps)
        self.train_step, self.state = make_train_step(
            model, optimizer, sft_loss_fn(config.sft.micro_batches, config.update.logprob_chunk_size), self.mesh)
        self.guard = UpdateGuard(config.update.max_consecutive_skips, config.update.spike_factor, self._warn)
        self.checkpointer = open_run(config, resume=resume, overwrite=overwrite)
        self.step = 0
        self._stage_index = -1
        self.iterator: BatchIterator | None = None
        if resume:
            self.state, meta = self.checkpointer.restore(self.state)
            self.step = int(meta["step"])
            if "guard" in meta:  # absent in checkpoints written before the update guard existed
                self.guard.restore(meta["guard"])
            self._enter_stage(int(meta["stage"]))
            self.iterator.restore(meta["data"])

    def _warn(self, message: str) -> None:
        log.warning(message)
        self.errors.append(message)

    def _stage_of(self, step: int) -> int:
        """The stage that trains global step ``step`` (1-based)."""
        end = 0
        for i, stage in enumerate(self.config.sft.stages):
            end += stage.steps
            if step <= end:
                return i
        return len(self.config.sft.stages) - 1

    def _enter_stage(self, index: int) -> None:
        stage = self.config.sft.stages[index]
        chosen = [e for e, n in zip(self.examples, self.lengths, strict=True) if n <= stage.max_length]
        if not chosen:
            raise ValueError(
                f"sft.stages[{index}] (max_length={stage.max_length}) has no pair short enough; the shortest "
                f"prompt+response has {int(self.lengths.min())} tokens")
        # As in RL, every process reads the same global batch; the device work is sharded over the
        # global mesh (jaxrl.distributed), so the batch does not depend on the number of processes.
        data = self.config.data
        self.iterator = BatchIterator(  # a stage may mix its data otherwise than data.mixture (Motif's stages)
            chosen, self.config.sft.batch_size, seed=data.seed + index, shuffle=data.shuffle,
            mixture=data.mixture if stage.mixture is None else stage.mixture, mixture_field=data.mixture_field)
        self._stage_index = index

    def train_step_once(self) -> dict[str, Any]:
        step = self.step + 1
        stage_index = self._stage_of(step)
        if stage_index != self._stage_index:
            self._enter_stage(stage_index)
        t0 = time.perf_counter()
        examples = next(self.iterator)
        stage = self.config.sft.stages[stage_index]
        length = stage_row_length(stage.max_length, self.mesh, self.config.model)
        pairs = StepBatch.pack([e.prompt_ids for e in examples], [e.response_ids for e in examples], length,
                               self.tokenizer.pad_token_id, model_masks=[e.response_mask for e in examples])
        sft = self.config.sft
        (batch,) = pairs.mini_batches(1, "token-mean", step, pack=sft.pack, micro_batches=sft.micro_batches,
                                      devices=batch_devices(self.mesh))
        padding = {}
        if batch.packed is not None:  # what packing saved: the padding of the rows the learner runs
            padding = {"padding_fraction": batch.packed.padding_fraction,
                       "padding_fraction_unpacked": 1.0 - pairs.num_tokens / np.size(pairs.segment_ids)}
        # Placed on the mesh here: jit refuses numpy inputs for arrays spread over processes.
        batch = jax.device_put(batch, batch_shardings(batch, self.mesh))
        self.state, metrics = self.train_step(self.state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.guard.check(step, metrics)
        self.step = step
        elapsed = time.perf_counter() - t0
        return {**update_names({**metrics, **padding}), **self.guard.metrics(),
                "update/lr": float(self.schedule(step - 1)), "sft/stage": stage_index,
                "sft/max_length": stage.max_length, "sft/tokens": pairs.num_tokens,
                "data/bad_rows": self.data_report.bad_rows, "data/too_long_for_every_stage": self.too_long,
                "time/step": elapsed, "time/tokens_per_second": pairs.num_tokens / elapsed}

    def model(self):
        return nnx.merge(self.train_step.graphdef, self.state["params"])

    def save(self) -> None:
        self.checkpointer.save(self.step, self.state, {
            "step": self.step, "stage": self._stage_index, "data": self.iterator.state(),
            "guard": self.guard.state()})

    def run(self) -> dict[str, Any]:
        """Trains through every stage (``lifecycle.run_loop``); returns the summary."""
        return run_loop(self, self.total_steps)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
