"""``Fleet``: what ``SGLangEngine`` and ``WeightPusher`` need of a set of SGLang servers.

Two kinds satisfy it: ``ServerManager`` (servers jaxrl starts, restarts and stops) and
``ExternalServers`` (servers someone else runs). Starting and stopping are not part of it:
whoever made the fleet owns its lifetime, and the engine only talks to the servers.
"""

from __future__ import annotations

from typing import Protocol

from jaxrl.rollout.base import LogprobKind


class FleetConfig(Protocol):
    """How the servers were started, as far as requests depend on it."""

    @property
    def logprob_kind(self) -> LogprobKind:
        """What ``output_token_logprobs`` hold; the engine refuses RAW requests a PROCESSED fleet cannot serve."""

    @property
    def return_routed_experts(self) -> bool:
        """Whether the servers report MoE routes, so that the engine asks for them."""

    @property
    def tensor_parallel(self) -> int:
        """Ranks per server: an in-memory push hands each rank its own copy of the payload."""


class Fleet(Protocol):
    """Data-parallel SGLang servers, addressed by index ``0 .. num_servers - 1``."""

    @property
    def urls(self) -> tuple[str, ...]:
        """One base URL per server, in index order (the client's targets)."""

    @property
    def num_servers(self) -> int:
        """How many servers prompts and pushes are spread over."""

    @property
    def api_key(self) -> str:
        """The key every request carries as a Bearer token ("" for none)."""

    @property
    def config(self) -> FleetConfig:
        """How the servers were started."""

    @property
    def model_path(self) -> str:
        """The checkpoint the servers serve: the last one pushed, else the initial one
        (its config.json gives the engine the vocabulary and the MoE top-k)."""

    @property
    def weight_version(self) -> str:
        """The version the servers serve; the engine's starting version."""

    @property
    def on_this_host(self) -> bool:
        """Whether every server runs on this process's host (it can read this host's shared memory)."""

    def describe(self, index: int) -> str:
        """One line naming server ``index`` for error messages."""

    def ensure_running(self, index: int) -> bool:
        """Called after a failed request, before its retry: restarts server ``index`` if it died;
        True when it did."""

    def record_weights(self, model_path: str, weight_version: str) -> None:
        """Remembers a push every server loaded, so that a restarted server comes back with those weights."""


class ServedWeights:
    """The checkpoint a fleet serves and its version, with ``Fleet``'s ``model_path``,
    ``weight_version`` and ``record_weights``: the part ``ServerManager`` and ``ExternalServers``
    share (set ``_model_path`` and ``_weight_version`` in ``__init__``)."""

    _model_path: str
    _weight_version: str

    @property
    def model_path(self) -> str:
        """The checkpoint a (re)started server loads: the last one pushed, else the initial one."""
        return self._model_path

    @property
    def weight_version(self) -> str:
        return self._weight_version

    def record_weights(self, model_path: str, weight_version: str) -> None:
        """Remembers pushed weights so a restarted server comes back with them, not the initial ones."""
        self._model_path, self._weight_version = model_path, weight_version
