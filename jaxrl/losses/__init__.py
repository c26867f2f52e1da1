"""Pure-functional RL losses for LLM post-training (docs/losses.md).

    from jaxrl import losses
    adv, metrics = losses.grpo_advantages(rewards, group_size=8)
    loss, metrics = losses.rl_objective(losses.ObjectiveConfig(policy_loss="gspo"), logp, old_logp,
                                        losses.broadcast_to_tokens(adv, mask), mask,
                                        normalizer=losses.loss_normalizer("token-mean", mask))

Modules: ``advantages`` (with ``passk``, ``gae`` and the critic's ``value``), ``policy``,
``aggregation``, ``kl``, ``entropy``, ``corrections``, ``mismatch`` (docs/losses.md, one section each),
``objective`` (all of them from one typed config). Token
logprobs and entropy from hidden states come from the model's chunked LM head.
"""

from jaxrl.losses import (advantages, aggregation, corrections, entropy, gae, kl, mismatch, objective, passk, policy,
                          value)
from jaxrl.losses.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    broadcast_to_tokens,
    dr_grpo_advantages,
    grpo_advantages,
    opo_advantages,
    reinforce_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_advantages,
)
from jaxrl.losses.aggregation import AGGREGATION_MODES, aggregate_loss, loss_normalizer
from jaxrl.losses.gae import gae_advantages, whiten_advantages
from jaxrl.losses.passk import grpo_passk_advantages, passk_advantages
from jaxrl.losses.entropy import (
    EntropyLawFit,
    centered_cov,
    clip_cov_mask,
    entropy_bonus,
    fit_entropy_law,
    kl_cov_gap_penalty,
    kl_cov_penalty,
    kl_cov_select,
    token_entropy_from_logits,
    token_logprobs_from_logits,
)
from jaxrl.losses.kl import (
    KL_REGULARIZERS,
    kl_abs,
    kl_as_loss,
    kl_coefficient,
    kl_in_reward,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_off_policy_token_loss,
)
from jaxrl.losses.corrections import geo_rs, sequence_mis, sequence_tis, token_mis, token_tis
from jaxrl.losses.corrections import batch_normalize_is_weights, combine_corrections, sequence_kl_rs
from jaxrl.losses.mismatch import (
    DEFAULT_PROB_EDGES,
    batch_filter,
    mismatch_metrics,
    mismatch_metrics_by_rollout_prob,
    mismatch_metrics_by_turn,
)
from jaxrl.losses.mismatch import sequence_log_ratio as mismatch_sequence_log_ratio
from jaxrl.losses.mismatch import token_log_ratio as mismatch_token_log_ratio
from jaxrl.losses.objective import ObjectiveConfig, entropy_control_selection, is_batch_mean, rl_objective
from jaxrl.losses.value import clipped_value_loss, explained_variance
from jaxrl.losses.policy import (
    DUAL_CLIP_LOSSES,
    POLICY_LOSSES,
    cispo_token_loss,
    gmpo_token_loss,
    gspo_log_ratio,
    gspo_token_loss,
    masked_log_ratio,
    policy_token_loss,
    ppo_clip_token_loss,
    reinforce_token_loss,
    sapo_token_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "AdvantageConfig", "DEFAULT_PROB_EDGES", "DUAL_CLIP_LOSSES",
    "EntropyLawFit", "KL_REGULARIZERS", "ObjectiveConfig", "POLICY_LOSSES", "advantages", "aggregate_loss",
    "aggregation", "batch_filter", "batch_normalize_is_weights", "broadcast_to_tokens", "centered_cov",
    "cispo_token_loss", "clip_cov_mask", "clipped_value_loss", "combine_corrections", "corrections",
    "dr_grpo_advantages", "entropy", "entropy_bonus", "entropy_control_selection", "explained_variance",
    "fit_entropy_law", "gae", "gae_advantages", "geo_rs", "gmpo_token_loss", "grpo_advantages",
    "grpo_passk_advantages", "gspo_log_ratio", "gspo_token_loss", "is_batch_mean", "kl", "kl_abs", "kl_as_loss",
    "kl_coefficient", "kl_cov_gap_penalty", "kl_cov_penalty", "kl_cov_select", "kl_in_reward", "kl_k1", "kl_k2",
    "kl_k3", "kl_off_policy_token_loss", "loss_normalizer", "masked_log_ratio", "mismatch", "mismatch_metrics",
    "mismatch_metrics_by_rollout_prob", "mismatch_metrics_by_turn", "mismatch_sequence_log_ratio",
    "mismatch_token_log_ratio", "objective", "opo_advantages", "passk", "passk_advantages", "policy",
    "policy_token_loss", "ppo_clip_token_loss", "reinforce_advantages", "reinforce_pp_baseline_advantages",
    "reinforce_token_loss", "remax_advantages", "rl_objective", "rloo_advantages", "sapo_token_loss",
    "sequence_advantages", "sequence_kl_rs", "sequence_mis", "sequence_tis", "token_entropy_from_logits",
    "token_logprobs_from_logits", "token_mis", "token_tis", "value", "whiten_advantages",
]
