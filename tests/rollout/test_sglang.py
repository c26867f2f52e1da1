"""SGLangEngine against real SGLang servers (CPU, float32, `.venv-sglang`).

The servers are the session fixtures ``sglang_dense`` (one dense Qwen3 server)
and ``sglang_moe`` (two Qwen3-MoE servers, routes returned) of tests/conftest.py,
shared with the other SGLang tests; references are the learner's recompute
(``jaxrl.models.scoring``) and a transformers forward.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import numpy as np
import pytest
import torch
import transformers

from jaxrl.align.check import check_engine
from jaxrl.models import Decoder
from jaxrl.models.scoring import sequence_logprobs
from jaxrl.rollout.base import Conversation, LogprobKind, SamplingParams
from jaxrl.rollout.sampler import JaxSampler
from jaxrl.rollout.sglang import PushConfig, PushVerificationError, SGLangEngine
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from jaxrl.rollout.sglang.testing import random_decoder

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first"),
]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16], [17, 18], [19, 20, 21, 22]]
ALIGN_TOL = 1e-5  # issue 5: learner recompute vs SGLang, float32


def hf_logits(model_path: str, token_ids) -> torch.Tensor:
    """transformers' float32 logits [L, V] of one sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].double()


def test_raw_logprobs_match_the_learner_recompute_through_the_alignment_checker(sglang_dense):
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    batch, report, _ = check_engine(sglang_dense.engine, sglang_dense.model, PROMPTS, params, n=2, figures=False)
    overall = report["overall"]
    assert overall["num_tokens"] == len(PROMPTS) * 2 * 16
    assert overall["abs_log_ratio_max"] <= ALIGN_TOL, overall
    assert report["meta"]["weight_version"] == sglang_dense.engine.weight_version


def test_which_distribution_comes_back_raw_and_processed(sglang_dense):
    """At T=0.7 with top-k 5: RAW is log_softmax(logits), PROCESSED is log_softmax(logits / T)
    renormalised over the top 5, both against a transformers forward of the same tokens."""
    prompt, temperature, top_k = [3, 1, 4, 1, 5, 9], 0.7, 5
    for kind in (LogprobKind.RAW, LogprobKind.PROCESSED):
        params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=12, logprob_kind=kind)
        sample = sglang_dense.engine.generate([prompt], params)[0][0]
        assert sample.logprob_kind == kind
        logits = hf_logits(sglang_dense.manager.model_path, prompt + sample.output_ids.tolist())[len(prompt) - 1:-1]
        tokens = torch.tensor(sample.output_ids.tolist())[:, None].long()
        raw = logits.log_softmax(-1).gather(-1, tokens)[:, 0].numpy()
        scaled = (logits / temperature)
        kth = scaled.topk(top_k, -1).values[:, -1:]
        processed = scaled.masked_fill(scaled < kth, -np.inf).log_softmax(-1).gather(-1, tokens)[:, 0].numpy()
        want, other = (raw, processed) if kind == LogprobKind.RAW else (processed, raw)
        np.testing.assert_allclose(sample.output_logprobs, want, atol=1e-5, rtol=0)
        assert np.max(np.abs(want - other)) > 1e-2  # the two kinds are told apart on this model


def test_multi_turn_continues_by_ids_and_matches_the_learner(sglang_dense):
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    conversations = [Conversation.from_prompt(p) for p in PROMPTS[:3]]
    conversations = sglang_dense.engine.continue_conversations(conversations, params)
    conversations = [c.add_environment_tokens([100, 101]) for c in conversations]
    conversations = sglang_dense.engine.continue_conversations(conversations, params)
    for conversation, prompt in zip(conversations, PROMPTS[:3], strict=True):
        assert conversation.num_model_turns == 2
        assert conversation.token_ids[:len(prompt)].tolist() == prompt
        assert len(conversation.token_ids) == len(prompt) + 6 + 2 + 6
        ids = conversation.token_ids[None]
        learner = sequence_logprobs(sglang_dense.model, ids, np.asarray([ids.shape[1]]))[0]
        mask = conversation.model_mask.astype(bool)
        assert np.max(np.abs(learner[mask] - conversation.rollout_logprobs[mask])) <= ALIGN_TOL


def perturbed(model: Decoder, seed: int) -> Decoder:
    return random_decoder(model.config, seed=seed)


def test_generation_stops_at_a_stop_token_as_the_embedded_sampler_does(sglang_dense):
    """A greedy continuation, then the same with its fourth token as a stop id: the output ends at
    that token's first occurrence with finish "stop", and the embedded sampler on the same weights
    stops at the same place (SGLang ignores stop_token_ids when ignore_eos is set)."""
    engine, prompt = sglang_dense.engine, PROMPTS[1]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=12))[0][0]
    assert free.finish_reason == "length" and len(free.output_ids) == 12
    stop = int(free.output_ids[3])
    first = int(np.flatnonzero(np.asarray(free.output_ids) == stop)[0])
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
    stopped = engine.generate([prompt], params)[0][0]
    assert stopped.finish_reason == "stop"
    np.testing.assert_array_equal(stopped.output_ids, free.output_ids[:first + 1])
    embedded = JaxSampler(sglang_dense.model).generate([prompt], params)[0][0]
    np.testing.assert_array_equal(embedded.output_ids, stopped.output_ids)


