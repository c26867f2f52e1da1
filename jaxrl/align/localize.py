"""Where do two paths diverge? Module-by-module, layer-by-layer activation diffs (Ring-Linear).

Feed identical tokens to two paths, capture every module's output, and report
the first module whose difference exceeds a tolerance. Paths (each returns
``{name: [B, T, ...] float32 array}`` in model order, names as
``Decoder(capture=True)``: "embed", "layers.{i}.attn", "layers.{i}.mlp",
"layers.{i}.out", "final_norm", plus "logits"):

- ``prefill_activations(model, ids)``: the learner's full forward;
- ``prefill_activations(model, ids, mesh=...)``: the same on another mesh layout
  (parameters resharded by their logical axes);
- ``decode_activations(model, ids, prompt_length)``: the sampler's path: prefill
  of the prompt into the KV cache, then one token per step (teacher-forced);
- ``hf_activations(torch_model, ids)``: a transformers reference model, via
  forward hooks.

``compare_activations(a, b)`` gives a ``Localization``: per-module rows, the
first module over tolerance, a text table, JSON and a per-layer plot.
"""

from __future__ import annotations

import dataclasses
import re
from functools import partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.models.sharding import shard_model

_LAYER = re.compile(r"^layers\.(\d+)\.(\w+)$")
_MODULE_ORDER = ("attn", "mlp", "out")  # within a layer, in the order the block computes them


def model_order(name: str) -> tuple:
    """Sort key putting capture names in forward order: embed, layers 0..L-1, final_norm, logits."""
    match = _LAYER.match(name)
    if match:
        module = match.group(2)
        rank = _MODULE_ORDER.index(module) if module in _MODULE_ORDER else len(_MODULE_ORDER)
        return (1, int(match.group(1)), rank, module)
    return {"embed": (0,), "final_norm": (2,), "logits": (3,)}.get(name, (4, name))


# --------------------------------------------------------------------------- paths
@partial(jax.jit, static_argnums=(0,))
def _prefill(graphdef, state, ids):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    out = model(ids, positions, capture=True)
    return dict(out.activations, logits=model.head(out.hidden))


def _check_ids(token_ids) -> jax.Array:
    ids = np.asarray(token_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty [batch, time] integer array, got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    return jnp.asarray(ids, jnp.int32)


def prefill_activations(model: nnx.Module, token_ids, mesh: jax.sharding.Mesh | None = None) -> dict[str, np.ndarray]:
    """The full forward's module outputs for unpadded ``token_ids`` [B, T].

    With ``mesh``, the parameters are first resharded onto it by their logical axes
    (``jaxrl.models.sharding.shard_model``) and the forward runs under that mesh.
    """
    ids = _check_ids(token_ids)
    if mesh is None:
        graphdef, state = nnx.split(model)
        return jax.tree.map(np.asarray, _prefill(graphdef, state, ids))
    sharded, _ = shard_model(model, mesh)
    graphdef, state = nnx.split(sharded)
    with jax.set_mesh(mesh):
        return jax.tree.map(np.asarray, _prefill(graphdef, state, ids))


@partial(jax.jit, static_argnums=(0,))
def _cached_step(graphdef, state, cache, ids, positions):
    model = nnx.merge(graphdef, state)
    out = model(ids, positions, cache=cache, capture=True)
    return out.cache, dict(out.activations, logits=model.head(out.hidden))


def decode_activations(model: nnx.Module, token_ids, prompt_length: int) -> dict[str, np.ndarray]:
    """The sampler's path, teacher-forced: prefill ``token_ids[:, :prompt_length]`` into a KV
    cache, then feed the remaining tokens one per step; module outputs concatenated over time."""
    ids = _check_ids(token_ids)
    batch, length = ids.shape
    if not 1 <= prompt_length <= length:
        raise ValueError(f"prompt_length={prompt_length} must be in [1, {length}] (the sequence length)")
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, length)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
    cache, first = _cached_step(graphdef, state, cache, ids[:, :prompt_length], positions[:, :prompt_length])
    pieces = [first]
    for t in range(prompt_length, length):
        cache, acts = _cached_step(graphdef, state, cache, ids[:, t:t + 1], positions[:, t:t + 1])
        pieces.append(acts)
    return {name: np.concatenate([np.asarray(p[name]) for p in pieces], axis=1) for name in first}


