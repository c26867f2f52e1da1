"""Weight push on a two-host layout: the disk push against the in-memory pushes, same step.

    .venv/bin/python bench/cluster_push.py [--layers 8 --hidden 768 --vocab 32000 --pushes 5]

Starts two JAX processes on this machine (2 CPU devices each, one 4-device mesh: ``fsdp=4``, so
every parameter is spread over both processes), each with one real CPU SGLang server of its own,
as ``placement`` lays out a cluster. The learner is a random ~100M-parameter Qwen3 ``Decoder``
(float32). Each round pushes the same new parameters three times, each method first in turn:

- ``disk`` (``PushConfig.method: disk``): every process gathers the parameters (process 0 writes
  the Hugging Face checkpoint into a folder both see, as shared storage would be), then each loads
  it on its own server (``/update_weights_from_disk``);
- ``tensor`` (the default): each process gathers the parameters over the mesh one at a time
  (``jaxrl.models.hf.hf_tensor_stream``; gloo here, NCCL on GPUs), copies them into its shared
  buffers and hands them to its own server (``/update_weights_from_tensor``); no file;
- ``distributed`` (servers started elsewhere, ``rollout.sglang.external``): both servers seen
  as one external fleet; every process takes part in the gathers, and process 0 alone
  broadcasts every tensor to both servers over a gloo process group
  (``/update_weights_from_distributed``); no file.

Each then verifies (version and probe) on the servers its process pushes to. Each round also
times the gather alone (what every push begins with). Prints each push's phases per process, the
bytes each host's server received and seconds per GB per host, the median ratios over the rounds
(the first round warms up and is not counted), and

    TARGET host_push_vs_disk: <ratio>x faster in memory (goal >= 2x) met|missed

Needs scripts/setup_sglang_cpu.sh. Not a timed test: these machines are noisy, so only ratios
measured side by side in one run are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 2.0  # the in-memory push at least this many times faster than the disk push
METHODS = ("disk", "tensor", "distributed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--pushes", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--base-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args)
        return
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as workdir:
        coordinator, base_port = f"127.0.0.1:{_free_port()}", _free_port()
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        argv = [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--hidden", str(args.hidden),
                "--vocab", str(args.vocab), "--pushes", str(args.pushes), "--coordinator", coordinator,
                "--workdir", workdir, "--base-port", str(base_port)]
        workers = [subprocess.Popen([*argv, "--worker", str(i)], env=env, cwd=ROOT) for i in range(2)]
        codes = [w.wait() for w in workers]
        if any(codes):
            sys.exit(f"bench/cluster_push.py: a worker failed (exit codes {codes})")
        with open(os.path.join(workdir, "rounds.json")) as f:
            report(json.load(f), time.perf_counter() - start)


def worker(args) -> None:
    from jaxrl import distributed

    distributed.initialize(distributed.DistributedConfig(coordinator_address=args.coordinator, num_processes=2,
                                                         process_id=args.worker))
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.models import Decoder, MeshConfig, ModelConfig, create_sharded_model, make_mesh, save_hf_checkpoint
    from jaxrl.models.hf import hf_tensor_stream
    from jax.experimental import multihost_utils

    from jaxrl.rollout.sglang import ExternalServers, PushConfig, SGLangEngine, ServerConfig, ServerManager

    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 256, 1),
                         head_dim=64, max_position_embeddings=1024)
    mesh = make_mesh(MeshConfig(fsdp=4))

    def learner(seed):
        model = create_sharded_model(lambda: Decoder(config, rngs=nnx.Rngs(seed)), mesh)[0]
        return jax.block_until_ready(model)  # made before any push is timed

    initial = os.path.join(args.workdir, "initial")
    engine_for = {}
    save_hf_checkpoint(learner(0), initial)  # a collective: process 0 writes
    me = jax.process_index()
    server_of = [ServerConfig(model_path=initial, base_port=args.base_port + p, max_total_tokens=2048,
                              log_dir=os.path.join(args.workdir, f"logs-{p}")) for p in range(2)]
    manager = ServerManager(server_of[me]).start()
    try:
        multihost_utils.sync_global_devices("both servers are up")
        both = ExternalServers([url for server in server_of for url in server.urls], initial)
        engine_for["distributed"] = SGLangEngine(both, push=PushConfig(method="distributed", group_backend="gloo"))
        engine_for["disk"] = SGLangEngine(manager, push=PushConfig(
            method="disk", checkpoint_dir=os.path.join(args.workdir, "pushed"), keep_checkpoints=1))
        engine_for["tensor"] = SGLangEngine(manager, push=PushConfig(method="tensor"))
        rounds = []
        for k in range(args.pushes + 1):
            pushed = learner(k + 1)
            order = [METHODS[(k + j) % len(METHODS)] for j in range(len(METHODS))]
            start = time.perf_counter()
            sum(array.nbytes for _, array in hf_tensor_stream(pushed).arrays)
            row = {"round": k, "gather_s": time.perf_counter() - start}
            for method in order:
                m = engine_for[method].update_weights(pushed, f"round-{k}-{method}")
                row[method] = {key.split("/")[1]: value for key, value in m.items()}
            row["parameters"] = int(sum(x.size for x in jax.tree.leaves(nnx.state(pushed))))
            rounds.append(row)
            if me == 0:
                print(f"round {k}{' (warm-up)' if k == 0 else ''}: " + ", ".join(
                    f"{method} {row[method]['total_s']:.3f} s" for method in order), flush=True)
        gathered = distributed.allgather_ragged([np.frombuffer(json.dumps(rounds).encode(), np.uint8)], np.uint8)
        if me == 0:
            with open(os.path.join(args.workdir, "rounds.json"), "w") as f:
                json.dump([json.loads(g.tobytes()) for g in gathered], f)
        # Process 0 leaves the process group on both servers: neither stops before it has.
        engine_for.pop("distributed").close()
        multihost_utils.sync_global_devices("the process group is left")
    finally:
        for engine in engine_for.values():
            engine.close()
        manager.stop()
    distributed.shutdown()


def report(per_process: list[list[dict]], elapsed_s: float) -> None:
    import numpy as np

    bytes_per_host = per_process[0][-1]["tensor"]["bytes"]
    gb = bytes_per_host / 1e9
    print(f"model: {per_process[0][0]['parameters'] / 1e6:.1f}M parameters, float32; "
          f"{bytes_per_host / 2**30:.3f} GiB handed to each host's server per push (distributed: process 0's "
          f"host sends it to both servers, {len(per_process) * bytes_per_host / 2**30:.3f} GiB)")
    print(f"{'round':>5} {'process':>7} {'method':>11} {'export_s':>9} {'load_s':>8} {'verify_s':>9} {'total_s':>8} "
          f"{'s/GB':>7}")
    for k in range(len(per_process[0])):
        for p, rounds in enumerate(per_process):
            for method in METHODS:
                m = rounds[k][method]
                print(f"{k:>5} {p:>7} {method:>11} {m['export_s']:>9.3f} {m['load_s']:>8.3f} {m['verify_s']:>9.3f} "
                      f"{m['total_s']:>8.3f} {m['total_s'] / gb:>7.2f}")

    def step_s(method: str, k: int) -> float:
        """The push is a collective: the slower process is the step's."""
        return max(r[k][method]["total_s"] for r in per_process)

    timed = range(1, len(per_process[0]))  # the first round warms up (compiles the gathers and the probe)
    gathers = [r[k]["gather_s"] for r in per_process for k in timed]
    print(f"the gather every push begins with (every parameter to every process over the mesh, gloo here): "
          f"median {np.median(gathers):.3f} s ({np.median(gathers) / gb:.2f} s per GB)")
    for method in METHODS:
        totals = [r[k][method]["total_s"] for r in per_process for k in timed]
        print(f"{method}: median {np.median(totals):.3f} s per push per host, {np.median(totals) / gb:.2f} s per GB "
              "per host")
    ratios = {method: [step_s("disk", k) / step_s(method, k) for k in timed] for method in METHODS[1:]}
    for method, per_round in ratios.items():
        print(f"disk / {method} per round: {', '.join(f'{r:.2f}' for r in per_round)}; "
              f"median {np.median(per_round):.2f}")
    ratio = float(np.median(ratios["tensor"]))
    print(f"bench/cluster_push.py: {elapsed_s:.0f} s")  # before the TARGET line, which ends the output
    print(f"TARGET host_push_vs_disk: {ratio:.2f}x faster in memory (goal >= {GOAL:g}x) "
          f"{'met' if ratio >= GOAL else 'missed'}")


if __name__ == "__main__":
    main()
