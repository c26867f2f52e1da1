"""SGLang faults the trainer must survive: a server killed in the middle of an in-memory weight
push. Against the real ``sglang_dense`` server (tests/conftest.py); the reference is the
learner's own recompute (``jaxrl.models.scoring``)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import SamplingParams
from jaxrl.rollout.sglang import PushConfig, SGLangEngine
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from jaxrl.rollout.sglang.testing import random_decoder

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
ALIGN_TOL = 1e-5  # learner recompute vs SGLang, float32


@contextlib.contextmanager
def killing_server_0(engine, manager, nth: int, is_target):
    """While open, ``engine``'s client kills server 0 just before its ``nth`` request for which
    ``is_target(path, what)`` holds; yields the list of those requests' payloads, as they were sent."""
    client, seen = engine._client, []
    send = client.request

    def request(index, method, path, payload, what):
        if is_target(path, what):
            seen.append(payload)
            if len(seen) == nth:
                manager.kill(0)
        return send(index, method, path, payload, what)

    client.request = request
    try:
        yield seen
    finally:
        client.request = send


def test_a_server_killed_mid_tensor_push_gets_the_whole_push_again(sglang_dense, tmp_path):
    """Before: the server, killed after the push's first chunk, came back with its checkpoint on
    disk and its weight-update session gone; the retried chunk went in, ``/end_weight_update`` was
    refused (HTTP 400, "no weight-update session is open") and the push failed with a message that
    blamed the SGLang version, the server serving the old weights. Now the server is restarted and
    given every chunk again once they are copied: the push succeeds, its probe check passes, and
    the samples are the pushed model's, under the pushed version."""
    manager, original = sglang_dense.manager, sglang_dense.model
    engine = SGLangEngine(manager, push=PushConfig(method="tensor", chunk_mib=0.01,  # several chunks
                                                   checkpoint_dir=str(tmp_path / "unused")))
    pushed = random_decoder(original.config, seed=21)
    restarts = manager.restarts(0)
    try:
        with killing_server_0(engine, manager, 2, lambda path, what: path == "/update_weights_from_tensor"):
            metrics = engine.update_weights(pushed, "mid-push-1")
        assert manager.restarts(0) == restarts + 1 and metrics["push/chunks"] > 2
        assert metrics["push/probe_max_abs_diff"] <= ALIGN_TOL
        samples = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))
        for prompt, group in zip(PROMPTS, samples, strict=True):
            s = group[0]
            ids = np.concatenate([s.prompt_ids, s.output_ids])[None]
            want = sequence_logprobs(pushed, ids, np.asarray([ids.shape[1]]))[0, len(prompt):]
            assert s.weight_version == "mid-push-1" and np.max(np.abs(s.output_logprobs - want)) <= ALIGN_TOL
    finally:
        engine.close()
        sglang_dense.engine.update_weights(original, "after-mid-push")  # the fleet's engine, its own version


@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_a_server_killed_while_its_push_is_verified_comes_back_with_that_push(sglang_dense, tmp_path, method):
    """Before: a server that died after loading a push and before answering its probe came back with
    the weights of the push before (or the initial checkpoint), since the pusher recorded a push
    only once verified; the probe's retry then read the old version and the push failed. Now a
    push is kept for restarts as soon as every server has it: the restarted server is given it
    (in memory again, or from its checkpoint) and the verification passes."""
    manager, original = sglang_dense.manager, sglang_dense.model
    engine = SGLangEngine(manager, push=PushConfig(method=method, checkpoint_dir=str(tmp_path / "pushed")))
    pushed = random_decoder(original.config, seed=23)
    restarts = manager.restarts(0)
    try:
        with killing_server_0(engine, manager, 1, lambda path, what: what.startswith("scoring request")) as probes:
            metrics = engine.update_weights(pushed, f"probe-kill-{method}")
        assert manager.restarts(0) == restarts + 1 and len(probes) == 1
        assert metrics["push/probe_max_abs_diff"] <= ALIGN_TOL
    finally:
        engine.close()
        sglang_dense.engine.update_weights(original, f"after-probe-kill-{method}")  # the fleet's engine, its own
