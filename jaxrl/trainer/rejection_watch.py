"""Warns when a mismatch rejection or the batch filter drops most of the batch, step after step.

A rejection (token / sequence MIS, Geo-RS, sequence k2/k3 rejection; docs/losses.md#mismatch-corrections)
whose band is too tight for the engine's mismatch keeps training, on the few tokens it lets through,
and the run looks healthy while it learns next to nothing; the batch filter
(docs/losses.md#batch-filter) that skips every step learns nothing at all. ``RejectionWatch`` reads
each step's metrics: when a rejection drops more than ``MOST`` of the tokens (or the filter skips the
update) on ``STEPS_IN_A_ROW`` consecutive steps, it warns once for that streak, naming the
correction, the fractions, the steps and the config keys to change; ``add_to`` repeats every streak
in the run's final summary. Its count starts afresh on ``--resume``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from jaxrl.losses.objective import ObjectiveConfig, active_rejections

# "Most of the tokens": past half, the update learns from a minority of the batch it paid to sample.
MOST = 0.5
# One batch can be unlucky; three in a row is the band (or the engine), not the draw.
STEPS_IN_A_ROW = 3


@dataclasses.dataclass
class _Watched:
    """One rejection: what it is called, the logged metric of the fraction it drops, what to change."""

    label: str
    metric: str
    remedy: str
    streak: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    episodes: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)  # streaks that warned

    def close_streak(self) -> None:
        if len(self.streak) >= STEPS_IN_A_ROW:
            self.episodes.append(self.streak)
        self.streak = []


def _steps(streak: list[tuple[int, float]]) -> str:
    first, last = streak[0][0], streak[-1][0]
    return f"step {first}" if first == last else f"steps {first}-{last}"


class RejectionWatch:
    """``observe(step, metrics)`` after every step; ``warn`` receives each message."""

    def __init__(self, watched: list[_Watched], warn: Callable[[str], None]):
        self.watched = watched
        self.warn = warn

    @classmethod
    def for_objective(cls, objective: ObjectiveConfig, warn: Callable[[str], None]) -> "RejectionWatch":
        """Watches the rejections ``objective`` applies (``update/<fraction metric>``) and its batch
        filter (``filter/skip``: a skipped step drops every token)."""
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
        return cls(watched, warn)

    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Extends or ends each watched rejection's streak with this step's fraction; a step without
        the metric (an update skipped, the critic's warm-up) neither extends nor ends it."""
        for w in self.watched:
            if metrics.get(w.metric) is None:
                continue
            fraction = float(metrics[w.metric])
            if not fraction > MOST:  # NaN included: no evidence of a rejection
                w.close_streak()
                continue
            w.streak.append((step, fraction))
            if len(w.streak) == STEPS_IN_A_ROW:
                shares = ", ".join(f"{f:.0%}" for _, f in w.streak)
                self.warn(f"step {step}: warning: {w.label} dropped more than {MOST:.0%} of the tokens on each of "
                          f"{_steps(w.streak)} ({shares}; {w.metric}): the update learns from what is left, "
                          f"so the run may barely learn. {w.remedy}")

    def lines(self) -> list[str]:
        """One line per watched rejection that warned: its streaks, their mean fraction and the remedy."""
        out = []
        for w in self.watched:
            episodes = w.episodes + ([w.streak] if len(w.streak) >= STEPS_IN_A_ROW else [])
            if not episodes:
                continue
            fractions = [f for streak in episodes for _, f in streak]
            out.append(f"{w.label} dropped more than {MOST:.0%} of the tokens on "
                       f"{', '.join(_steps(s) for s in episodes)} (mean {sum(fractions) / len(fractions):.0%}; "
                       f"{w.metric}). {w.remedy}")
        return out

    def add_to(self, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` with ``rejection_warnings`` (the :meth:`lines`) when there are any."""
        lines = self.lines()
        if lines:
            summary["rejection_warnings"] = lines
        return summary
