"""The KL estimators experiment's measurements beyond the training runs (docs/experiments.md#kl-estimators).

Gradients: the policy one run trained (``gradient_policy``, exported at its end) against the SFT
reference. For each of ``gradient_seeds`` seeds, the embedded sampler draws ``group_size``
answers to each of ``gradient_prompts`` training prompts from the policy (on-policy), and the
gradient w.r.t. every policy parameter is taken of each KL term with the loss library's own
functions: ``kl_as_loss`` for k1, k2 and k3 as losses (token-mean), and for k1 in the reward
the REINFORCE surrogate ``sg(k1 summed over the answer) x log pi(answer)`` (token-mean), the
gradient of a sequence reward of ``-k1`` (what ``kl_in_reward`` folds into the reward). Across
seeds: each estimator's mean gradient and its variance (trace of the covariance).

Gaussian: Rethinking KL's worked example (appendix I), q = N(0.1, 0.2^2) against p = N(0, 1),
true KL(q||p) = 1.1344 in closed form, and the k1/k2/k3 values' means and spreads over 10,000
samples per seed.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.experiments.report import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED
from jaxrl.losses import kl as kl_lib

AS_LOSS = ("k1-as-loss", "k2-as-loss", "k3-as-loss")
ESTIMATORS = AS_LOSS + ("k1-in-reward",)
GAUSSIAN = {"mu": 0.1, "sigma": 0.2, "samples": 10_000, "seeds": 5}


def _token_logp(model, ids, lengths):
    """[B, T-1] log pi(token t+1 | prefix), differentiable w.r.t. ``model``'s parameters."""
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    segments = (positions < lengths[:, None]).astype(jnp.int32)
    logits = model.head(model(ids, positions, segments).hidden)[:, :-1]
    return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), ids[:, 1:, None], -1)[..., 0]


def _losses(logp, ref_logp, mask):
    """Each estimator's scalar loss (token-mean over the answers' tokens)."""
    count = jnp.sum(mask)
    out = {kind: jnp.sum(kl_lib.kl_as_loss(kind, logp, ref_logp, mask)) / count for kind in AS_LOSS}
    penalty = jax.lax.stop_gradient(jnp.sum(jnp.where(mask > 0, logp - ref_logp, 0.0), -1, keepdims=True))
    out["k1-in-reward"] = jnp.sum(penalty * jnp.where(mask > 0, logp, 0.0)) / count
    return out


def _batch(engine, prompts, group, seed):
    """(ids [B, L], lengths [B], mask [B, L-1] on the answers' tokens) of fresh policy samples."""
    from jaxrl.rollout.base import SamplingParams

    samples = [s for g in engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=seed), n=group) for s in g]
    rows = [np.concatenate([s.prompt_ids, s.output_ids]) for s in samples]
    width = max(map(len, rows))
    ids = np.stack([np.pad(r, (0, width - len(r))) for r in rows]).astype(np.int32)
    lengths = np.array([len(r) for r in rows], np.int32)
    mask = np.zeros((len(rows), width - 1), np.float32)
    for i, s in enumerate(samples):
        mask[i, len(s.prompt_ids) - 1:len(rows[i]) - 1] = 1.0
    return jnp.asarray(ids), jnp.asarray(lengths), jnp.asarray(mask)


def gradients(policy_path: str, reference_path: str, prompts: list[list[int]], group: int, seeds: int) -> dict:
    """{estimator: [seeds, num_params] float64}: each seed's gradient, flattened."""
    from flax import nnx

    from jaxrl.models.hf import load_hf_checkpoint
    from jaxrl.rollout.sampler import JaxSampler

    policy, reference = load_hf_checkpoint(policy_path), load_hf_checkpoint(reference_path)
    engine = JaxSampler(policy, max_batch=len(prompts) * group)
    graphdef, params = nnx.split(policy)
    ref_graphdef, ref_params = nnx.split(reference)

    @jax.jit
    def grads(params, ids, lengths, mask):
        ref_logp = _token_logp(nnx.merge(ref_graphdef, ref_params), ids, lengths)
        out = {}
        for kind in ESTIMATORS:
            def loss(p, kind=kind):
                return _losses(_token_logp(nnx.merge(graphdef, p), ids, lengths), ref_logp, mask)[kind]
            out[kind] = jnp.concatenate([g.ravel() for g in jax.tree.leaves(jax.grad(loss)(params))])
        return out

    per_seed = [grads(params, *_batch(engine, prompts, group, seed)) for seed in range(seeds)]
    return {kind: np.stack([np.asarray(g[kind], np.float64) for g in per_seed]) for kind in ESTIMATORS}


def _mean_and_se(g: np.ndarray) -> tuple[float, float]:
    """(norm of the mean over seeds, its standard error: sqrt(trace cov / seeds))."""
    return float(np.linalg.norm(g.mean(0))), float(math.sqrt(g.var(0, ddof=1).sum() / len(g)))


