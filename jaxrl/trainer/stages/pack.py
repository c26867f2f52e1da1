"""Stage 3, pack: the step's prompts and samples become one :class:`~jaxrl.trainer.batch.StepBatch`.

Rows ``prompt + completion``, next-token aligned and right-padded to one length for the whole
run: the longest prompt plus ``rollout.max_new_tokens`` (a conversation: its environment's token
limit), rounded up so the ``sequence`` mesh axis divides it (into two chunks per shard for ring
attention). The loss's ``mask`` covers the model's tokens of the valid samples; the engine's routes
(MoE) travel with the rows. No metrics.
"""

from __future__ import annotations

from jaxrl.models.sharding import sequence_row_length
from jaxrl.trainer.batch import StepBatch
from jaxrl.trainer.stages.base import Stage, StepContext, StepRecord


class PackStage(Stage):
    name = "pack"

    def __init__(self, context: StepContext):
        config = context.config
        longest = config.data.max_prompt_tokens + config.rollout.max_new_tokens
        if config.env is not None:
            longest = max(task.limits.max_total_tokens for task in config.env.tasks.values())
        self.length = sequence_row_length(longest - 1, context.mesh, config.model.row_chunks())
        self.pad_id = context.tokenizer.pad_token_id
        self.routing_replay = config.update.routing_replay

    def __call__(self, record: StepRecord, step: int) -> tuple[StepRecord, dict[str, float]]:
        batch = StepBatch.from_samples(record.flat, self.length, self.pad_id, record.valid)
        if self.routing_replay and batch.routed_experts is None:
            raise ValueError("update.routing_replay needs the engine's routed experts, and the engine returned none: "
                             "start the SGLang servers with rollout.sglang.server.return_routed_experts=true")
        return record.replace(batch=batch), {}
