"""The chunked LM head on a data-parallel mesh: each device on its own tokens vs XLA's partitioner.

    python bench/lm_head_sharding.py [--devices 8] [--rows 8] [--length 1024] [--hidden 64] [--repeats 2]

Forward and backward of ``jaxrl.models.lm_head``'s chunked head (logprobs and entropy of every
token, the real Qwen3 vocabulary of 151,936, chunks of 1,024 tokens, tiles of 32,768 columns,
float32) on ``--devices`` CPU devices with the batch split over ``fsdp``, two ways in one run:

- ``partitioner``: ``token_logprobs_and_entropy`` under the mesh, as the decoder called it
  before: the token-chunk loop indexes the sharded token axis, so XLA gathers the whole batch's
  hidden states on every device and each device computes the head for all of it;
- ``sharded``: ``sharded_token_logprobs_and_entropy`` (the decoder's call now): ``shard_map``
  over the batch and length axes, each device on its own tokens, the head split by rows over the
  devices: one vocabulary tile gathered at a time, its gradient reduce-scattered.

Prints per way: the compiled program's collectives and per-device temporaries
(``memory_analysis()``, deterministic), and the median wall time of ``--repeats`` calls (the
ways alternate, so both see the same machine). The CPU devices share this machine's cores, so
the time ratio measures the total work: the partitioner's path does ``--devices`` times the
sharded one's head work. Ends with the TARGET line (goal: at least half the ideal ``--devices``x).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

# the host devices must exist before JAX starts
count = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxrl.models.lm_head import sharded_token_logprobs_and_entropy, token_logprobs_and_entropy  # noqa: E402
from jaxrl.models.sharding import MeshConfig, make_mesh  # noqa: E402

VOCAB = 151_936
MIB = 2.0 ** 20


def gradient(head):
    def loss(hidden, lm_head, targets):
        logp, entropy = head(hidden, lm_head, targets, chunk_size=1024, vocab_chunk_size=32768)
        return jnp.mean(logp) + 0.01 * jnp.mean(entropy)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    mesh = make_mesh(MeshConfig(fsdp=args.devices))
    keys = jax.random.split(jax.random.key(0), 3)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))
    hidden = jax.device_put(jax.random.normal(keys[0], (args.rows, args.length, args.hidden)), rows)
    lm_head = jax.random.normal(keys[1], (args.hidden, VOCAB)) / args.hidden ** 0.5
    targets = jax.device_put(jax.random.randint(keys[2], (args.rows, args.length), 0, VOCAB), rows)
    ways = {"partitioner": token_logprobs_and_entropy, "sharded": sharded_token_logprobs_and_entropy}
    print(f"{args.devices} CPU devices (fsdp), {args.rows} rows x {args.length} tokens, hidden {args.hidden}, "
          f"vocab {VOCAB}, float32; forward + backward of the chunked head")
    compiled, times, results = {}, {name: [] for name in ways}, {}
    with jax.set_mesh(mesh):
        for name, head in ways.items():
            compiled[name] = gradient(head).lower(hidden, lm_head, targets).compile()
        for repeat in range(args.repeats + 1):  # the first call of each is a warm-up
            for name in (ways if repeat % 2 else reversed(list(ways))):
                start = time.perf_counter()
                results[name] = jax.block_until_ready(compiled[name](hidden, lm_head, targets))
                if repeat:
                    times[name].append(time.perf_counter() - start)
    for name in ways:
        text = compiled[name].as_text()
        gathers, reduces, scatters = (len(re.findall(rf"= \S+ {op}(?:-start)?\(", text))
                                      for op in ("all-gather", "all-reduce", "reduce-scatter"))
        temp = compiled[name].memory_analysis().temp_size_in_bytes / MIB
        print(f"{name:>12}: {statistics.median(times[name]):7.2f} s, {gathers} all-gathers, {reduces} all-reduces, "
              f"{scatters} reduce-scatters, {temp:8.1f} MiB temporaries per device")
    difference = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
                     for a, b in zip(results["partitioner"], results["sharded"], strict=True))
    print(f"gradients agree to {difference:.1e} of their scale")
    speedup = statistics.median(times["partitioner"]) / statistics.median(times["sharded"])
    goal = args.devices / 2
    print(f"TARGET lm_head_data_parallel_speedup: {speedup:.2f}x (goal >= {goal:.1f}x on {args.devices} devices) "
          f"{'met' if speedup >= goal else 'missed'}")


if __name__ == "__main__":
    main()
