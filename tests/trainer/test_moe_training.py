"""Rollout routing replay (``update.routing_replay``) and the router z-loss
(``update.router_z_loss``) through the trainer.

The engine runs the learner's weights with its routers perturbed, so it routes some tokens to
other experts than the learner would (the MoE training-inference mismatch R3 removes). Without
replay the recompute's mismatch and route disagreement show it; with replay the learner's
``old_logp`` are a plain decoder forward that uses the engine's routes, the mismatch falls by
orders of magnitude (only the combine weights, which come from the learner's router, still
differ), the router still learns, the routes travel through packing and mini/micro-batches
unchanged, and expert-parallel sharding with scanned layers gives the one-device update. The same on a real CPU
SGLang MoE fleet, whose returned routes the trainer replays.
"""

import zlib

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import make_mesh
from jaxrl.rollout.sampler import JaxSampler
from jaxrl.rollout.sglang.launch import CPU_VENV_PYTHON
from jaxrl.trainer.stages import recompute as recompute_stage
from jaxrl.trainer.metrics import read_jsonl
from jaxrl.trainer.model import build_model
from jaxrl.trainer.rl import RLTrainer

import test_loop
from test_loop import ARCHITECTURE, make_config

files = test_loop.files  # test_loop's pytest fixture, bound here so that pytest finds it for this module's tests

MOE = {**ARCHITECTURE, "num_layers": 2, "mlp_types": ("moe", "moe"), "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 16}
# Relative to the router weights' std: flips the top-k of some tenths of a percent of the positions
# while the combine weights barely move, so the mismatch is mostly routing (what R3 removes); larger
# noise moves the combine weights too, which replay keeps from the learner's router by design.
ROUTER_NOISE = 0.001
# Enough positions (8 prompts x 4 samples x up to 17 tokens) that a few of them flip.
ROLLOUT = {"verify_push": False, "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A random MoE checkpoint with weights large enough (x10) that an expert swap moves logprobs."""
    from jaxrl.models import ModelConfig
    from jaxrl.rollout.sglang.testing import write_random_checkpoint

    path = str(tmp_path_factory.mktemp("moe") / "hf")
    write_random_checkpoint(path, ModelConfig(**MOE), seed=0, matrix_scale=10.0)
    return path


def perturb_routers(state, scale: float, seed: int = 0):
    """``state`` with every router weight matrix plus Gaussian noise of ``scale`` x its own std."""
    key = jax.random.key(seed)

    def perturb(path, x):
        if "router" not in jax.tree_util.keystr(path):
            return x
        name = jax.tree_util.keystr(path)
        noise = jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), x.shape)
        return x + scale * np.std(np.asarray(x)) * noise.astype(x.dtype)

    return jax.tree_util.tree_map_with_path(perturb, state)


class RouterNoiseEngine:
    """A real engine whose every weight push carries the learner's weights with perturbed routers."""

    def __init__(self, engine, scale: float = ROUTER_NOISE):
        self.engine, self.scale = engine, scale

    def update_weights(self, model, version: str):
        graphdef, state = nnx.split(model)
        return self.engine.update_weights(nnx.merge(graphdef, perturb_routers(state, self.scale)), version)

    def __getattr__(self, name):  # generate, weight_version, holds_references, close: the engine's own
        return getattr(self.engine, name)


def moe_config(files, checkpoint, out, replay: bool, **sections):
    sections = {**sections, "update": {"routing_replay": replay, **sections.get("update", {})},
                "model": {"hf_path": checkpoint, **sections.get("model", {})}}
    return make_config(files, out, rollout=ROLLOUT, **sections)


def embedded_engine(config, scale: float = ROUTER_NOISE):
    """The embedded sampler the trainer would build, on perturbed routers."""
    mesh = make_mesh(config.mesh)
    engine = RouterNoiseEngine(JaxSampler(build_model(config.model, mesh), mesh=mesh, max_batch=128), scale)
    engine.update_weights(build_model(config.model, mesh), version="0")
    return engine


def run(config, engine, steps_to_record=()):
    """(rows of metrics, params before, params after, {step: the recompute's StepBatch})."""
    recorded = {}
    recompute = recompute_stage.recompute

    def recording(batch, *args, **kwargs):
        out = recompute(batch, *args, **kwargs)
        recorded[len(recorded) + 1] = out[0]
        return out

    trainer = RLTrainer(config, engine=engine)
    recompute_stage.recompute = recording
    try:
        graphdef = trainer.learner.train_step.graphdef
        before = jax.device_get(trainer.state["params"])
        trainer.run()
        after = jax.device_get(trainer.state["params"])
    finally:
        recompute_stage.recompute = recompute
        trainer.close()
    return read_jsonl(str(config.output_dir) + "/metrics.jsonl"), graphdef, before, after, recorded


def forward_with_routes(graphdef, params, batch):
    """old_logp by one plain decoder forward over the batch's rows with its routes and full
    logits (no scorer, no chunked head, no packing)."""
    model = nnx.merge(graphdef, params)
    hidden = model(batch.input_ids, batch.positions, batch.segment_ids, routed_experts=batch.routed_experts).hidden
    logp = jax.nn.log_softmax(model.head(hidden), axis=-1)
    return np.take_along_axis(np.asarray(logp), np.asarray(batch.targets)[..., None], -1)[..., 0]