def test_weight_push_changes_outputs_restores_them_bit_for_bit_and_bumps_the_version(sglang_dense):
    engine, original = sglang_dense.engine, sglang_dense.model
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)

    def one_at_a_time():
        # Concurrent requests share batches whose make-up depends on arrival timing, and the
        # batch shape changes float32 summation order (1-ulp logprob differences); requests
        # one at a time run the same shapes every time, so bits can be compared. The flush
        # keeps prompts from reusing prefix-cache entries computed in other shapes (earlier
        # tests' batches, the push's probe, which shares PROMPTS[0]'s first token).
        engine.flush_cache()
        return [engine.generate([p], greedy)[0] for p in PROMPTS]

    before = one_at_a_time()
    start_version = engine.weight_version

    metrics = engine.update_weights(perturbed(original, seed=7), "step-1")
    assert engine.weight_version == "step-1"
    assert metrics["push/total_s"] > 0 and metrics["push/probe_max_abs_diff"] <= engine.push_config.probe_atol
    changed = one_at_a_time()
    assert all(s[0].weight_version == "step-1" for s in changed)
    assert any(not np.array_equal(a[0].output_ids, b[0].output_ids) for a, b in zip(before, changed, strict=True))

    engine.update_weights(original, "step-2")
    after = one_at_a_time()
    assert start_version != "step-2" and all(s[0].weight_version == "step-2" for s in after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a[0].output_ids, b[0].output_ids)
        np.testing.assert_array_equal(a[0].output_logprobs, b[0].output_logprobs)  # bit for bit


def test_in_memory_push_serves_the_learner_weights_and_survives_a_restart(sglang_dense, tmp_path):
    """PushConfig.method=tensor: the weights reach the server through shared memory, no checkpoint
    is written, the probe check passes, the samples' logprobs are the pushed model's; a server
    killed afterwards comes back from its last checkpoint on disk and is given the pushed tensors
    again (in new shared files: the dead server's took theirs) before the failed request is
    retried, and later pushes use the new files. The fleet's own weights go back at the end."""
    manager, original = sglang_dense.manager, sglang_dense.model
    engine = SGLangEngine(manager, push=PushConfig(method="tensor", checkpoint_dir=str(tmp_path / "unused")))
    pushed = perturbed(original, seed=13)
    try:
        metrics = engine.update_weights(pushed, "in-memory-1")
        assert metrics["push/probe_max_abs_diff"] <= engine.push_config.probe_atol
        assert not (tmp_path / "unused").exists()
        params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=3)

        def aligned(samples):
            for prompt, group in zip(PROMPTS, samples, strict=True):
                s = group[0]
                assert s.weight_version == "in-memory-1"
                ids = np.concatenate([s.prompt_ids, s.output_ids])[None]
                want = sequence_logprobs(pushed, ids, np.asarray([ids.shape[1]]))[0, len(prompt):]
                assert np.max(np.abs(s.output_logprobs - want)) <= ALIGN_TOL

        aligned(engine.generate(PROMPTS, params))
        restarts = manager.restarts(0)
        manager.kill(0)
        aligned(engine.generate(PROMPTS, params))  # fails, restarts the server, reloads, retries
        assert manager.restarts(0) == restarts + 1
        # The dead server's files are gone; the next push goes through the renewed ones.
        assert engine.update_weights(original, "in-memory-2")["push/probe_max_abs_diff"] <= ALIGN_TOL
    finally:
        engine.close()
        sglang_dense.engine.update_weights(original, "after-in-memory")  # the fleet's engine, its own version


def test_spot_check_catches_a_wrong_push(sglang_dense, tmp_path):
    """The export writes other weights than the learner holds: the probe check must fail."""
    wrong = perturbed(sglang_dense.model, seed=11)
    from jaxrl.models import save_hf_checkpoint

    lying = SGLangEngine(sglang_dense.manager, export_fn=lambda params, path: save_hf_checkpoint(wrong, path),
                         push=PushConfig(method="disk", checkpoint_dir=str(tmp_path)))
    with pytest.raises(PushVerificationError) as err:
        lying.update_weights(sglang_dense.model, "step-bad")
    message = str(err.value)
    assert sglang_dense.manager.urls[0] in message and "differ from the learner's recompute" in message
    lying.close()
    # Put the learner's weights back for the tests that follow.
    sglang_dense.engine.update_weights(sglang_dense.model, "step-restored")


