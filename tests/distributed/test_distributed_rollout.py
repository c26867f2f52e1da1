"""Rollouts with two real JAX processes: the ragged all-gather, and SGLang with one server per process."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import requests

from jaxrl import distributed
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rollout_worker  # noqa: E402


def test_process_share_splits_in_order_without_gaps():
    for items in (0, 1, 5, 8, 9):
        for count in (1, 2, 3, 4):
            shares = [distributed.process_share(items, p, count) for p in range(count)]
            assert [i for s in shares for i in range(s.start, s.stop)] == list(range(items))
            sizes = [s.stop - s.start for s in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert distributed.process_share(5, 1, 2) == slice(3, 5)
    with pytest.raises(ValueError, match="process_index=2 is outside 0..1"):
        distributed.process_share(5, 2, 2)


def test_allgather_ragged_with_one_process_returns_the_arrays_and_checks_them():
    arrays = [np.arange(3, dtype=np.int64), np.zeros(0, np.int64)]
    got = distributed.allgather_ragged(arrays, np.int64)
    assert len(got) == 2 and all(np.array_equal(a, b) for a, b in zip(got, arrays, strict=True))
    with pytest.raises(ValueError, match=r"array 1 of process 0 is float32\[2\]; expected int64"):
        distributed.allgather_ragged([arrays[0], np.zeros(2, np.float32)], np.int64)


def test_allgather_ragged_across_two_processes_is_exact_and_in_process_order(processes, tmp_path):
    processes.start_group([sys.executable, rollout_worker.__file__, "ragged", str(tmp_path)])
    for result in processes.wait_all(timeout_s=60):
        assert result.returncode == 0, result.output[-3000:]
    expected = {name: rollout_worker.ragged_arrays(0)[name] + rollout_worker.ragged_arrays(1)[name]
                for name in ("int64", "float32", "int32x2x3")}
    for process in (0, 1):
        got = np.load(tmp_path / f"ragged-{process}.npz")
        for name, arrays in expected.items():
            assert sum(key.startswith(name + "/") for key in got.files) == len(arrays) == 3
            for k, want in enumerate(arrays):
                array = got[f"{name}/{k}"]
                assert array.dtype == want.dtype and array.shape == want.shape, (name, k)
                np.testing.assert_array_equal(array, want, err_msg=f"{name}/{k}")  # bit for bit, int64 too


def test_gather_to_hosts_gives_every_process_the_whole_array_bit_for_bit(processes, tmp_path):
    """Split over both processes' 8 devices, replicated over processes, in two dimensions, bfloat16:
    each process ends with exactly the full array (the weight push's gather, jaxrl.models.hf)."""
    processes.start_group([sys.executable, rollout_worker.__file__, "hosts", str(tmp_path)])
    for result in processes.wait_all(timeout_s=60):
        assert result.returncode == 0, result.output[-3000:]
    for process in (0, 1):
        got = np.load(tmp_path / f"hosts-{process}.npz")
        for name, (want, _, _) in rollout_worker.host_arrays().items():
            assert str(got[f"{name}/dtype"]) == str(want.dtype) and tuple(got[f"{name}/shape"]) == want.shape, name
            assert got[name].tobytes() == want.tobytes(), (process, name)


@pytest.mark.sglang
@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first")
def test_sglang_generate_on_two_processes_each_with_its_own_server(processes, tmp_path, sglang_moe):
    """Process p drives server p of the shared two-server MoE fleet (tests/conftest.py) as its own."""
    model, urls = sglang_moe.model, sglang_moe.manager.urls
    try:
        for p, url in enumerate(urls):  # the version tells which server generated a sample
            reload = {"model_path": sglang_moe.model_path, "weight_version": f"p{p}", "flush_cache": True}
            requests.post(url + "/update_weights_from_disk", json=reload, timeout=120).raise_for_status()
        processes.start_group([sys.executable, rollout_worker.__file__, "sglang", str(tmp_path),
                               sglang_moe.model_path, ",".join(urls)])
        for result in processes.wait_all(timeout_s=120):
            assert result.returncode == 0, result.output[-5000:]
    finally:  # the fleet's own record of its weights again (the workers pushed versions it does not know)
        sglang_moe.engine.update_weights(sglang_moe.model, "moe-restored")

    reports = [json.load(open(tmp_path / f"sglang-{p}.json")) for p in (0, 1)]
    prompts, n = rollout_worker.PROMPTS, rollout_worker.SAMPLES_PER_PROMPT
    mine = {p: range(*distributed.process_share(len(prompts), p, 2).indices(len(prompts))) for p in (0, 1)}
    assert list(mine[0]) == [0, 1, 2] and list(mine[1]) == [3, 4]
    for report in reports:
        assert report["push_probe_max_abs_diff"] <= 1e-5
    for b, (batch0, batch1) in enumerate(zip(reports[0]["batches"], reports[1]["batches"], strict=True)):
        # Both processes hold the same full batch (the servers' own scoring aside) ...
        strip = [[{k: v for k, v in s.items() if k != "scored_here"} for s in g] for g in batch0]
        assert strip == [[{k: v for k, v in s.items() if k != "scored_here"} for s in g] for g in batch1]
        assert len(batch0) == len(prompts) and all(len(group) == n for group in batch0)
        for i, group in enumerate(batch0):
            origin = 0 if i in mine[0] else 1
            for s in group:
                # ... in prompt order, each prompt's samples from the server of the process whose share it
                # is (the version tells the servers apart before the push).
                assert s["weight_version"] == (f"p{origin}" if b == 0 else "1")
                assert s["finish_reason"] in ("stop", "length") and s["logprob_kind"] == "raw"
                assert 1 <= len(s["output_ids"]) <= rollout_worker.MAX_NEW_TOKENS
                assert len(s["output_logprobs"]) == len(s["output_ids"])
        for _report, batch in zip(reports, (batch0, batch1), strict=True):
            for group in batch:
                for s in group:
                    # The gathered logprobs are those of these very tokens after this prompt: each
                    # process's own server scores them the same (same weights on both servers).
                    np.testing.assert_allclose(s["output_logprobs"], s["scored_here"], atol=1e-5, rtol=0)
        for i, group in enumerate(batch0):
            for s in group:
                # The gathered routes are the learner router's for these tokens (expert sets per row).
                fed = np.asarray(prompts[i] + s["output_ids"])[:-1]
                learner_routes = np.sort(np.asarray(model(fed[None], np.arange(len(fed))[None]).routed_experts[0]), -1)
                split = len(prompts[i]) - 1
                np.testing.assert_array_equal(np.sort(s["prompt_routed_experts"], -1).reshape(split, 2, 2),
                                              learner_routes[:split])
                np.testing.assert_array_equal(np.sort(s["routed_experts"], -1), learner_routes[split:])
