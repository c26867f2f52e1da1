"""Pure-functional RL losses for LLM post-training (SPEC sections 1-5).

    from jaxrl import losses
    adv, metrics = losses.grpo_advantages(rewards, group_size=8)
"""

from jaxrl.losses.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
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
from jaxrl.losses.policy import (
    AGGREGATION_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    gspo_token_loss,
    loss_normalizer,
    policy_token_loss,
    ppo_clip_token_loss,
    sequence_log_ratio,
)
