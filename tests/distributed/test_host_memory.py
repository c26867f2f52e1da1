"""XLA:CPU's scratch buffer stays mapped between calls in a command's process (jaxrl.distributed.host_memory).

Each case runs in a fresh process (the CPU client reads its dispatch setting once, when it starts):
``distributed.initialize()`` as every command runs it first, optionally an ``RLTrainer`` on the demo
config (the trainer applies the heap setting once its mesh is on CPU), then a program whose
temporary buffer is larger than any block glibc keeps by default (> 64 MiB, read from
``memory_analysis``). The expected fault counts come from that size: one minor fault per 4 KiB page
when the buffer is mapped afresh at every call, almost none when it is reused. The median call
counts: under load a call may once grow the heap by the whole buffer (seen in a full suite run:
20,484 faults over 5 calls, one whole buffer; presumably another thread's allocation had taken
part of the freed block), after which the new block is kept as well.
"""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource, sys, tempfile
from jaxrl import distributed
distributed.initialize()
import jax, jax.numpy as jnp
if sys.argv[1] == "trainer":
    from jaxrl.config import load_config
    from jaxrl.demo import write_demo_files
    from jaxrl.trainer.config import TrainConfig
    from jaxrl.trainer.rl import RLTrainer
    root = tempfile.mkdtemp()
    files = write_demo_files(root + "/demo")
    architecture = {"vocab_size": 17, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
                    "num_kv_heads": 1, "head_dim": 16, "max_position_embeddings": 32}
    config = load_config(TrainConfig, "configs/demo.yaml", [
        f"output_dir={root}/out", f"checkpoint.directory={root}/out/checkpoints", "model.hf_path=",
        f"model.architecture={json.dumps(architecture)}",
        f"data.tokenizer={files['tokenizer']}", f"data.train_files=[{files['train']}]", "data.eval_files=[]",
        "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"])
    RLTrainer(config).close()

@jax.jit
def scratch(x, y):  # a 4096 x 5120 float32 matrix held in the temporary buffer for the product (80 MiB)
    return jnp.sin(x[:, None] * y[None, :]) @ y

x, y = jnp.linspace(0, 1, 4096), jnp.linspace(0, 1, 5120)
temp = scratch.lower(x, y).compile().memory_analysis().temp_size_in_bytes
for _ in range(3):
    scratch(x, y).block_until_ready()
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    scratch(x, y).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"asynchronous": jax.config.read("jax_cpu_enable_async_dispatch"), "temp": temp,
                  "faults": sorted(faults)[len(faults) // 2], "per_call": faults}))
"""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(case: str, **env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("JAXRL_CPU_KEEP_BUFFERS", "JAX_CPU_ENABLE_ASYNC_DISPATCH")}
    done = subprocess.run([sys.executable, "-c", SCRIPT, case], env={**base, "JAX_PLATFORMS": "cpu", **env},
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["temp"] > 64 * 2**20, result  # larger than glibc keeps in any thread by default
    result["pages"] = result["temp"] / 4096
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap settings")
def test_a_trainer_keeps_the_scratch_buffer_mapped_between_calls():
    kept = _run("trainer")
    assert not kept["asynchronous"]
    assert kept["faults"] < 0.02 * kept["pages"], kept
    # initialize() alone makes the dispatch synchronous, but the heap still maps a block that large afresh.
    start_up_only = _run("start-up only")
    assert not start_up_only["asynchronous"]
    assert start_up_only["faults"] > 0.9 * start_up_only["pages"], start_up_only


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap settings")
def test_the_environment_turns_it_off():
    off = _run("trainer", JAXRL_CPU_KEEP_BUFFERS="0")
    assert off["asynchronous"]
    assert off["faults"] > 0.9 * off["pages"], off
    # A user's own choice of dispatch stands, and asynchronous dispatch gets no heap setting.
    chosen = _run("trainer", JAX_CPU_ENABLE_ASYNC_DISPATCH="true")
    assert chosen["asynchronous"]
    assert chosen["faults"] > 0.9 * chosen["pages"], chosen


def test_a_bad_switch_value_names_the_variable(monkeypatch):
    from jaxrl.distributed import host_memory

    monkeypatch.setenv("JAXRL_CPU_KEEP_BUFFERS", "false")
    with pytest.raises(ValueError, match=r"JAXRL_CPU_KEEP_BUFFERS='false': set it to 1 .* or 0 \(off\)"):
        host_memory.before_devices()
