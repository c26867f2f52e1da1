"""The long-context options through the trainers: ``update.pack``, ``sft.pack``, ``model.attention_impl``
and ``model.context_parallel`` each give the same update as the reference layout or kernel, and an SFT
curriculum reaches a 16K stage on a sequence-parallel mesh with the update of another split.

With packing the learner's forwards run on packed rows; the losses read per-sample rows, so
sequence-level terms (GSPO's sequence ratio, ``seq-mean-token-mean``) cannot mix samples.
Adam's first step with ``eps = 1`` is ``lr * g / (|g| + 1)`` ~ the gradient itself, so comparing
parameter changes compares gradients.
"""

import numpy as np
import pytest

import test_loop
from jaxrl.trainer.metrics import read_jsonl
from test_loop import make_config, spy

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests
GRADIENT_STEP = {"lr": 1.0, "eps": 1.0, "clip_norm": 0.0}


def _changes(initial, final):
    return [b - a for a, b in zip(initial, final, strict=True)]


def _train(trainer_type, config, check=lambda trainer: None):
    """(parameter changes, first metrics row) of a run; ``check(trainer)`` before it starts."""
    trainer = trainer_type(config)
    try:
        check(trainer)
        before = test_loop._params(trainer)
        trainer.run()
        changes = _changes(before, test_loop._params(trainer))
    finally:
        trainer.close()
    return changes, read_jsonl(str(config.output_dir + "/metrics.jsonl"))[0]


def _assert_same_update(reference, other):
    scale = max(float(np.max(np.abs(c))) for c in reference)
    assert scale > 1e-4  # a real update, far above the tolerance below
    for a, b in zip(reference, other, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * scale)


def _shared_columns(batch, mini_batches: int, micro_batches: int) -> int:
    """The most columns a shared-prefix layout can skip, counted by hand: in each micro-batch (samples
    m, m + M, ... of a mini-batch), the samples of one prompt share the leading columns (input and
    target) they all have in common, so all but one copy of those can go."""
    size, saved = batch.rows // mini_batches, 0
    for start in range(0, batch.rows, size):
        for m in range(micro_batches):
            by_prompt = {}
            for i in range(start + m, start + size, micro_batches):
                prompt = tuple(batch.input_ids[i, :batch.prompt_lengths[i]])
                by_prompt.setdefault(prompt, []).append(i)
            for members in by_prompt.values():
                columns = [list(zip(batch.input_ids[i], batch.targets[i], strict=True))
                           [:int(batch.segment_ids[i].sum())] for i in members]
                common = 0
                while all(len(c) > common and c[common] == columns[0][common] for c in columns):
                    common += 1
                saved += (len(members) - 1) * common
    return saved


def test_packed_rl_update_equals_one_sample_per_row(files, tmp_path):
    """Rows of 33 columns (prompts up to 24 tokens, 10 new) hold two or more of the ~15-token samples;
    with ``update.share_prefix`` the samples of one prompt in a micro-batch lay it out once."""
    from jaxrl.trainer.rl import RLTrainer

    changes, rows, batches = [], [], []

    def record(trainer):
        batches.append(spy(trainer, "pack"))

    for name, update in (("unpacked", {}), ("packed", {"pack": True}),
                         ("shared", {"pack": True, "share_prefix": True})):
        config = make_config(files, tmp_path / name, steps=1, update={**update, "mini_batches": 2, "micro_batches": 2},
                             rollout={"max_new_tokens": 10}, data={"max_prompt_tokens": 24},
                             objective={"policy_loss": "gspo", "aggregation": "seq-mean-token-mean"},
                             optimizer=GRADIENT_STEP)
        change, row = _train(RLTrainer, config, record)
        changes.append(change)
        rows.append(row)
    _assert_same_update(changes[0], changes[1])
    _assert_same_update(changes[0], changes[2])
    unpacked, packed, shared = rows
    for row in (packed, shared):
        assert row["update/loss"] == pytest.approx(unpacked["update/loss"], abs=1e-5)
        assert row["mismatch/k3"] == pytest.approx(unpacked["mismatch/k3"], abs=1e-6)  # the packed recompute
    assert "update/padding_fraction" not in unpacked
    assert packed["update/padding_fraction"] < packed["update/padding_fraction_unpacked"]
    assert "update/shared_prefix_fraction" not in packed
    # Two samples of each prompt per micro-batch; the packer shares a prompt unless the longer rows that
    # would take cost more cells than it saves, so it skips some of the columns it could.
    (_, packed_record, _), = batches[2].calls  # the shared run's packed batch
    batch = packed_record.batch
    most = _shared_columns(batch, 2, 2) / batch.num_tokens
    assert most > 0.1
    assert 0.5 * most < shared["update/shared_prefix_fraction"] <= most


