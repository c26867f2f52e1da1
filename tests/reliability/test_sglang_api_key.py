"""A keyed SGLang server refuses requests without its key (the shared ``sglang_dense`` fleet).

No server of its own: ``sglang_dense`` (tests/conftest.py) is started with an API key, so
every SGLang test of the suite on it already goes through the authenticated path; this
module checks with raw HTTP that the key is what stands between a caller and the model.
"""

from __future__ import annotations

import pytest
import requests

from jaxrl.rollout.sglang import ClientConfig, ExternalServers, SGLangClient, SGLangRequestError
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]

GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_protected_routes_refuse_requests_without_the_key(sglang_dense):
    """Before: a server bound to 0.0.0.0 accepted /update_weights_from_disk from anyone who could
    reach its port, so anyone could replace the model being trained. Now jaxrl starts every server
    off loopback with an API key (and the shared test fleet with one on loopback): SGLang answers
    401 to a push or a generate without it or with a wrong one, and serves the one that has it."""
    url, key = sglang_dense.manager.urls[0], sglang_dense.manager.api_key
    assert key, "tests/conftest.py starts sglang_dense with an API key"
    version = sglang_dense.engine.weight_version
    push = {"model_path": sglang_dense.manager.model_path, "weight_version": "attacker", "flush_cache": True}
    for headers in ({}, _bearer("wrong-" + key)):
        assert requests.post(url + "/update_weights_from_disk", json=push, headers=headers,
                             timeout=60).status_code == 401
        assert requests.post(url + "/generate", json=GENERATE, headers=headers, timeout=60).status_code == 401
        assert requests.get(url + "/model_info", headers=headers, timeout=60).status_code == 401
    info = requests.get(url + "/model_info", headers=_bearer(key), timeout=60)
    assert info.status_code == 200 and info.json()["weight_version"] == version  # the push never happened
    answer = requests.post(url + "/generate", json=GENERATE, headers=_bearer(key), timeout=60)
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
    # /health stays open (probes, and ServerManager's start-up wait, carry no key)
    assert requests.get(url + "/health", timeout=60).status_code == 200


def test_jaxrl_clients_without_the_key_are_told_what_to_set(sglang_dense, monkeypatch):
    url, key = sglang_dense.manager.urls[0], sglang_dense.manager.api_key
    client = SGLangClient([url], ClientConfig(max_tries=2, backoff_s=0.01))
    with pytest.raises(SGLangRequestError, match="requires an API key and this client sent none") as err:
        client.request(0, "POST", "/generate", GENERATE, "unkeyed request")
    assert key not in str(err.value)
    client.close()
    monkeypatch.delenv("JAXRL_SGLANG_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"it requires an API key; set \$JAXRL_SGLANG_API_KEY"):
        ExternalServers([url], sglang_dense.model_path)
    external = ExternalServers([url], sglang_dense.model_path, api_key=key)
    assert external.weight_version == sglang_dense.engine.weight_version
