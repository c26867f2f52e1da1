"""Samples as JSON records, for checkpoints: a rollout batch in flight is saved with the run.

:func:`encode_groups` writes samples [prompt][sample] as flat arrays, base64-encoded (exact: the
float32 bits travel as bytes), with their finish reasons, weight versions, per-token versions
(partial rollouts) and routes (MoE); :func:`decode_groups` rebuilds them against the prompts
the restored data iterator draws again.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from jaxrl.rollout.base import LogprobKind, Sample


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def _unb64(text: str, dtype) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype).copy()


def encode_groups(groups: list[list[Sample]]) -> dict[str, Any]:
    """Samples [prompt][sample] as flat arrays (exact: the float32 bits travel as bytes)."""
    flat = [s for group in groups for s in group]
    routed = flat[0].routed_experts is not None
    record = {
        "group_sizes": [len(g) for g in groups], "lengths": [len(s.output_ids) for s in flat],
        "finish_reasons": [s.finish_reason for s in flat], "weight_versions": [s.weight_version for s in flat],
        "logprob_kind": flat[0].logprob_kind.value,
        "output_ids": _b64(np.concatenate([s.output_ids for s in flat]).astype(np.int32)),
        "output_logprobs": _b64(np.concatenate([s.output_logprobs for s in flat]).astype(np.float32)),
        "routes": None,
        "versions": None if flat[0].output_versions is None
        else _b64(np.concatenate([s.output_versions for s in flat]).astype(np.int32)),
    }
    if routed:
        record["routes"] = {
            "shape": list(flat[0].routed_experts.shape[1:]),
            "output": _b64(np.concatenate([s.routed_experts for s in flat]).astype(np.int32)),
            "prompt": _b64(np.concatenate([s.prompt_routed_experts for s in flat]).astype(np.int32)),
        }
    return record


def decode_groups(record: dict[str, Any], examples: list) -> list[list[Sample]]:
    sizes, lengths = record["group_sizes"], np.asarray(record["lengths"])
    if len(sizes) != len(examples):
        raise ValueError(f"a checkpoint's pending rollout batch holds {len(sizes)} prompts but the restored data "
                         f"iterator drew {len(examples)}; resume with the data settings the run was saved with")
    ends = np.cumsum(lengths)
    ids = np.split(_unb64(record["output_ids"], np.int32), ends[:-1])
    logps = np.split(_unb64(record["output_logprobs"], np.float32), ends[:-1])
    routes = record["routes"]
    versions = [None] * len(lengths)
    if record.get("versions") is not None:  # absent in checkpoints written before partial rollouts
        versions = np.split(_unb64(record["versions"], np.int32), ends[:-1])
    prompt_routes = output_routes = [None] * len(lengths)
    if routes is not None:
        shape = tuple(routes["shape"])
        output_routes = np.split(_unb64(routes["output"], np.int32).reshape(-1, *shape), ends[:-1])
        prompt_ends = np.cumsum([len(e.prompt_ids) - 1 for e, n in zip(examples, sizes, strict=True)
                                 for _ in range(n)])
        prompt_routes = np.split(_unb64(routes["prompt"], np.int32).reshape(-1, *shape), prompt_ends[:-1])
    groups, j = [], 0
    for example, n in zip(examples, sizes, strict=True):
        group = []
        for _ in range(n):
            group.append(Sample(
                prompt_ids=np.asarray(example.prompt_ids, np.int32), output_ids=ids[j], output_logprobs=logps[j],
                finish_reason=record["finish_reasons"][j], weight_version=record["weight_versions"][j],
                logprob_kind=LogprobKind(record["logprob_kind"]), routed_experts=output_routes[j],
                prompt_routed_experts=prompt_routes[j], output_versions=versions[j]))
            j += 1
        groups.append(group)
    return groups
