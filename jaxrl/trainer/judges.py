"""The run's reward router with its judges: the one place a config's ``judges`` fleets meet its
``reward.tasks`` (docs/training.md#generative-verifier-rewards).

``jaxrl.reward`` sits below ``jaxrl.rollout`` and cannot start or call an SGLang fleet; the
router takes served judge models instead. This module serves them (``SGLangJudge``: starts a
managed fleet or checks external URLs) and builds the router that owns them, for ``jaxrl
train`` and for ``jaxrl eval`` / ``jaxrl filter``.
"""

from __future__ import annotations

import os

import jax

from jaxrl.errors import InputError
from jaxrl.reward import SandboxedRewardRouter, build_router
from jaxrl.rollout.sglang.judge import SGLangJudge


def judge_cache_path(output_dir: str) -> str:
    """Where a run keeps its judge scores: ``OUTPUT_DIR/judge_cache/process-<i>.jsonl``, one file per
    JAX process (each scores the whole batch), read back on ``--resume`` and deleted by ``--overwrite``."""
    return os.path.join(output_dir, "judge_cache", f"process-{jax.process_index()}.jsonl")


def build_reward_router(config, judge_cache: str | None = None) -> SandboxedRewardRouter:
    """``build_router(config.reward)`` with a served model for every judge a task names (``config``: a
    ``TrainConfig``); judge scores cached in memory and, given ``judge_cache``, in that file.
    Judges the tasks do not name are not started. The router owns the judges: its ``close()``
    stops the fleets started here."""
    used = sorted({task.judge.server for task in config.reward.tasks.values() if task.judge is not None})
    if jax.process_count() > 1:
        managed = [name for name in used if config.judges[name].server is not None]
        if managed:
            raise ValueError(f"judges.{managed[0]}.server starts a judge fleet in each of the {jax.process_count()} "
                             f"JAX processes, on the same ports; serve it once and give judges.{managed[0]}.urls")
    judges = {}
    try:
        for name in used:
            try:
                judges[name] = SGLangJudge(config.judges[name])
            except InputError as e:  # an external URL that is down or not an SGLang server
                raise InputError(f"judges.{name}: {e}") from None
        return build_router(config.reward, judges=judges, judge_cache=judge_cache)
    except BaseException:
        for judge in judges.values():
            judge.close()
        raise
