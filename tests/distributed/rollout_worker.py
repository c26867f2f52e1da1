"""One process of the two-process rollout tests. ``python rollout_worker.py MODE OUT_DIR [ARGS] [distributed flags]``.

- ``ragged``: ``allgather_ragged`` of arrays that depend on the process index
  (process p holds p + 1 arrays, one of them empty, in three dtypes); writes
  what it got to ``OUT_DIR/ragged-<p>.npz``.
- ``hosts``: ``gather_to_hosts`` of the arrays of ``host_arrays`` laid out over the 8 devices of
  both processes in three shardings; writes what it got to ``OUT_DIR/hosts-<p>.npz``.
- ``sglang MODEL_PATH URL0,URL1``: process p drives the running CPU SGLang server
  ``URL<p>`` (serving ``MODEL_PATH``, an MoE model: routes come back, as weight
  version ``p<p>``) as its own fleet, generates
  ``PROMPTS`` through ``SGLangEngine`` (this process's share on its own server,
  the rest gathered), pushes version ``1`` and generates again; writes the
  samples and its own server's scoring of every sample to ``OUT_DIR/sglang-<p>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from jaxrl import distributed

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
SAMPLES_PER_PROMPT = 2
MAX_NEW_TOKENS = 6


def ragged_arrays(process: int) -> dict[str, list[np.ndarray]]:
    """What process ``process`` contributes: ``process + 1`` arrays per dtype, the second one empty."""
    lengths = [3 + process, 0, 2, 5][: process + 1]
    return {
        "int64": [np.arange(n, dtype=np.int64) + 2**40 * (process + 1) for n in lengths],
        "float32": [np.linspace(-1, 1, n, dtype=np.float32) / 3 + process for n in lengths],
        "int32x2x3": [np.arange(n * 6, dtype=np.int32).reshape(n, 2, 3) - 100 * process for n in lengths],
    }


def run_ragged(out_dir: str, process: int) -> None:
    local = ragged_arrays(process)
    gathered = {
        "int64": distributed.allgather_ragged(local["int64"], np.int64),
        "float32": distributed.allgather_ragged(local["float32"], np.float32),
        "int32x2x3": distributed.allgather_ragged(local["int32x2x3"], np.int32, (2, 3)),
    }
    np.savez(os.path.join(out_dir, f"ragged-{process}.npz"),
             **{f"{name}/{k}": a for name, arrays in gathered.items() for k, a in enumerate(arrays)})


def host_arrays() -> dict[str, tuple[np.ndarray, tuple[str, ...], tuple]]:
    """name -> (the full array, mesh axes over the 8 devices, its PartitionSpec)."""
    import ml_dtypes

    return {
        "rows": (np.arange(16 * 6, dtype=np.float32).reshape(16, 6) / 7, ("x",), ("x",)),
        # fsdp over each process's 4 devices, replicated over processes: process 0 sends everything.
        "replicated_rows": (np.arange(8 * 10, dtype=np.int32).reshape(8, 10) - 40, ("data", "fsdp"), ("fsdp",)),
        "grid": ((np.arange(4 * 12, dtype=np.float32).reshape(4, 12) / 3).astype(ml_dtypes.bfloat16),
                 ("data", "fsdp"), ("fsdp", "data")),
    }


def run_hosts(out_dir: str, process: int) -> None:
    import jax

    got = {}
    for name, (full, axes, spec) in host_arrays().items():
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape((8,) if len(axes) == 1 else (2, 4)), axes)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        array = jax.make_array_from_callback(full.shape, sharding, lambda index, full=full: full[index])
        got[name] = distributed.hosts.gather_to_hosts(array)
    np.savez(os.path.join(out_dir, f"hosts-{process}.npz"), **{k: v.view(np.uint8) for k, v in got.items()},
             **{f"{k}/dtype": np.array(str(v.dtype)) for k, v in got.items()},
             **{f"{k}/shape": np.array(v.shape) for k, v in got.items()})


def run_sglang(out_dir: str, process: int, model_path: str, urls: list[str]) -> None:
    from jaxrl.models import load_hf_checkpoint
    from jaxrl.rollout.base import SamplingParams
    from jaxrl.rollout.sglang import ClientConfig, ExternalFleetConfig, ExternalServers, PushConfig, SGLangEngine

    servers = ExternalServers([urls[process]], model_path, ExternalFleetConfig(return_routed_experts=True), api_key="")
    engine = SGLangEngine(servers, push=PushConfig(method="tensor"),  # each process loads its own server in memory
                          client=ClientConfig(max_tries=4, backoff_s=0.2))
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS, seed=3)
        batches = [engine.generate(PROMPTS, params, n=SAMPLES_PER_PROMPT)]
        push = engine.update_weights(load_hf_checkpoint(model_path), "1")  # a push is collective: one version
        batches.append(engine.generate(PROMPTS, params, n=SAMPLES_PER_PROMPT))
        report = {"push_probe_max_abs_diff": push["push/probe_max_abs_diff"], "batches": [[[{
            "prompt_ids": s.prompt_ids.tolist(), "output_ids": s.output_ids.tolist(),
            "output_logprobs": s.output_logprobs.tolist(), "finish_reason": s.finish_reason,
            "weight_version": s.weight_version, "logprob_kind": s.logprob_kind.value,
            "routed_experts": s.routed_experts.tolist(), "prompt_routed_experts": s.prompt_routed_experts.tolist(),
            # this process's own server's teacher-forced logprobs of the sample's output tokens
            "scored_here": engine.score(s.prompt_ids.tolist() + s.output_ids.tolist())[len(s.prompt_ids) - 1:].tolist(),
        } for s in group] for group in batch] for batch in batches]}
        with open(os.path.join(out_dir, f"sglang-{process}.json"), "w") as f:
            json.dump(report, f)
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    mode, out_dir = argv[0], argv[1]
    info, rest = distributed.initialize_from_argv(argv[2:])
    with distributed.stop_all_on_failure():
        if mode == "ragged":
            run_ragged(out_dir, info.process_index)
        elif mode == "hosts":
            run_hosts(out_dir, info.process_index)
        elif mode == "sglang":
            run_sglang(out_dir, info.process_index, rest[0], rest[1].split(","))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