def router_leaves(params):
    return [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(params)
            if "router" in jax.tree_util.keystr(path)]


def test_replay_removes_the_routing_mismatch_of_a_perturbed_engine(files, moe_checkpoint, tmp_path):
    config = moe_config(files, moe_checkpoint, tmp_path / "off", replay=False, steps=1)
    rows, _, _, _, batches_off = run(config, embedded_engine(config))
    config = moe_config(files, moe_checkpoint, tmp_path / "on", replay=True, steps=1)
    rows_on, graphdef, before, after, batches_on = run(config, embedded_engine(config))
    off, on = rows[0], rows_on[0]
    print(f"k3 without replay {off['mismatch/k3']:.3g}, with {on['mismatch/k3']:.3g}; "
          f"route disagreement {off['routing/disagreement']:.3f}")
    # Same engine, same seed: the first step's samples and their routes are the same in both runs.
    np.testing.assert_array_equal(batches_off[1].routed_experts, batches_on[1].routed_experts)
    # The first layer's routers see the same inputs with and without replay (later ones do not).
    assert off["routing/disagreement"] > 0 and on["routing/disagreement_layer0"] == off["routing/disagreement_layer0"]
    assert off["mismatch/k3"] > 1e-5
    assert on["mismatch/k3"] * 100 <= off["mismatch/k3"]
    # The replayed recompute is the decoder's forward with the engine's routes.
    batch = batches_on[1]
    want = forward_with_routes(graphdef, before, batch)
    generated = np.asarray(batch.generated)
    np.testing.assert_allclose(np.asarray(batch.old_logp)[generated], want[generated], atol=2e-5)
    # The router learns: its weights moved (AdamW moves no weight whose gradient is zero).
    for a, b in zip(router_leaves(before), router_leaves(after), strict=True):
        assert np.abs(a - b).max() > 1e-4


def _k3(logp, ref_logp):
    """k3(p || ref) per token: exp(ref - logp) - (ref - logp) - 1 (float64)."""
    gap = np.asarray(ref_logp, np.float64) - np.asarray(logp, np.float64)
    return np.exp(gap) - gap - 1


def test_the_update_and_the_reference_replay_the_routes(files, moe_checkpoint, tmp_path):
    """One mini-batch and a KL to the reference, at the first step (learner = reference = the
    weights the recompute used): with replay the reference's forward is the recompute's, and the
    update's first forward sees the reference's logprobs (its k3 to them is float rounding).
    A forward that routes for itself differs from these by a k3 over 100x that bound, so an update
    or a reference that dropped the routes would show here."""
    config = moe_config(files, moe_checkpoint, tmp_path, replay=True, steps=1, update={"mini_batches": 1},
                        objective={"kl_kind": "k3-as-loss", "kl_coef": 0.1})
    rows, graphdef, before, _, batches = run(config, embedded_engine(config, scale=0.05))
    batch, first = batches[1], rows[0]
    generated = np.asarray(batch.generated)
    old_logp = np.asarray(batch.old_logp)[generated]
    np.testing.assert_allclose(np.asarray(batch.ref_logp)[generated], old_logp, atol=1e-6)
    own_routing = forward_with_routes(graphdef, before, batch.replace(routed_experts=None))[generated]
    dropped = _k3(own_routing, old_logp).mean()
    print(f"update k3 to the reference {first['update/kl_k3']:.3g}; a forward without the routes {dropped:.3g}")
    assert dropped > 1e-5
    assert abs(first["update/kl_k3"]) * 100 <= dropped


