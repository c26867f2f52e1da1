"""Ahead-of-time compilation of a Qwen3 1B-class train step for a real TPU topology, on this CPU:
``splash`` vs ``chunked`` vs ``xla`` attention, per-chip memory from ``memory_analysis()``.

Proves the TPU program (the Pallas splash kernel inside ``shard_map``, the sharded train step)
lowers and compiles for the chips, and how much memory each attention implementation needs per
chip at T = 8K and 32K. Nothing runs on a TPU: tokens/s needs one. Needs libtpu, which describes
the topology (``pip install libtpu==0.0.42.1``, or ``--target`` a folder and pass it with ``--libtpu``).

    python bench/tpu_attention_aot.py [--topology v5p:2x2x1] [--layers 4] [--libtpu /path/to/site]

The model and step: bench/_aot_steps.py (a 1B-class width with ``--layers`` of its 28 layers, one row
of T tokens per chip). Target (issue: long context): the splash program compiles at 32K.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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

    from jax.experimental import topologies

    from _aot_steps import GIB, train_step_memory

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
    table = {}
    for length in (int(x) for x in args.lengths.split(",")):
        for impl in ("splash", "chunked", "xla"):
            try:
                total, temp, _ = train_step_memory(topology.devices, length, args.layers, impl, args.remat)
                table[impl, length] = total / GIB
                cell = f"{total / GIB:.2f} GiB (temporaries {temp / GIB:.2f})"
            except Exception as error:  # a program that does not fit or lower is a result, reported
                cell = f"failed: {str(error).splitlines()[0][:100]}"
            print(f"T={length:>6} {impl:>8}: {cell}", flush=True)
    longest = max(int(x) for x in args.lengths.split(","))
    ok = ("splash", longest) in table
    print(f"TARGET splash_compiles_at_{longest}: {'compiled' if ok else 'failed'} (goal compiled) "
          f"{'met' if ok else 'missed'}")


if __name__ == "__main__":
    main()
