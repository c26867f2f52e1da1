"""Pure-functional RL losses for LLM post-training (SPEC sections 1-5).

    from jaxrl import losses
    adv, metrics = losses.grpo_advantages(rewards, group_size=8)
    loss, metrics = losses.rl_objective(losses.ObjectiveConfig(policy_loss="gspo"), logp, old_logp,
                                        losses.broadcast_to_tokens(adv, mask), mask,
                                        normalizer=losses.loss_normalizer("token-mean", mask))

Modules: ``advantages`` (SPEC 1), ``policy`` (2), ``kl`` (3), ``entropy`` (4),
``mismatch`` (5), ``objective`` (all of them from one typed config).
"""

from jaxrl.losses import advantages, entropy, kl, mismatch, objective, policy
from jaxrl.losses.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
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
    token_logprobs_and_entropy,
    token_logprobs_from_logits,
)
from jaxrl.losses.kl import (
    KL_REGULARIZERS,
    kl_as_loss,
    kl_coefficient,
    kl_in_reward,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_off_policy_token_loss,
)
from jaxrl.losses.mismatch import (
    DEFAULT_PROB_EDGES,
    batch_filter,
    geo_rs,
    mismatch_metrics,
    mismatch_metrics_by_rollout_prob,
    mismatch_metrics_by_turn,
    sequence_mis,
    sequence_tis,
    token_mis,
)
from jaxrl.losses.mismatch import sequence_log_ratio as mismatch_sequence_log_ratio
from jaxrl.losses.mismatch import token_log_ratio as mismatch_token_log_ratio
from jaxrl.losses.mismatch import token_tis
from jaxrl.losses.objective import ObjectiveConfig, entropy_control_selection, rl_objective
from jaxrl.losses.policy import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    gspo_log_ratio,
    gspo_token_loss,
    loss_normalizer,
    masked_log_ratio,
    policy_token_loss,
    ppo_clip_token_loss,
)
