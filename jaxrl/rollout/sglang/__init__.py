"""SGLang rollouts: server fleet manager, HTTP client and the ``RolloutEngine`` on top.

The trainer's environment talks to SGLang over HTTP only and never imports it.
"""

from jaxrl.rollout.sglang.client import (
    ClientConfig,
    SGLangClient,
    SGLangRequestError,
    SGLangResponseError,
    decode_routed_experts,
)
from jaxrl.rollout.sglang.engine import PushConfig, SGLangEngine, WeightPushError
from jaxrl.rollout.sglang.server import (ExternalFleetConfig, ExternalServers, ServerConfig, ServerManager,
                                          ServerStartError)

__all__ = [
    "ClientConfig", "PushConfig", "SGLangClient", "SGLangEngine", "SGLangRequestError",
    "SGLangResponseError", "ExternalFleetConfig", "ExternalServers", "ServerConfig", "ServerManager",
    "ServerStartError", "WeightPushError",
    "decode_routed_experts",
]
