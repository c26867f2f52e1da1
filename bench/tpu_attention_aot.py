"""Ahead-of-time compilation of a Qwen3 1B-class train step for a real TPU topology, on this CPU:
``splash`` vs ``chunked`` vs ``xla`` attention, per-chip memory from ``memory_analysis()``.

Proves the TPU program (the Pallas splash kernel inside ``shard_map``, the sharded train step)
lowers and compiles for the chips, and how much memory each attention implementation needs per
chip at T = 8K and 32K. Nothing runs on a TPU: tokens/s needs one. Needs libtpu, which describes
the topology (``pip install libtpu==0.0.42.1``, or ``--target`` a folder and pass it with ``--libtpu``).

    python bench/tpu_attention_aot.py [--topology v5p:2x2x1] [--layers 4] [--libtpu /path/to/site]

A 1B-class width (d=2048, 16 query / 8 key-value heads of 128, MLP 6144, V=151,936, bfloat16 compute,
float32 master weights, chunked LM head) with ``--layers`` of its 28 layers; one row of T tokens
per chip (mesh data = chips). Target (issue: long context): the splash program compiles at 32K.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

GIB = 2.0 ** 30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", default="8192,32768")
    parser.add_argument("--libtpu", default="", help="a folder holding the libtpu package")
    parser.add_argument("--remat", default="full")
    args = parser.parse_args()
    if args.libtpu:
        sys.path.insert(0, args.libtpu)

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.experimental import topologies

    from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh
    from jaxrl.trainer.update import abstract_train_state, build_train_step

    try:
        import libtpu  # noqa: F401  (describes the TPU topology; nothing runs on a TPU)
    except ImportError:
        sys.exit("bench/tpu_attention_aot.py needs libtpu: pip install libtpu==0.0.42.1 (or pip install "
                 "--target DIR libtpu==0.0.42.1 and pass --libtpu DIR)")
    topology = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    chips = len(topology.devices)
    print(f"{args.topology}: {chips} x {topology.devices[0].device_kind}; Qwen3 1B-class width, "
          f"{args.layers} layers; GiB per chip (arguments + temporaries) of one compiled train step, "
          f"one row of T tokens per chip")

    def loss_fn(model, batch):
        logp, entropy, _ = model.token_logprobs(batch["ids"], batch["positions"], batch["segments"], batch["ids"])
        return -jnp.mean(logp), {}

    mesh = make_mesh(MeshConfig(data=chips), topology.devices)
    table = {}
    for length in (int(x) for x in args.lengths.split(",")):
        for impl in ("splash", "chunked", "xla"):
            config = ModelConfig(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_layers=args.layers,
                                 num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=length,
                                 tie_word_embeddings=True, dtype="bfloat16", attention_impl=impl,
                                 attention_block_size=512, remat=args.remat)
            graphdef, params = nnx.split(nnx.eval_shape(lambda c=config: Decoder(c, rngs=nnx.Rngs(0))))
            step = build_train_step(graphdef, params, optax.adamw(1e-5), loss_fn, mesh)
            tokens = jax.ShapeDtypeStruct((chips, length), jnp.int32)
            batch = {"ids": tokens, "positions": tokens, "segments": tokens}
            try:
                memory = step.lower(abstract_train_state(step, params), batch).compile().memory_analysis()
                table[impl, length] = (memory.argument_size_in_bytes + memory.temp_size_in_bytes) / GIB
                cell = f"{table[impl, length]:.2f} GiB (temporaries {memory.temp_size_in_bytes / GIB:.2f})"
            except Exception as error:  # a program that does not fit or lower is a result, reported
                cell = f"failed: {str(error).splitlines()[0][:100]}"
            print(f"T={length:>6} {impl:>8}: {cell}", flush=True)
    longest = max(int(x) for x in args.lengths.split(","))
    ok = ("splash", longest) in table
    print(f"TARGET splash_compiles_at_{longest}: {'compiled' if ok else 'failed'} (goal compiled) "
          f"{'met' if ok else 'missed'}")


if __name__ == "__main__":
    main()