def hf_activations(torch_model, token_ids) -> dict[str, np.ndarray]:
    """Module outputs of a transformers causal LM (Qwen3 / Qwen3-MoE layout) via forward hooks,
    under jaxrl's names. Runs in the model's own dtype; returned as float32."""
    import torch

    ids = np.array(_check_ids(token_ids))  # a writable copy for torch
    captured: dict[str, Any] = {}

    def hook(name):
        def record(_module, _inputs, output):
            captured[name] = output[0] if isinstance(output, tuple) else output
        return record

    inner = torch_model.model
    modules = [("embed", inner.embed_tokens)]
    for i, layer in enumerate(inner.layers):
        modules += [(f"layers.{i}.attn", layer.self_attn), (f"layers.{i}.mlp", layer.mlp),
                    (f"layers.{i}.out", layer)]
    modules += [("final_norm", inner.norm), ("logits", torch_model.lm_head)]
    handles = [m.register_forward_hook(hook(name)) for name, m in modules]
    try:
        with torch.no_grad():
            torch_model(input_ids=torch.as_tensor(ids, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    return {name: captured[name].float().numpy() for name, _ in modules}


# --------------------------------------------------------------------------- comparison
@dataclasses.dataclass(frozen=True)
class ModuleDiff:
    """One module's difference: max |a - b|, the scale max |a|, their ratio, and the verdict."""

    name: str
    layer: int | None
    module: str
    max_abs_diff: float
    mean_abs_diff: float
    scale: float
    rel_diff: float
    exceeds: bool


@dataclasses.dataclass(frozen=True)
class Localization:
    rows: tuple[ModuleDiff, ...]
    rtol: float
    atol: float
    labels: tuple[str, str]

    @property
    def first_divergence(self) -> ModuleDiff | None:
        """The first module, in model order, whose difference exceeds the tolerance."""
        return next((r for r in self.rows if r.exceeds), None)

    @property
    def first_divergent_layer(self) -> int | None:
        first = self.first_divergence
        return None if first is None else first.layer

    def table(self) -> str:
        a, b = self.labels
        lines = [f"{a} vs {b}: tolerance |a-b| <= {self.atol:g} + {self.rtol:g} * max|a|",
                 f"{'module':22s} {'max|a-b|':>11s} {'mean|a-b|':>11s} {'max|a|':>10s} {'rel':>10s}"]
        for r in self.rows:
            flag = "  <-- over" if r.exceeds else ""
            lines.append(f"{r.name:22s} {r.max_abs_diff:11.3e} {r.mean_abs_diff:11.3e} {r.scale:10.3e} "
                         f"{r.rel_diff:10.3e}{flag}")
        first = self.first_divergence
        lines.append("first divergence: " + ("none (every module within tolerance)" if first is None
                                             else f"{first.name} (layer {first.layer}, {first.module})"))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"labels": list(self.labels), "rtol": self.rtol, "atol": self.atol,
                "first_divergence": None if first is None else first.name,
                "first_divergent_layer": self.first_divergent_layer,
                "modules": [dataclasses.asdict(r) for r in self.rows]}

    def plot(self, path: str) -> str:
        """Relative difference per layer, one line per module kind, with the tolerance."""
        import matplotlib.ticker

        from jaxrl.align.plots import DPI
        from jaxrl.plotting import pyplot, save_figure

        fig, ax = pyplot().subplots(figsize=(6.5, 4))
        kinds: dict[str, list[tuple[int, float]]] = {}
        for r in self.rows:
            if r.layer is not None:
                kinds.setdefault(r.module, []).append((r.layer, r.rel_diff))
        floor = 1e-12  # log axis: exact zeros are drawn at the floor
        for kind, points in kinds.items():
            layers, rel = zip(*points, strict=True)
            ax.plot(layers, np.maximum(rel, floor), "o-", label=kind)
        ax.axhline(self.rtol, color="red", ls="--", lw=1, label=f"rtol {self.rtol:g}")
        first = self.first_divergent_layer
        if first is not None:
            ax.axvline(first, color="red", lw=0.8, alpha=0.5)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set(xlabel="layer", ylabel="max|a-b| / max|a|",
               title=f"{self.labels[0]} vs {self.labels[1]}: first divergence "
                     f"{'none' if first is None else f'layer {first}'}")
        ax.legend(fontsize=8)
        return save_figure(fig, path, dpi=DPI)


def compare_activations(a: Mapping[str, Any], b: Mapping[str, Any], *, rtol: float = 1e-5, atol: float = 0.0,
                        mask=None, labels: tuple[str, str] = ("a", "b")) -> Localization:
    """Per-module differences between two captures of the same inputs, in forward order.

    mask: optional [B, T] bool; only those positions count (e.g. real tokens).
    A module exceeds the tolerance when ``max|a-b| > atol + rtol * max|a|``.
    """
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    missing = [k for k in a if k not in b]
    if missing:
        raise ValueError(f"{labels[1]} lacks modules {missing} that {labels[0]} has; both paths must capture "
                         f"the same names (it has {sorted(b)})")
    rows = []
    for name in sorted(a, key=model_order):
        x = a[name]
        x, y = np.asarray(x, np.float64), np.asarray(b[name], np.float64)
        if x.shape != y.shape:
            raise ValueError(f"module {name}: {labels[0]} has shape {x.shape} but {labels[1]} has {y.shape}")
        if mask is not None:
            keep = np.asarray(mask, bool)
            x, y = x[keep], y[keep]
        diff = np.abs(x - y)
        scale = float(np.max(np.abs(x))) if x.size else 0.0
        max_diff = float(np.max(diff)) if diff.size else 0.0
        match = _LAYER.match(name)
        rows.append(ModuleDiff(
            name=name, layer=int(match.group(1)) if match else None,
            module=match.group(2) if match else name, max_abs_diff=max_diff,
            mean_abs_diff=float(np.mean(diff)) if diff.size else 0.0, scale=scale,
            rel_diff=max_diff / scale if scale > 0 else (0.0 if max_diff == 0 else float("inf")),
            exceeds=bool(max_diff > atol + rtol * scale) or not np.isfinite(max_diff)))
    return Localization(tuple(rows), float(rtol), float(atol), tuple(labels))
