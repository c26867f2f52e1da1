"""``ExternalServers``: a ``Fleet`` of SGLang servers jaxrl did not start (``--server-url``, a router).

jaxrl can neither restart nor reconfigure them; it can only check at construction
that they answer, accept the key and serve one weight version.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse

import requests

from jaxrl.errors import InputError
from jaxrl.rollout.base import LogprobKind
from jaxrl.rollout.sglang.access import EXTERNAL_API_KEY_ENV, auth_headers, is_loopback, valid_key
from jaxrl.rollout.sglang.fleet import ServedWeights


@dataclasses.dataclass(frozen=True)
class ExternalFleetConfig:
    """What ``SGLangEngine`` reads from a fleet's config when jaxrl did not start the servers."""

    logprob_kind: LogprobKind = LogprobKind.RAW
    return_routed_experts: bool = False
    tensor_parallel: int = 1


class ExternalServers(ServedWeights):
    """SGLang servers started by someone else (or a router), as a ``Fleet`` (fleet.py).

    Nothing restarts them (``ensure_running`` is always False), so a request that keeps
    failing ends with the URL named. How they were started cannot be asked: RAW logprobs
    need ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` on the server, so ``config.logprob_kind`` is the
    caller's word, and a wrong one shows up as a mismatch in the alignment report.
    Construction asks every server's ``/model_info`` and requires one weight version.

    api_key: the key the servers were started with (SGLang ``--api-key``); None reads the
    environment variable ``JAXRL_SGLANG_API_KEY`` (unset or "": no key), which keeps the
    key off command lines (``jaxrl align run --server-url`` reads it that way).
    """

    def __init__(self, urls, model_path: str, config: ExternalFleetConfig = ExternalFleetConfig(),
                 timeout_s: float = 10.0, api_key: str | None = None):
        if not urls:
            raise InputError("ExternalServers needs at least one server URL")
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.config = config
        self._model_path = model_path
        from_env = api_key is None
        self._api_key = os.environ.get(EXTERNAL_API_KEY_ENV, "") if from_env else api_key
        source = f"${EXTERNAL_API_KEY_ENV}" if from_env else "ExternalServers(api_key=...)"
        if not valid_key(self._api_key):
            raise InputError(f"{source}: the API key must be printable characters without spaces")
        headers = auth_headers(self._api_key)
        versions = []
        for url in self.urls:
            try:
                response = requests.get(url + "/model_info", headers=headers, timeout=timeout_s)
                refused = response.status_code in (401, 403)
                if not refused:
                    response.raise_for_status()
                    info = response.json()
                    if not isinstance(info, dict):
                        raise ValueError(f"the reply is {type(info).__name__} {str(info)[:80]!r}, not a JSON object")
                    versions.append(str(info.get("weight_version", "unknown")))
            except (requests.RequestException, ValueError) as err:
                raise InputError(f"{url}: no SGLang server answers GET {url}/model_info "
                                 f"({type(err).__name__}: {err}); start one "
                                 "(python -m sglang.launch_server --model-path ...) or check the URL") from None
            if refused:
                raise InputError(
                    f"{url}: the server refused GET {url}/model_info (HTTP {response.status_code}): "
                    + (f"it requires an API key; set {source} to the key it was started with (--api-key)"
                       if not self._api_key else
                       f"the API key from {source} is not the one it was started with (--api-key)"))
        if len(set(versions)) > 1:
            served = dict(zip(self.urls, versions, strict=True))
            raise InputError(f"the servers serve different weight versions {served}; "
                             "point at servers with the same weights")
        self._weight_version = versions[0]

    @property
    def api_key(self) -> str:
        return self._api_key

    @property
    def num_servers(self) -> int:
        return len(self.urls)

    @property
    def on_this_host(self) -> bool:
        return all(is_loopback(urllib.parse.urlsplit(url).hostname or "") for url in self.urls)

    def describe(self, index: int) -> str:
        return f"SGLang server {index} at {self.urls[index]} (started outside jaxrl)"

    def ensure_running(self, index: int) -> bool:
        return False  # not ours to restart
