"""Partial rollouts (rollout.partial_tokens, jaxrl.trainer.stages.rollout.partial): the queue's rounds on a
scripted engine whose sample lengths are known, then the trainer with the embedded sampler."""

import json

import jax
import numpy as np
import pytest

import test_loop
from jaxrl.models import ModelConfig
from jaxrl.rollout.base import Sample
from jaxrl.rollout.sglang.testing import write_random_checkpoint
from jaxrl.trainer.stages import recompute as recompute_stage
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.stages.rollout.partial import PartialRolloutQueue
from jaxrl.trainer.rl import RLTrainer
from test_loop import ARCHITECTURE, make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests


# ---------------------------------------------------------------- the queue on a scripted engine
class Prompts:
    """A data iterator over prompts [n, ...]: draw d yields prompts 2d and 2d+1 (as the trainer's
    iterator yields prompts_per_step examples); its state is the next draw."""

    class Example:
        def __init__(self, n):
            self.prompt_ids = np.array([n], np.int32)

    def __init__(self):
        self.next = 0

    def __next__(self):
        self.next += 1
        return [self.Example(2 * (self.next - 1)), self.Example(2 * (self.next - 1) + 1)]

    def state(self):
        return {"next": self.next}

    def restore(self, state):
        self.next = state["next"]


def length_of(prompt: int) -> int:
    """The scripted sample length of a prompt: 1..7 tokens."""
    return 1 + (3 * prompt) % 7


