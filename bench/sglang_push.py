"""Weight push to a real SGLang server vs writing the same safetensors to disk.

    .venv/bin/python bench/sglang_push.py [--layers 8 --hidden 768 --vocab 32000 --pushes 3]

Starts one CPU SGLang server (float32) on a random ~100M-parameter Qwen3
``jaxrl.models.Decoder``, then for each push prints the engine's phases
(export = checkpoint write + atomic rename, load = /update_weights_from_disk,
verify = version + probe logprob check) next to a plain
``safetensors.numpy.save_file`` of the same tensors, and the ratio
push total / plain write. Needs scripts/setup_sglang_cpu.sh.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from jaxrl.models import ModelConfig  # noqa: E402
from jaxrl.models.hf import tensor_maps  # noqa: E402
from jaxrl.rollout.sglang import PushConfig, SGLangEngine, ServerConfig, ServerManager  # noqa: E402
from jaxrl.rollout.sglang.testing import random_decoder, write_random_checkpoint  # noqa: E402


def hf_tensors(model) -> dict[str, np.ndarray]:
    """The same named tensors a checkpoint holds, already on the host (what a plain write gets)."""
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    tensors = {}
    for m in tensor_maps(model.config):
        for name, array in zip(m.hf_names, m.save(np.asarray(jax.device_get(flat[m.path][...]))), strict=True):
            tensors[name] = np.ascontiguousarray(array)
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--pushes", type=int, default=3)
    parser.add_argument("--port", type=int, default=31900)
    args = parser.parse_args()
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 256, 1),
                         head_dim=64, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model = write_random_checkpoint(os.path.join(tmp, "initial"), config, matrix_scale=1.0)
        count = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        print(f"model: {count / 1e6:.1f}M parameters, float32 ({count * 4 / 2**20:.0f} MiB)")
        start = time.perf_counter()
        manager = ServerManager(ServerConfig(model_path=os.path.join(tmp, "initial"), base_port=args.port,
                                             max_total_tokens=2048, log_dir=os.path.join(tmp, "logs"))).start()
        print(f"server start-up: {time.perf_counter() - start:.1f} s")
        engine = SGLangEngine(manager, push=PushConfig(checkpoint_dir=os.path.join(tmp, "pushed")))
        print(f"{'push':>5} {'export_s':>9} {'load_s':>8} {'verify_s':>9} {'total_s':>8} "
              f"{'plain_write_s':>14} {'total/plain':>12} {'probe_diff':>11}")
        try:
            for k in range(args.pushes):
                pushed = random_decoder(config, seed=k + 1, matrix_scale=1.0)
                tensors = hf_tensors(pushed)
                start = time.perf_counter()
                save_file(tensors, os.path.join(tmp, f"plain-{k}.safetensors"), metadata={"format": "pt"})
                plain = time.perf_counter() - start
                os.remove(os.path.join(tmp, f"plain-{k}.safetensors"))
                m = engine.update_weights(pushed, f"bench-{k}")
                print(f"{k:>5} {m['push/export_s']:>9.3f} {m['push/load_s']:>8.3f} {m['push/verify_s']:>9.3f} "
                      f"{m['push/total_s']:>8.3f} {plain:>14.3f} {m['push/total_s'] / plain:>12.2f} "
                      f"{m['push/probe_max_abs_diff']:>11.2e}")
        finally:
            engine.close()
            manager.stop()


if __name__ == "__main__":
    main()
