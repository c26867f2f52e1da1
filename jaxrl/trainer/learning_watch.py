"""Warns when a run stops learning while it looks healthy: most of the batch dropped, step after
step, or nothing in the batch to learn from.

A rejection (token / sequence MIS, Geo-RS, sequence k2/k3 rejection; docs/losses.md#mismatch-corrections)
whose band is too tight for the engine's mismatch keeps training, on the few tokens it lets through,
and the run looks healthy while it learns next to nothing; the batch filter
(docs/losses.md#batch-filter) that skips every step learns nothing at all. When (nearly) every
group's samples get one reward, a group-relative advantage is zero for all of them and the update
has no gradient (docs/losses.md#zero-variance-groups): prompts too easy or too hard for the model,
or a reward function that returns a constant. ``LearningWatch`` reads each step's metrics: when a
watched fraction stays above its threshold on ``STEPS_IN_A_ROW`` consecutive steps, it warns once
for that streak, naming what happened, the fractions, the steps and the config keys to change;
``add_to`` repeats every streak in the run's final summary (``rejection_warnings``,
``nothing_to_learn``). A held-out reward that starts at the built-in rewards' maximum warns too.
Its count starts afresh on ``--resume``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxrl.losses.objective import ObjectiveConfig, active_rejections
from jaxrl.reward.base import BUILTIN_REWARD_RANGE

# "Most of the tokens": past half, the update learns from a minority of the batch it paid to sample.
MOST = 0.5
# "Nothing to learn": all but a few groups constant, so the gradient rests on a handful of samples.
NEARLY_ALL = 0.95
# One batch can be unlucky; three in a row is the band (or the engine, or the data), not the draw.
STEPS_IN_A_ROW = 3


@dataclasses.dataclass
class _Watched:
    """One watched fraction: what it is called, its logged metric, the threshold it must stay under,
    what crossing it means, what to change, and the summary key its streaks are listed under."""

    label: str
    metric: str
    remedy: str
    threshold: float = MOST
    effect: str = f"dropped more than {MOST:.0%} of the tokens"
    consequence: str = "the update learns from what is left, so the run may barely learn"
    summary_key: str = "rejection_warnings"
    streak: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    episodes: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # streaks that warned

    def close_streak(self) -> None:
        if len(self.streak) >= STEPS_IN_A_ROW:
            self.episodes.append(self.streak)
        self.streak = []


def _steps(streak: list[tuple[int, float]]) -> str:
    first, last = streak[0][0], streak[-1][0]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _nothing_to_learn() -> _Watched:
    return _Watched(
        "rollout.group_size samples of a prompt", "advantage/zero_variance_group_fraction",
        "The prompts are too easy or too hard for the model, or the reward barely varies: keep the prompts it "
        "sometimes solves (jaxrl filter, docs/evaluation.md), raise rollout.group_size or rollout.temperature, "
        "or check that the reward function's scores vary",
        threshold=NEARLY_ALL, effect=f"got one reward in more than {NEARLY_ALL:.0%} of the groups",
        consequence="their advantages are zero, so the update has next to nothing to learn from",
        summary_key="nothing_to_learn")


class LearningWatch:
    """``observe(step, metrics)`` after every step and ``observe_start(heldout)`` with the held-out
    metrics before the first; ``warn`` receives each message."""

    def __init__(self, watched: list[_Watched], warn: Callable[[str], None]):
        self.watched = watched
        self.warn = warn
        self.start_warnings: list[str] = []

    @classmethod
    def for_objective(cls, objective: ObjectiveConfig, warn: Callable[[str], None]) -> "LearningWatch":
        """Watches the rejections ``objective`` applies (``update/<fraction metric>``), its batch
        filter (``filter/skip``: a skipped step drops every token) and the share of groups whose
        samples all got one reward (``advantage/zero_variance_group_fraction``; GAE logs none)."""
        watched = []
        for field, name, metric, band in active_rejections(objective):
            keys = ", ".join(f"objective.{key} (now {getattr(objective, key)})" for key in band)
            watched.append(_Watched(f"objective.{field}={name}", f"update/{metric}",
                                    f"Loosen {keys} (docs/losses.md#mismatch-corrections), or set another "
                                    f"objective.{field}"))
        if objective.batch_filter_threshold is not None:
            watched.append(_Watched(
                f"the batch filter ({objective.batch_filter_metric} above objective.batch_filter_threshold)",
                "filter/skip", f"Raise objective.batch_filter_threshold (now {objective.batch_filter_threshold}) "
                               f"or shrink the engine's mismatch (filter/value is the measured "
                               f"{objective.batch_filter_metric})"))
        return cls([*watched, _nothing_to_learn()], warn)

    def observe_start(self, heldout: Mapping[str, Any]) -> None:
        """Before the first step: a held-out reward already at the built-in rewards' maximum leaves nothing to gain."""
        reward = heldout.get("heldout/reward")
        if reward is None or not float(reward) >= BUILTIN_REWARD_RANGE[1]:
            return
        line = (f"the held-out reward starts at {float(reward):.3f}, the built-in rewards' maximum: RL has nothing "
                f"left to gain on these prompts; train on harder ones (jaxrl filter keeps the prompts the model "
                f"sometimes solves, docs/evaluation.md)")
        self.start_warnings.append(line)
        self.warn(f"step 0: warning: {line}")

    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Extends or ends each watched fraction's streak with this step's value; a step without the
        metric (an update skipped, the critic's warm-up) neither extends nor ends it."""
        for w in self.watched:
            if metrics.get(w.metric) is None:
                continue
            fraction = float(metrics[w.metric])
            if not fraction > w.threshold:  # NaN included: no evidence
                w.close_streak()
                continue
            w.streak.append((step, fraction))
            if len(w.streak) == STEPS_IN_A_ROW:
                shares = ", ".join(f"{f:.0%}" for _, f in w.streak)
                self.warn(f"step {step}: warning: {w.label} {w.effect} on each of {_steps(w.streak)} ({shares}; "
                          f"{w.metric}): {w.consequence}. {w.remedy}")

    def lines(self) -> dict[str, list[str]]:
        """Summary key -> one line per watched fraction that warned (its streaks, their mean and the
        remedy), and the held-out start's warning under ``nothing_to_learn``."""
        out: dict[str, list[str]] = {}
        for w in self.watched:
            episodes = w.episodes + ([w.streak] if len(w.streak) >= STEPS_IN_A_ROW else [])
            if not episodes:
                continue
            fractions = [f for streak in episodes for _, f in streak]
            out.setdefault(w.summary_key, []).append(
                f"{w.label} {w.effect} on {', '.join(_steps(s) for s in episodes)} "
                f"(mean {sum(fractions) / len(fractions):.0%}; {w.metric}). {w.remedy}")
        if self.start_warnings:
            out.setdefault("nothing_to_learn", []).extend(self.start_warnings)
        return out

    def add_to(self, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` with the :meth:`lines` under their keys, where there are any."""
        summary.update(self.lines())
        return summary
