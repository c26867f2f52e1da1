"""SGLang rollouts: server fleets, HTTP client, weight push and the ``RolloutEngine`` on top.

The trainer's environment talks to SGLang over HTTP only and never imports it.

Modules: ``fleet`` (the ``Fleet`` protocol the engine talks to), ``launch`` (one server's
command line, environment and GPUs: ``ServerConfig``), ``server`` (fleets jaxrl
starts: ``ServerManager``), ``external`` (fleets started elsewhere: ``ExternalServers``),
``client`` (HTTP), ``push`` (``WeightPusher``: export, load, verify, prune), ``engine``.
"""

from jaxrl.errors import needs_extra

# Without the [train] extra (requests) an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.rollout.sglang"):
    from jaxrl.rollout.base import PushVerificationError
    from jaxrl.rollout.sglang.client import (
        ClientConfig,
        SGLangClient,
        SGLangRequestError,
        SGLangResponseError,
        decode_routed_experts,
    )
    from jaxrl.rollout.sglang.engine import SGLangEngine
    from jaxrl.rollout.sglang.external import ExternalFleetConfig, ExternalServers
    from jaxrl.rollout.sglang.fleet import Fleet
    from jaxrl.rollout.sglang.push import PushConfig
    from jaxrl.rollout.sglang.launch import ServerConfig
    from jaxrl.rollout.sglang.server import ServerManager, ServerStartError

__all__ = [
    "ClientConfig", "Fleet", "PushConfig", "PushVerificationError", "SGLangClient", "SGLangEngine",
    "SGLangRequestError", "SGLangResponseError", "ExternalFleetConfig", "ExternalServers", "ServerConfig",
    "ServerManager", "ServerStartError",
    "decode_routed_experts",
]