def test_packed_sft_step_equals_one_pair_per_row(files, tmp_path):
    from jaxrl.trainer.sft import SFTTrainer

    changes, rows = [], []
    for pack in (False, True):
        out = tmp_path / f"sft-{pack}"
        config = make_config(files, out, data={"max_response_tokens": 8}, optimizer=GRADIENT_STEP,
                             sft={"batch_size": 8, "micro_batches": 2, "pack": pack,
                                  "stages": [{"steps": 1, "max_length": 32}]})
        change, row = _train(SFTTrainer, config)
        changes.append(change)
        rows.append(row)
    _assert_same_update(*changes)
    assert rows[1]["update/nll"] == pytest.approx(rows[0]["update/nll"], rel=1e-5)
    assert rows[1]["update/padding_fraction"] < rows[1]["update/padding_fraction_unpacked"]


def test_logprob_chunk_size_reaches_the_sft_head_and_changes_no_update(files, tmp_path, monkeypatch):
    """``update.logprob_chunk_size`` is the SFT step's LM-head chunk too (what bounds the head's
    float32 tiles at 64K): chunks of 4 tokens give the update of one chunk holding every token."""
    from jaxrl.models import decoder
    from jaxrl.trainer.sft import SFTTrainer

    chunk_sizes, head = [], decoder.sharded_token_logprobs_and_entropy

    def recording_head(*args, chunk_size, **kwargs):
        chunk_sizes.append(chunk_size)
        return head(*args, chunk_size=chunk_size, **kwargs)

    monkeypatch.setattr(decoder, "sharded_token_logprobs_and_entropy", recording_head)
    changes = []
    for chunk_size in (1024, 4):
        config = make_config(files, tmp_path / f"chunk-{chunk_size}", data={"max_response_tokens": 8},
                             optimizer=GRADIENT_STEP, update={"logprob_chunk_size": chunk_size},
                             sft={"batch_size": 8, "stages": [{"steps": 1, "max_length": 32}]})
        chunk_sizes.clear()
        changes.append(_train(SFTTrainer, config)[0])
        assert set(chunk_sizes) == {chunk_size}, chunk_sizes
    _assert_same_update(*changes)


def test_attention_impl_reaches_the_learner_and_changes_no_update(files, tmp_path):
    """``model.attention_impl=chunked`` (blocks of 4 columns, so rows of 15 run in 4 key blocks with
    the causal skip) gives the update of the reference ``xla`` einsum."""
    from jaxrl.trainer.rl import RLTrainer

    changes = []
    for impl in ("xla", "chunked"):
        config = make_config(files, tmp_path / impl, steps=1, optimizer=GRADIENT_STEP,
                             model={"attention_impl": impl, "attention_block_size": 4})

        def check(trainer, impl=impl):
            assert trainer.model().config.attention_impl == impl

        changes.append(_train(RLTrainer, config, check)[0])
    _assert_same_update(*changes)


# A hybrid: lightning, gated DeltaNet and softmax layers (Qwen3-Next-style softmax gate, partial RoPE).
HYBRID = {**test_loop.ARCHITECTURE, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
          "layer_types": ["lightning_attention", "gated_deltanet", "full_attention"],
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
          "linear_value_head_dim": 8, "linear_chunk_size": 4, "attention_output_gate": True,
          "partial_rotary_factor": 0.5, "norm_weight_offset": True}


def test_share_prefix_is_refused_for_a_model_with_linear_attention(files, tmp_path):
    """A tail cannot continue a recurrent state from one copy of its prompt: the trainer says so at
    start-up, naming the key, before any rollout."""
    from jaxrl.trainer.rl import RLTrainer

    config = make_config(files, tmp_path / "hybrid", steps=1, model={"architecture": HYBRID},
                         update={"pack": True, "share_prefix": True})
    with pytest.raises(ValueError, match=r"update.share_prefix cannot run on this model: its \['gated_deltanet', "
                                         r"'lightning_attention'\] layers carry a recurrent state"):
        RLTrainer(config)


