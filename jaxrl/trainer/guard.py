"""Watching every optimizer update: non-finite updates are skipped and counted, spikes warned about.

The jitted train step (``jaxrl.trainer.update.TrainStep``) already refuses to apply an update
whose loss, gradient norm or update norm is not finite (so parameters never turn non-finite): it
returns the old parameters and optimizer state and reports ``update/nonfinite = 1``. ``UpdateGuard`` sees the
metrics of each update on the host and decides what the run does about it:

- a skipped update is logged with its loss and gradient norm and counted;
  ``max_consecutive_skips`` skips in a row stop the run with ``NonFiniteUpdateError``
  (a model that produces NaN on every batch will not recover by itself);
- a gradient norm above ``spike_factor`` x the median of the last ``WINDOW`` finite updates,
  or an update larger than the parameters it changes (``update/relative_size > 1``, e.g. a
  learning rate orders of magnitude too high), is logged as a warning and counted. Training
  goes on: a spike is a symptom to look at, not a proof that the run is lost.

Its state (counters and recent gradient norms) is saved in every checkpoint, so a resumed
run warns and stops exactly where the uninterrupted one would.
"""

from __future__ import annotations

import collections
from typing import Callable, Mapping

import numpy as np


class NonFiniteUpdateError(RuntimeError):
    """Too many optimizer updates in a row had a non-finite loss, gradient or result."""


class UpdateGuard:
    """``check(step, metrics)`` after every optimizer update; ``warn`` receives each message."""

    WINDOW = 20  # recent finite gradient norms the spike test compares against
    MIN_HISTORY = 5  # no spike verdict before this many finite updates

    def __init__(self, max_consecutive_skips: int, spike_factor: float, warn: Callable[[str], None],
                 prefix: str = "update"):
        self.prefix = prefix  # of its metrics; "critic" watches the critic's updates, named so in messages
        self._whose, self._lr_key = (("the critic's ", "critic.optimizer.lr") if prefix == "critic"
                                     else ("", "optimizer.lr"))
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_factor = spike_factor
        self.warn = warn
        self.consecutive_skips = 0
        self.skipped_total = 0
        self.spikes_total = 0
        self.recent_grad_norms: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        """Judges one update from its metrics (``loss``, ``grad_norm``, ``update/nonfinite``,
        ``update/relative_size``); raises NonFiniteUpdateError after too many skips in a row."""
        loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
        if float(metrics["update/nonfinite"]) > 0:
            self.consecutive_skips += 1
            self.skipped_total += 1
            self.warn(f"step {step}: skipped {self._whose}update with loss={loss:.4g}, grad_norm={grad_norm:.4g} "
                      f"(not finite); parameters and optimizer state kept ({self.consecutive_skips} in a row, "
                      f"{self.skipped_total} in all)")
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise NonFiniteUpdateError(
                    f"step {step}: {self._whose}{self.consecutive_skips} optimizer updates in a row had a non-finite "
                    f"loss, gradient or result (update.max_consecutive_skips={self.max_consecutive_skips}); the "
                    f"parameters are those of the last finite update. Look for a learning rate that is too high "
                    f"({self._lr_key}), inputs that overflow in the model's dtype, or rewards/advantages that are "
                    f"not finite")
            return
        self.consecutive_skips = 0
        if self.spike_factor:
            self._check_spike(step, grad_norm, float(metrics["update/relative_size"]))
        self.recent_grad_norms.append(grad_norm)

    def _check_spike(self, step: int, grad_norm: float, relative_size: float) -> None:
        problems = []
        if len(self.recent_grad_norms) >= self.MIN_HISTORY:
            median = float(np.median(self.recent_grad_norms))
            # A zero median (updates whose every token was masked or rejected) gives no scale.
            if median > 0 and grad_norm > self.spike_factor * median:
                problems.append(f"grad_norm {grad_norm:.4g} is {grad_norm / median:.3g}x the median {median:.4g} "
                                f"of the last {len(self.recent_grad_norms)} updates")
        if relative_size > 1.0:
            problems.append(f"the update is {relative_size:.3g}x as large as the parameters "
                            f"(is {self._lr_key} too high?)")
        if problems:
            self.spikes_total += 1
            self.warn(f"step {step}: warning: {self._whose}{'; '.join(problems)} "
                      f"(update.spike_factor={self.spike_factor:g})")

    def metrics(self) -> dict[str, float]:
        return {f"{self.prefix}/nonfinite_skips": float(self.skipped_total),
                f"{self.prefix}/spike_warnings": float(self.spikes_total)}

    def state(self) -> dict:
        return {"consecutive_skips": self.consecutive_skips, "skipped_total": self.skipped_total,
                "spikes_total": self.spikes_total, "recent_grad_norms": list(self.recent_grad_norms)}

    def restore(self, state: Mapping) -> None:
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skipped_total = int(state["skipped_total"])
        self.spikes_total = int(state["spikes_total"])
        self.recent_grad_norms.clear()
        self.recent_grad_norms.extend(float(x) for x in state["recent_grad_norms"])