def gradient_claims(g: dict) -> tuple[list[tuple], dict]:
    """The three gradient claims and the per-estimator statistics (mean norm, variance trace)."""
    stats = {k: {"mean_norm": _mean_and_se(v)[0], "variance": float(v.var(0, ddof=1).sum())} for k, v in g.items()}

    def zero(values, claim):  # "the expectation is 0": its norm within 2 SE of 0
        norm, se = _mean_and_se(values)
        verdict = REPRODUCED if norm <= 2 * se else NOT_REPRODUCED
        return claim, verdict, f"norm of the mean {norm:.3g}, 2 SE {2 * se:.3g} over {len(values)} seeds"

    if len(g["k2-as-loss"]) < 2:
        return [(c, INCONCLUSIVE, "one seed") for c in ("k1-as-loss", "k3 bias", "k2 = k1-in-reward")], stats
    claims = [
        zero(g["k1-as-loss"], "k1-as-loss's gradient is zero in expectation (it does not regularise)"),
        zero(g["k2-as-loss"] - g["k1-in-reward"], "k2-as-loss and k1-in-reward (summed over the answer, as the "
             "sequence reward carries it) have the same gradient on-policy"),
    ]
    norm, se = _mean_and_se(g["k3-as-loss"] - g["k2-as-loss"])
    claims.append(("k3-as-loss's gradient is biased (differs from k2-as-loss's, the gradient of KL(pi||ref), in "
                   "expectation)", REPRODUCED if norm > 2 * se else INCONCLUSIVE,
                   f"norm of the mean difference {norm:.3g} (k2's mean norm {stats['k2-as-loss']['mean_norm']:.3g}), "
                   f"2 SE {2 * se:.3g}"))
    return claims, stats


def gaussian_table() -> tuple[list[str], tuple]:
    """Rethinking KL's Gaussian example: markdown table lines and the k3-vs-k1 spread claim."""
    mu, sigma = GAUSSIAN["mu"], GAUSSIAN["sigma"]
    true_kl = math.log(1 / sigma) + (sigma ** 2 + mu ** 2) / 2 - 0.5  # KL(N(mu, sigma^2) || N(0, 1))
    values = {name: [] for name in ("k1", "k2", "k3")}
    for seed in range(GAUSSIAN["seeds"]):
        x = np.random.default_rng(seed).normal(mu, sigma, GAUSSIAN["samples"])
        logq = jnp.asarray(-0.5 * ((x - mu) / sigma) ** 2 - math.log(sigma), jnp.float32)
        logp = jnp.asarray(-0.5 * x ** 2, jnp.float32)
        for name, fn in (("k1", kl_lib.kl_k1), ("k2", kl_lib.kl_k2), ("k3", kl_lib.kl_k3)):
            values[name].append(np.asarray(fn(logq, logp), np.float64))
    lines = [f"q = N({mu}, {sigma}^2), p = N(0, 1): true KL(q||p) = {true_kl:.4f} (closed form); "
             f"{GAUSSIAN['samples']} samples x {GAUSSIAN['seeds']} seeds", "",
             "| estimator | mean (over seeds) | bias | sample std (median over seeds) |", "|---|---|---|---|"]
    for name, runs in values.items():
        mean = float(np.mean([v.mean() for v in runs]))
        lines.append(f"| {name} | {mean:.4f} | {mean - true_kl:+.4f} | {np.median([v.std() for v in runs]):.3f} |")
    ratios = [k3.std() / k1.std() for k1, k3 in zip(values["k1"], values["k3"], strict=True)]
    claim = ("Gaussian example: k3's spread exceeds k1's (k3's variance is infinite since sigma^2 < 1/2)",
             REPRODUCED if min(ratios) > 1 else NOT_REPRODUCED,
             "std ratios k3/k1 per seed " + ", ".join(f"{r:.1f}" for r in ratios))
    return lines, claim


def variance_figure(path: str, stats: dict) -> str:
    from jaxrl.plotting import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.4))
    names = list(stats)
    ax.bar(names, [stats[n]["variance"] for n in names], color="tab:blue", alpha=0.7, label="variance (trace)")
    ax.bar(names, [stats[n]["mean_norm"] ** 2 for n in names], color="tab:orange", alpha=0.7, width=0.4,
           label="squared norm of the mean")
    ax.set_yscale("log")
    ax.set_title("KL estimators' gradients across seeds (demo policy vs SFT reference)", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=90)


def analyze_kl(out: str, spec: dict, records: list[dict]):
    """The gradient study on the exported policy, its figure, and the Gaussian table."""
    from jaxrl.data import load_examples, load_tokenizer
    from jaxrl.experiments.runner import Cell, run_config

    root = os.path.join(out, "demo")
    policy = [r for r in records if r["cell"] == spec["gradient_policy"]][0]
    cell = Cell(policy["cell"], {}, spec["kl"][policy["cell"]], None)
    config = run_config(root, spec, cell, 0, 1, os.path.join(out, "scratch"))
    examples, _ = load_examples(config.data.train_files, config.data, load_tokenizer(config.data.tokenizer))
    prompts = [e.prompt_ids.tolist() for e in examples[: spec["gradient_prompts"]]]
    seeds = 2 if spec.get("quick_run") else spec["gradient_seeds"]
    g = gradients(policy["export"], os.path.join(root, "sft", "hf"), prompts, config.rollout.group_size, seeds)
    claims, stats = gradient_claims(g)
    os.makedirs(os.path.join(out, "figures"), exist_ok=True)
    figures = [variance_figure(os.path.join(out, "figures", "kl_gradient_variance.png"), stats)]
    lines, claim = gaussian_table()
    claims.append(claim)
    table = ["| estimator | norm of the mean gradient | variance (trace of covariance) |", "|---|---|---|"]
    table += [f"| {k} | {v['mean_norm']:.3g} | {v['variance']:.3g} |" for k, v in stats.items()]
    spec["report_extra"] = "\n".join(["## Gradients across seeds", "", *table, "", "## Gaussian example", "", *lines])
    return claims, figures


__all__ = ["analyze_kl", "gaussian_table", "gradient_claims", "gradients"]