def test_context_parallel_reaches_the_learner_and_changes_no_update(files, tmp_path, monkeypatch):
    """``mesh: {data: 2, sequence: 4}`` with ``model.context_parallel`` ``ulysses`` and ``ring`` against
    ``none`` (the partitioner's path) on the same mesh, so that every run samples the same rollouts: the
    recompute and the update of a hybrid model are the same, and only the Ulysses and ring runs split
    the sequence (their paths are traced; the rows, 11 tokens, are padded to 12 so that 4 shards divide
    them, to 16 for ring's two chunks per shard). tests/models/test_context_parallel.py and
    tests/models/test_ring_attention.py prove the forward and gradients equal one device's."""
    from jaxrl.models import context_parallel, ring
    from jaxrl.trainer.rl import RLTrainer

    traced = {"ulysses": [], "ring": []}
    lengths = {"none": 12, "ulysses": 12, "ring": 16}
    for module, name in ((context_parallel, "ulysses"), (ring, "ring_attention")):
        original = getattr(module, name)
        calls = traced[name.split("_")[0]]
        monkeypatch.setattr(module, name, lambda *a, original=original, calls=calls, **k: calls.append(1) or
                            original(*a, **k))
    changes, rows = [], []
    for mode in ("none", "ulysses", "ring"):
        for calls in traced.values():
            calls.clear()
        config = make_config(files, tmp_path / mode, steps=1, optimizer=GRADIENT_STEP,
                             mesh={"data": 2, "sequence": 4}, model={"architecture": HYBRID, "context_parallel": mode})

        def check(trainer, mode=mode):
            assert trainer.stage("pack").length == lengths[mode]

        change, row = _train(RLTrainer, config, check)
        changes.append(change)
        rows.append(row)
        assert bool(traced["ulysses"]) == (mode != "none")  # ring runs the linear layers on Ulysses
        assert bool(traced["ring"]) == (mode == "ring")
    for change, row in zip(changes[1:], rows[1:], strict=True):
        _assert_same_update(changes[0], change)
        assert row["mismatch/k3"] == pytest.approx(rows[0]["mismatch/k3"], abs=1e-6)
        assert row["update/loss"] == pytest.approx(rows[0]["update/loss"], abs=1e-5)


def long_sft_config(files, out, length: int, context_parallel: str, vocab_size: int | None = None):
    """An SFT curriculum of a short stage then one of ``length`` columns on 8 devices
    (``mesh.sequence=8``, chunked attention in blocks of 2,048), one pair of ~``length`` tokens
    in the long stage's batch; the optimizer step is the gradient (Adam's first step, ``eps=1``).
    bench/long_context_sft.py runs the same at 64K with the real vocabulary."""
    import json

    data = out.parent / f"long-{length}.jsonl"  # unshuffled: the long stage's batch is the long pair
    if not data.exists():
        with open(files["train"]) as source, open(data, "w") as f:
            response = "\\boxed{" + "3" * (length - 68) + "}"
            f.write(json.dumps({"prompt": "1+2=", "response": response, "answer": "3"}) + "\n")
            f.writelines(source.readlines()[:8])
    architecture = {**test_loop.ARCHITECTURE, "max_position_embeddings": length,
                    **({"vocab_size": vocab_size} if vocab_size else {})}
    return make_config(files, out, mesh={"sequence": 8}, optimizer=GRADIENT_STEP,
                       model={"architecture": architecture, "attention_impl": "chunked",
                              "attention_block_size": 2048, "context_parallel": context_parallel},
                       data={"train_files": [str(data)], "max_response_tokens": length, "shuffle": False},
                       sft={"batch_size": 1, "stages": [{"steps": 1, "max_length": 16},
                                                        {"steps": 1, "max_length": length}]})


def test_sft_curriculum_reaches_a_16k_stage_context_parallel_with_the_reference_update(files, tmp_path):
    """The SFT curriculum's last stage trains on a pair of ~16K tokens (rows of 16,384 columns) on 8
    devices with ``mesh.sequence=8``: Ulysses splits the row into 2,048-token shards and chunked
    attention never holds the 16K x 16K scores. The reference is the same two steps split the
    ring's way (``context_parallel: ring``: zig-zag halves of 1,024 tokens, key/value blocks passed
    around the devices): equal losses and equal parameter changes (the gradients). XLA's
    partitioner's own split (``none``) takes several times as long; bench/long_context_sft.py
    runs this at 64K."""
    from jaxrl.trainer.sft import SFTTrainer

    length = 16_384
    results = {}
    for mode in ("ulysses", "ring"):
        config = long_sft_config(files, tmp_path / mode, length, mode)
        changes, _ = _train(SFTTrainer, config)
        results[mode] = changes, read_jsonl(str(tmp_path / mode / "metrics.jsonl"))
    rows = results["ulysses"][1]
    assert [r["sft/max_length"] for r in rows] == [16, length]
    assert rows[1]["sft/tokens"] > length - 100  # the long pair
    for row, reference in zip(rows, results["ring"][1], strict=True):
        assert row["update/loss"] == pytest.approx(reference["update/loss"], rel=1e-5)
    _assert_same_update(results["ring"][0], results["ulysses"][0])