class ScriptedEngine:
    """Every sample of prompt p has length_of(p) tokens: token t of it is 100 + t, its logprob
    -(version + 1) (so each token shows which weights made it), and it stops after the last."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, prompts, n, budget, seed):
        self.calls.append((len(prompts), n, budget))
        out = []
        for ids in prompts:
            done, want = len(ids) - 1, length_of(ids[0])
            take = min(budget, want - done)
            out.append([Sample(prompt_ids=np.array(ids, np.int32), output_ids=np.arange(100 + done, 100 + done + take),
                               output_logprobs=np.full(take, -(self.version + 1.0), np.float32),
                               finish_reason="stop" if done + take == want else "length",
                               weight_version=str(self.version)) for _ in range(n)])
        return out


def scripted_queue(engine, data=None, groups=4):
    return PartialRolloutQueue(data or Prompts(), engine.generate, lambda step, draw: 1000 * step + draw, prompts=2,
                               groups=groups, group_size=2, partial_tokens=2, max_new_tokens=6)


def step(queue, engine, index):
    queue.fill(index - 1)
    engine.version = index - 1
    return queue.take(index)


def test_a_step_trains_on_the_first_finished_groups_and_carries_the_rest_with_its_versions():
    engine = ScriptedEngine()
    queue = scripted_queue(engine)
    # Step 1 (version 0), 4 groups in flight: prompts 0..3 want 1, 4, 7 (capped at 6) and 3 tokens.
    # Round 0 finishes prompt 0; round 1 finishes 1 and 3: the step trains on 0 and 1.
    first = step(queue, engine, 1)
    assert [int(e.prompt_ids[0]) for e in first.examples] == [0, 1]
    assert first.metrics["rollout/partial_rounds"] == 2 and first.metrics["rollout/partial_in_flight"] == 1
    # Step 2 (version 1): 3 (finished in step 1) and 2 (4 tokens so far) are two of four; the draw
    # of prompts 4 and 5 fills the pool. One round: 2 reaches 6 tokens, 5 (2 tokens) finishes.
    second = step(queue, engine, 2)
    assert [int(e.prompt_ids[0]) for e in second.examples] == [3, 2]
    assert second.metrics["rollout/partial_carried_in"] == 1 and second.metrics["rollout/partial_rounds"] == 1
    three, two = second.samples
    for sample in three:
        np.testing.assert_array_equal(sample.output_ids, [100, 101, 102])
        np.testing.assert_array_equal(sample.output_versions, [0, 0, 0])
        assert sample.finish_reason == "stop"
    for sample in two:  # two rounds of step 1 with version 0, one of step 2 with version 1
        np.testing.assert_array_equal(sample.output_ids, 100 + np.arange(6))
        np.testing.assert_array_equal(sample.output_versions, [0, 0, 0, 0, 1, 1])
        np.testing.assert_array_equal(sample.output_logprobs, [-1, -1, -1, -1, -2, -2])
        assert sample.finish_reason == "length" and sample.weight_version == "0"  # the oldest
    assert second.metrics["rollout/partial_samples"] == 0.5  # prompt 2's two samples span versions
    assert second.metrics["rollout/token_staleness_max"] == 1.0
    assert second.metrics["rollout/token_staleness_mean"] == pytest.approx((6 * 1 + 2 * 4 * 1) / (6 + 12))
    # Budgets: new groups 2 tokens, continuations at most 2, never past max_new_tokens.
    assert all(budget == 2 for _, _, budget in engine.calls)


def test_the_queue_state_puts_back_every_group_in_flight():
    engine = ScriptedEngine()
    straight = scripted_queue(engine)
    want = [step(straight, engine, index) for index in (1, 2, 3)][1:]
    data, other = Prompts(), ScriptedEngine()
    saved = scripted_queue(other, data)
    step(saved, other, 1)
    record = json.loads(json.dumps(saved.state(1)))  # through JSON, as a checkpoint's meta
    assert record["partial"]["pool"]  # groups in flight are in it
    data.restore({"next": 99})  # another position: restore must put the iterator back
    resumed = scripted_queue(other, data)
    resumed.restore(record)
    got = [step(resumed, other, index) for index in (2, 3)]
    for a, b in zip(want, got, strict=True):
        assert [int(e.prompt_ids[0]) for e in a.examples] == [int(e.prompt_ids[0]) for e in b.examples]
        for ga, gb in zip(a.samples, b.samples, strict=True):
            for sa, sb in zip(ga, gb, strict=True):
                np.testing.assert_array_equal(sa.output_ids, sb.output_ids)
                np.testing.assert_array_equal(sa.output_versions, sb.output_versions)
                np.testing.assert_array_equal(sa.output_logprobs, sb.output_logprobs)


# ---------------------------------------------------------------- the trainer, embedded sampler
@pytest.fixture(scope="module")
def stopping_checkpoint(tmp_path_factory):
    """A random model whose generation_config ends a response at any of four ids, so that sample
    lengths spread widely (about a quarter of the draws stop)."""
    path = tmp_path_factory.mktemp("stopping") / "hf"
    write_random_checkpoint(str(path), ModelConfig(**{**ARCHITECTURE, "max_position_embeddings": 64}), seed=2,
                            matrix_scale=1.0)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4, 5, 6]}))
    return str(path)


def run(config, resume=False, cache_shapes=None):
    """(metrics rows, final params, {step: (samples, the recompute's batch)}); ``cache_shapes``, a list,
    receives the embedded sampler's ``cache_shapes`` of each generate call."""
    recorded = {}
    recompute = recompute_stage.recompute
    trainer = RLTrainer(config, resume=resume)
    take = trainer.stage("rollout").queue.take
    if cache_shapes is not None:
        generate = trainer.engine.generate

        def generating(*args, **kwargs):
            out = generate(*args, **kwargs)
            cache_shapes.append(trainer.engine.cache_shapes)
            return out

        trainer.engine.generate = generating

    def taking(index):
        batch = take(index)
        recorded[index] = [batch.samples]
        return batch

    def recording(batch, *args, **kwargs):
        out = recompute(batch, *args, **kwargs)
        recorded[trainer.step + 1].append(out[0])
        return out

    trainer.stage("rollout").queue.take = taking
    recompute_stage.recompute = recording
    try:
        trainer.run()
        params = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
    finally:
        recompute_stage.recompute = recompute
        trainer.close()
    return read_jsonl(str(config.output_dir) + "/metrics.jsonl"), params, recorded


def test_whole_samples_in_one_round_are_the_synchronous_loop(files, tmp_path):
    """partial_tokens >= max_new_tokens, partial_groups = prompts_per_step: bit for bit the same run.
    Both recompute ``old_logp`` (partial rollouts always do; the synchronous loop would skip it under
    ``when_needed``), so the two loops are compared, not the recompute option."""
    rows = {}
    for name, rollout in (("sync", {}), ("partial", {"partial_tokens": 6, "partial_groups": 4})):
        rows[name], params, _ = run(make_config(files, tmp_path / name, steps=2, rollout=rollout,
                                                update={"recompute_old_logp": "always"}))
        rows[name + "_params"] = params
    for a, b in zip(rows["sync_params"], rows["partial_params"], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(rows["sync"], rows["partial"], strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == \
            {k: v for k, v in b.items() if k in a and not k.startswith("time/")}
        assert b["rollout/partial_rounds"] == 1.0 and b["rollout/partial_in_flight"] == 0.0


PARTIAL = {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 10, "partial_tokens": 2}


def test_carried_samples_keep_each_tokens_version_and_behaviour_logprob(files, tmp_path, stopping_checkpoint):
    """Tokens the engine made with the current weights match the learner's recompute; tokens made
    with the previous step's weights do not (the update moved them), so the engine logprob the
    mismatch corrections use is that of the weights that drew each token."""
    config = make_config(files, tmp_path, steps=3, model={"hf_path": stopping_checkpoint}, rollout=PARTIAL,
                         optimizer={"lr": 3e-2, "clip_norm": 1.0})
    rows, _, recorded = run(config)
    assert max(r["rollout/partial_carried_in"] for r in rows) > 0
    assert max(r["rollout/partial_samples"] for r in rows) > 0
    current, older = [], []
    for index, (samples, batch) in recorded.items():
        flat = [s for group in samples for s in group]
        generated, old_logp = np.asarray(batch.generated), np.asarray(batch.old_logp)
        engine = np.asarray(batch.rollout_logp)
        for row, sample in enumerate(flat):
            gap = np.abs(engine[row][generated[row]] - old_logp[row][generated[row]])
            assert len(gap) == len(sample.output_versions)
            current += gap[sample.output_versions == index - 1].tolist()
            older += gap[sample.output_versions < index - 1].tolist()
    print(f"{len(current)} tokens of the current weights: max gap {max(current):.2g}; {len(older)} of older "
          f"weights: median gap {np.median(older):.2g}")
    assert older, "no carried token reached an update"
    assert max(current) < 1e-4
    assert np.median(older) > 1e-3


def test_rounds_reach_the_sampler_and_sample_what_one_call_samples(files, tmp_path, stopping_checkpoint):
    """rollout.round_tokens reaches the embedded sampler: with 1, each partial call of 2 new tokens runs
    two rounds, the second over the unfinished samples only (with 0, one call). The samples are the
    same token for token, and the tokens of the current weights match the learner's recompute."""
    shapes, samples = {}, {}
    for round_tokens in (0, 1):
        shapes[round_tokens] = []
        config = make_config(files, tmp_path / str(round_tokens), steps=2, model={"hf_path": stopping_checkpoint},
                             rollout={**PARTIAL, "round_tokens": round_tokens})
        _, _, recorded = run(config, cache_shapes=shapes[round_tokens])
        samples[round_tokens] = recorded
    assert all(len(call) == 1 for call in shapes[0])
    rounds = [call for call in shapes[1] if len(call) == 2]
    assert rounds and any(second[0] < first[0] for first, second in rounds)  # finished samples left the batch
    for index, (step_samples, batch) in samples[1].items():
        flat = [s for group in step_samples for s in group]
        reference = [s for group in samples[0][index][0] for s in group]
        for sample, expected in zip(flat, reference, strict=True):
            np.testing.assert_array_equal(sample.output_ids, expected.output_ids)
        generated, old_logp = np.asarray(batch.generated), np.asarray(batch.old_logp)
        engine = np.asarray(batch.rollout_logp)
        for row, sample in enumerate(flat):
            gap = np.abs(engine[row][generated[row]] - old_logp[row][generated[row]])
            assert np.max(gap[sample.output_versions == index - 1], initial=0.0) < 1e-4


def test_resume_with_groups_in_flight_reproduces_the_straight_run(files, tmp_path, stopping_checkpoint):
    checkpoint = {"every": 1, "keep": 2}
    model = {"hf_path": stopping_checkpoint}
    straight = make_config(files, tmp_path / "a", steps=4, model=model, rollout=PARTIAL,
                           checkpoint={**checkpoint, "directory": str(tmp_path / "a" / "ck")})
    rows_a, params_a, _ = run(straight)
    assert rows_a[1]["rollout/partial_in_flight"] > 0  # the checkpoint after step 2 holds groups in flight
    first = make_config(files, tmp_path / "b", steps=2, model=model, rollout=PARTIAL,
                        checkpoint={**checkpoint, "directory": str(tmp_path / "b" / "ck")})
    run(first)
    rows_b, params_b, _ = run(make_config(files, tmp_path / "b", steps=4, model=model, rollout=PARTIAL,
                                          checkpoint={**checkpoint, "directory": str(tmp_path / "b" / "ck")}),
                              resume=True)
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in rows_a] == [strip(r) for r in rows_b]


@pytest.mark.parametrize("sections, key", [
    ({"rollout": {"partial_tokens": 2, "max_staleness": 1}}, "rollout.max_staleness"),
    ({"rollout": {"partial_tokens": 2, "dynamic_sampling": True}}, "rollout.dynamic_sampling"),
    ({"rollout": {"partial_tokens": 2, "partial_groups": 2}}, "rollout.partial_groups"),
    ({"rollout": {"partial_tokens": 2}, "advantage": {"estimator": "remax"}}, "greedy baseline"),
    ({"rollout": {"round_tokens": -1}}, "rollout.round_tokens must be >= 0"),
])
def test_partial_rollouts_refuse_what_they_cannot_combine_with(files, tmp_path, sections, key):
    with pytest.raises(ValueError, match=key):
        make_config(files, tmp_path, **sections)
