"""Interim demo: the loss library training a toy policy on CPU (replaced by the trainer's demo).

A tabular "language model" (one categorical distribution over ``V`` tokens per
prompt and position) samples ``G`` responses of variable length per prompt.
The reward of a response is the fraction of its tokens that match the prompt's
hidden target string. Each step: GRPO advantages (SPEC 1) -> ``rl_objective``
(PPO clip-higher + k2-as-loss KL through the appendix-G off-policy form +
token-mean aggregation, SPEC 2-3) -> ``S`` (default 4) Adam steps, each over two micro-batches of
the fixed batch (SPEC 7). The mean reward rises from chance (1/V) towards 1.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl import losses

NUM_PROMPTS, GROUP, LENGTH, VOCAB = 4, 8, 6, 8


def _logp_of(theta: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[P, T, V]`` logits, ``[P, G, T]`` tokens -> ``[P*G, T]`` token logprobs."""
    logits = jnp.broadcast_to(theta[:, None], (NUM_PROMPTS, GROUP, LENGTH, VOCAB))
    return losses.token_logprobs_from_logits(logits, tokens).reshape(NUM_PROMPTS * GROUP, LENGTH)


def _sample(theta, key, targets):
    token_key, length_key = jax.random.split(key)
    logits = jnp.broadcast_to(theta[:, None], (NUM_PROMPTS, GROUP, LENGTH, VOCAB))
    tokens = jax.random.categorical(token_key, logits)
    lengths = jax.random.randint(length_key, (NUM_PROMPTS, GROUP), 3, LENGTH + 1)
    mask = (jnp.arange(LENGTH) < lengths[..., None]).astype(jnp.float32)
    hits = jnp.sum((tokens == targets[:, None]) * mask, axis=-1)
    rewards = hits / jnp.sum(mask, axis=-1)
    return tokens, mask.reshape(-1, LENGTH), rewards


@functools.partial(jax.jit, static_argnums=(0, 1, 7))
def _outer_step(config, optimizer, theta, opt_state, ref_theta, targets, key, inner_steps):
    tokens, mask, rewards = _sample(theta, key, targets)
    adv, adv_metrics = losses.grpo_advantages(rewards)
    advantages = losses.broadcast_to_tokens(adv.reshape(-1), mask)
    old_logp = _logp_of(theta, tokens)
    ref_logp = _logp_of(ref_theta, tokens)
    normalizer = losses.loss_normalizer(config.aggregation, mask)  # the global batch, once
    halves = (slice(0, NUM_PROMPTS * GROUP // 2), slice(NUM_PROMPTS * GROUP // 2, None))

    def loss_fn(params):
        logp = _logp_of(params, tokens)
        total, metrics = 0.0, None
        for rows in halves:  # two micro-batches whose losses sum to the full-batch loss
            part, metrics = losses.rl_objective(
                config, logp[rows], old_logp[rows], advantages[rows], mask[rows],
                ref_logp=ref_logp[rows], normalizer=normalizer)
            total = total + part
        return total, metrics

    def inner(carry, _):
        params, state = carry
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = optimizer.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), (loss, metrics["clip_frac"], metrics["kl_k3"])

    (theta, opt_state), (loss, clip_frac, kl) = jax.lax.scan(inner, (theta, opt_state), None, length=inner_steps)
    stats = {"reward": jnp.mean(rewards), "loss": loss[-1], "clip_frac": clip_frac[-1], "kl_k3": kl[-1],
             "zero_var": adv_metrics["zero_variance_groups"]}
    return theta, opt_state, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxrl demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="outer steps (sample, score, update)")
    parser.add_argument("--inner-steps", type=int, default=4, help="optimizer steps per batch (S)")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    config = losses.ObjectiveConfig(policy_loss="ppo", eps_low=0.2, eps_high=0.28, aggregation="token-mean",
                                    kl_kind="k2-as-loss", kl_coef=0.01)
    optimizer = optax.adam(args.lr)
    key = jax.random.key(args.seed)
    targets = jax.random.randint(jax.random.fold_in(key, 1), (NUM_PROMPTS, LENGTH), 0, VOCAB)
    theta = jnp.zeros((NUM_PROMPTS, LENGTH, VOCAB))
    ref_theta, opt_state = theta, optimizer.init(theta)

    print(f"jaxrl demo: GRPO + PPO (clip 0.2/0.28) + k2-as-loss KL on a tabular policy; "
          f"{NUM_PROMPTS} prompts x {GROUP} responses, up to {LENGTH} tokens, vocabulary {VOCAB}; "
          f"chance reward {1 / VOCAB:.3f}")
    print(f"{'step':>4} {'reward':>7} {'loss':>9} {'clip_frac':>9} {'kl_k3':>8} {'zero-var groups':>15}")
    rewards = []
    for step in range(args.steps):
        theta, opt_state, stats = _outer_step(config, optimizer, theta, opt_state, ref_theta, targets,
                                              jax.random.fold_in(key, 100 + step), args.inner_steps)
        rewards.append(float(stats["reward"]))
        if step % 5 == 0 or step == args.steps - 1:
            print(f"{step:4d} {rewards[-1]:7.3f} {float(stats['loss']):9.4f} {float(stats['clip_frac']):9.3f} "
                  f"{float(stats['kl_k3']):8.4f} {int(stats['zero_var']):15d}")
    window = max(1, min(5, args.steps // 4))
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    print(f"mean reward of the first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
    return 0 if last > first else 1


if __name__ == "__main__":
    raise SystemExit(main())
