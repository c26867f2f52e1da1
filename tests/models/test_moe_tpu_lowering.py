"""The MoE's TPU grouped matmul (megablox `gmm`, a Mosaic kernel) lowers and compiles for real TPU
topologies on this CPU (libtpu in ``.venv-tpu``; no TPU runs anything): forward and ``jax.grad`` of a
small MoE layer's loss, on one chip, under a data x fsdp mesh (the plain path in `shard_map`) and
under expert parallelism. The compile runs in ``.venv-tpu``'s interpreter in a subprocess."""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU_PYTHON = ROOT / ".venv-tpu" / "bin" / "python"

pytestmark = pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no .venv-tpu (jax[tpu] with libtpu) at the repo root")

SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jaxrl.models import MeshConfig, ModelConfig, make_mesh
from jaxrl.models.moe import MoE
from jaxrl.models.sharding import state_shardings

devices = list(topologies.get_topology_desc(platform="tpu", topology_name=sys.argv[1]).devices)
config = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=1, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=32, mlp_types=("moe",), num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=64, dtype="bfloat16")
report = {}
for name, axes in json.loads(sys.argv[2]).items():
    mesh = make_mesh(MeshConfig(**axes), devices)
    with jax.set_mesh(mesh):
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MoE(config, rngs=nnx.Rngs(0))))
        params = jax.tree.map(lambda a, s: a.replace(jax.ShapeDtypeStruct(a.value.shape, a.value.dtype, sharding=s)),
                              abstract, state_shardings(abstract, mesh), is_leaf=lambda a: isinstance(a, nnx.Variable))
        x = jax.ShapeDtypeStruct((8, 64, 128), jnp.bfloat16,
                                 sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
                                     tuple(a for a in ("data", "fsdp", "expert") if axes.get(a, 1) > 1) or None)))

        def loss(params, x):
            return jnp.mean(jnp.square(nnx.merge(graphdef, params)(x)[0]))
        forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0]).lower(params, x)
        backward = jax.jit(jax.grad(loss)).lower(params, x)
        report[name] = {"kernel_in_forward": "tpu_custom_call" in forward.as_text(),
                        "kernel_in_backward": "tpu_custom_call" in backward.as_text(),
                        "forward_flops": forward.compile().cost_analysis().get("flops"),
                        "backward_flops": backward.compile().cost_analysis().get("flops")}
print(json.dumps(report))
"""


@pytest.mark.parametrize("topology, meshes", [
    ("v5e:2x2", {"one chip": {}, "data x fsdp": {"data": 2, "fsdp": 2}, "expert": {"expert": 4}}),
])
def test_moe_gmm_compiles_for_tpu(topology, meshes):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run([str(TPU_PYTHON), "-c", SCRIPT, topology, json.dumps(meshes)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    for name, result in report.items():
        assert result["kernel_in_forward"] and result["kernel_in_backward"], (name, result)
        assert result["backward_flops"] > result["forward_flops"] > 0, (name, result)