def _descendants(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(child) for child in f.read().split()]
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def _auxiliary_vector(pid: int) -> bytes:
    """What the kernel handed the process's program at its last exec (entry point, random bytes'
    address: different for every exec under address-space randomisation); a fork keeps it."""
    with open(f"/proc/{pid}/auxv", "rb") as f:
        return f.read()


def test_a_cpu_servers_scheduler_and_detokenizer_are_forked_not_spawned(sglang_dense):
    """SGLang starts its children with "spawn" (a new interpreter each, which imports SGLang and
    torch again); the launcher of a CPU server turns that into "fork" (processes.LAUNCH_FORK_ENV).
    SGLang renames its children (``sglang::scheduler``), so the command line cannot tell; the
    auxiliary vector can: a forked child keeps its parent's, an exec gets its own."""
    launcher = sglang_dense.manager.pid(0)
    assert _auxiliary_vector(launcher) != _auxiliary_vector(os.getpid())  # an exec (the launcher's) changes it
    children = _descendants(launcher)
    forked = [pid for pid in children if _auxiliary_vector(pid) == _auxiliary_vector(launcher)]
    assert len(forked) >= 2, children  # the scheduler and the detokenizer


def test_two_servers_serve_one_batch_complete_and_in_order(sglang_moe):
    prompts = [[(7 * i + j) % 120 + 1 for j in range(2 + i % 5)] for i in range(12)]
    samples = sglang_moe.engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), n=3)
    assert len(samples) == len(prompts)
    for prompt, row in zip(prompts, samples, strict=True):
        assert len(row) == 3
        for s in row:
            assert s.prompt_ids.tolist() == prompt and len(s.output_ids) == 8
    # Prompt i went to server i % 2; every sample, from either server, matches the learner
    # (one right-padded learner call for all of them).
    sequences = [np.concatenate([s.prompt_ids, s.output_ids]) for row in samples for s in row]
    lengths = np.asarray([len(q) for q in sequences])
    padded = np.zeros((len(sequences), lengths.max()), np.int32)
    for k, q in enumerate(sequences):
        padded[k, :len(q)] = q
    learner = sequence_logprobs(sglang_moe.model, padded, lengths)
    for k, s in enumerate(s for row in samples for s in row):
        want = learner[k, len(s.prompt_ids):lengths[k]]
        assert np.max(np.abs(s.output_logprobs - want)) <= ALIGN_TOL, k


def test_moe_routed_experts_match_the_learner_router(sglang_moe):
    prompt = [5, 17, 33, 2, 90, 61]
    sample = sglang_moe.engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=6))[0][0]
    fed = np.concatenate([sample.prompt_ids, sample.output_ids])[:-1]
    assert sample.routed_experts.shape == (6, 2, 2)
    out = sglang_moe.model(fed[None], np.arange(len(fed))[None])
    learner_routes = np.asarray(out.routed_experts[0])[len(prompt) - 1:]  # [output tokens, layers, top_k]
    # Same expert sets (the order within a top-k row is each side's own).
    np.testing.assert_array_equal(np.sort(sample.routed_experts, -1), np.sort(learner_routes, -1))
    prompt_routes = np.asarray(out.routed_experts[0])[:len(prompt) - 1]
    np.testing.assert_array_equal(np.sort(sample.prompt_routed_experts, -1), np.sort(prompt_routes, -1))


def test_killed_server_is_restarted_and_the_batch_completes_without_loss_or_duplicates(sglang_moe):
    manager = sglang_moe.manager
    # A pushed version first: the restarted server must come back with it, not the start-up weights.
    sglang_moe.engine.update_weights(sglang_moe.model, "moe-pushed")
    restarts_before = manager.restarts(0)
    old_pid = manager.pid(0)
    prompts = [[(3 * i + j) % 120 + 1 for j in range(3 + i % 4)] for i in range(48)]
    params = SamplingParams(temperature=1.0, max_new_tokens=128)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sglang_moe.engine.generate, prompts, params, 2)
        time.sleep(0.3)
        assert not future.done(), "the batch finished before the kill; make it longer"
        manager.kill(0)
        samples = future.result(timeout=300)
    assert manager.restarts(0) == restarts_before + 1 and manager.pid(0) != old_pid
    assert len(samples) == len(prompts)
    for prompt, row in zip(prompts, samples, strict=True):
        assert len(row) == 2
        for s in row:
            assert s.prompt_ids.tolist() == prompt and len(s.output_ids) == 128
            assert s.weight_version == "moe-pushed"
            assert np.all(np.isfinite(s.output_logprobs)) and np.all(s.output_logprobs <= 0)
    # The restarted server serves the same weights: its samples still match the learner.
    row = samples[0]
    ids = np.concatenate([row[0].prompt_ids, row[0].output_ids])[None]
    want = sequence_logprobs(sglang_moe.model, ids, np.asarray([ids.shape[1]]))[0, len(prompts[0]):]
    assert np.max(np.abs(row[0].output_logprobs - want)) <= ALIGN_TOL