def test_routes_travel_through_packing_and_mini_and_micro_batches(files, moe_checkpoint, tmp_path):
    """Packed rows, 2 mini-batches of 2 micro-batches each: the update of the plain rows. The
    engine's routers are perturbed more here (a few percent of the routes differ), so routes
    lost or misplaced on the way would change the update."""
    updates = {"mini_batches": 2, "micro_batches": 2}
    params = {}
    for name, pack in (("plain", False), ("packed", True)):
        config = moe_config(files, moe_checkpoint, tmp_path / name, replay=True, steps=2,
                            update={**updates, "pack": pack})
        params[name] = run(config, embedded_engine(config, scale=0.05))[3]
    for a, b in zip(jax.tree.leaves(params["plain"]), jax.tree.leaves(params["packed"]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_expert_parallel_scanned_replay_equals_one_device(files, moe_checkpoint, tmp_path, monkeypatch):
    """data x fsdp x expert sharding with ``model.scan_layers`` and full remat (the 30B TPU config's
    choices) against one device with unrolled layers: two replayed steps end at the same parameters,
    and only the scanned run's learner traces the scan (the sampler decodes layer by layer).

    ``optimizer.eps`` 1e-6: with 8 shards the gradient sums run in another order, and AdamW's
    first step is lr * g / (|g| + eps), so an entry whose gradient is float32 noise (|g| of the
    order of eps = 1e-8) turns a relative difference of a percent in g into one of ~lr x 1e-2
    = 1e-4 in the parameter (measured: one entry of 4096, 5.2e-5, on an AMD EPYC; none on the CPU
    this was written on). A larger eps damps only such entries; every real gradient still moves
    its parameter by ~lr, so a sharding or scan mistake still shows at atol 2e-5."""
    from jaxrl.models.decoder import Decoder

    scans = []
    scan_blocks = Decoder._scan_blocks
    monkeypatch.setattr(Decoder, "_scan_blocks", lambda self, *a: scans.append(1) or scan_blocks(self, *a))
    params = {}
    for name, mesh, model in (("one", {}, {}),
                              ("sharded", {"data": 2, "fsdp": 2, "expert": 2}, {"scan_layers": True, "remat": "full"})):
        scans.clear()
        config = moe_config(files, moe_checkpoint, tmp_path / name, replay=True, steps=2, mesh=mesh, model=model,
                            optimizer={"eps": 1e-6})
        params[name] = run(config, embedded_engine(config, scale=0.05))[3]
        assert bool(scans) == (name == "sharded")
    for a, b in zip(jax.tree.leaves(params["one"]), jax.tree.leaves(params["sharded"]), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.parametrize("option", [{"routing_replay": True}, {"router_z_loss": 1e-3}])
def test_moe_update_options_need_an_moe_model(files, tmp_path, option):
    with pytest.raises(ValueError, match=f"update.{next(iter(option))} is for MoE models"):
        RLTrainer(make_config(files, tmp_path, update=option))


def test_router_z_loss_adds_its_term_to_the_update_loss(files, moe_checkpoint, tmp_path):
    """update.router_z_loss=c: the first update's loss is the c=0 loss plus c x the batch's router
    z-loss (same weights, same batch), and the routers move differently."""
    rows, routers = {}, {}
    for coef in (0.0, 0.5):
        config = make_config(files, tmp_path / str(coef), steps=1, model={"hf_path": moe_checkpoint},
                             update={"router_z_loss": coef})
        rows[coef], _, _, after, _ = run(config, engine=None)
        routers[coef] = router_leaves(after)
    plain, regularised = rows[0.0][0], rows[0.5][0]
    z = plain["update/moe_z_loss"]
    assert z > 0 and regularised["update/moe_z_loss"] == z
    np.testing.assert_allclose(regularised["update/loss"] - plain["update/loss"], 0.5 * z, rtol=1e-4)
    assert max(np.abs(a - b).max() for a, b in zip(routers[0.0], routers[0.5], strict=True)) > 1e-4


@pytest.mark.sglang
@pytest.mark.skipif(not CPU_VENV_PYTHON.exists(), reason="run scripts/setup_sglang_cpu.sh first")
def test_replay_of_a_real_sglang_moe_fleets_routes(files, tmp_path, sglang_moe):
    """Two steps on the SGLang MoE fleet (perturbed routers pushed to it): the trainer replays the
    routes the servers return; the mismatch falls as on the embedded sampler. The servers sample
    with their own seeds, so the noise is 3x the embedded tests' to make a step without a flipped
    route (which would prove nothing) improbable: about a dozen flips expected per step, not three.

    How much the flips cost varies from run to run (the servers' samples are not reproducible):
    without replay k3 was 1.0e-4, 1.2e-3 and 6.0e-4 over three runs on one machine; with replay
    0.9e-6 to 1.5e-6 each time, what the perturbed routers' gate weights (which replay does not
    replace) and float32 leave. So the bounds: replay leaves under 1e-5 and at most a thirtieth
    of the mismatch without it (the run with the fewest flips gave 76x)."""
    engine = RouterNoiseEngine(sglang_moe.engine, scale=3 * ROUTER_NOISE)
    results = {}
    try:
        for replay in (False, True):
            engine.update_weights(sglang_moe.model, version="0")
            config = make_config(
                files, tmp_path / str(replay), steps=2, model={"hf_path": sglang_moe.model_path},
                rollout=ROLLOUT, update={"routing_replay": replay})
            results[replay] = run(config, engine)
    finally:
        sglang_moe.engine.update_weights(sglang_moe.model, "moe-restored")
    rows_off, rows_on = results[False][0], results[True][0]
    graphdef, before, batches = results[True][1], results[True][2], results[True][4]
    for off, on in zip(rows_off, rows_on, strict=True):
        print(f"k3 without replay {off['mismatch/k3']:.3g}, with {on['mismatch/k3']:.3g}; "
              f"route disagreement {off['routing/disagreement']:.3f} / {on['routing/disagreement']:.3f}")
        assert off["routing/disagreement"] > 0 and on["routing/disagreement"] > 0
        assert on["mismatch/k3"] <= 1e-5 and on["mismatch/k3"] * 30 <= off["mismatch/k3"]
    batch = batches[1]
    assert batch.routed_experts.shape[2:] == (2, 2)
    want = forward_with_routes(graphdef, before, batch)
    generated = np.asarray(batch.generated)
    np.testing.assert_allclose(np.asarray(batch.old_logp)[generated], want[generated], atol=2e-5)
