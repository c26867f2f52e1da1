"""Logical-axis sharding: one rules table, the mesh, sharded model creation, batch shardings.

Model code names axes logically ("batch", "embed", "heads", "expert", ...). `LOGICAL_AXIS_RULES`
is the only place those names meet the mesh axes `data`, `fsdp`, `tensor`, `expert`,
`sequence` (the MaxText scheme): parameters are sharded by their `logical_axes` metadata,
activations by `constrain`. Axes are `AxisType.Auto`, so XLA's partitioner inserts the
collectives (an Explicit mesh rejects sharded contracting dimensions).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert", "sequence")

# logical name -> mesh axes (tuple: sharded over their product, in order; () = replicated).
LOGICAL_AXIS_RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    "act_embed": (),
    "act_heads": ("tensor",),
    "act_mlp": ("tensor",),
    # parameters
    "vocab": ("tensor",),
    # parameters, their gradients and optimizer state also shard over the context-parallel devices (as in MaxText)
    "embed": ("fsdp", "sequence"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "expert_router": (),
    "norm": (),
    # decode cache
    "cache_length": (),
}


def logical_to_spec(logical_axes, shape=None, mesh=None) -> PartitionSpec:
    """PartitionSpec for one array from its logical axis names via LOGICAL_AXIS_RULES.

    A mesh axis is used at most once per array (first dimension wins). With `shape` and `mesh`
    given, mesh axes that do not divide the dimension are dropped (activation hints only;
    parameters are checked strictly by `check_divisible`).
    """
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        if name is not None and name not in LOGICAL_AXIS_RULES:
            raise ValueError(f"logical axis {name!r} has no entry in LOGICAL_AXIS_RULES ({sorted(LOGICAL_AXIS_RULES)})")
        axes, size = [], 1
        for axis in LOGICAL_AXIS_RULES.get(name, ()) if name is not None else ():
            if axis in used:
                continue
            if mesh is not None and axis not in mesh.shape:
                continue
            if shape is not None and mesh is not None and shape[dim] % (size * mesh.shape[axis]):
                continue
            axes.append(axis)
            size *= mesh.shape[axis] if mesh is not None else 1
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*spec)


def target_platform() -> str:
    """The platform the program being traced is built for: the current mesh's devices (TPUs described
    by a topology while this process runs on CPU, for ahead-of-time compilation: ``jaxrl compile``),
    else JAX's default backend. Backend-dependent choices (the "auto" attention kernel, sparse
    ``ragged_dot``) read this, so a compiled TPU program is the one a TPU would run."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def constrain(x: jax.Array, logical_axes) -> jax.Array:
    """Sharding hint for an activation under the current mesh (`jax.set_mesh`); a no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; the mesh uses the first (product of the sizes) devices."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    sequence: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"MeshConfig.{axis} must be a positive integer, got {size!r}")

    @classmethod
    def from_dict(cls, sizes: dict[str, int]) -> "MeshConfig":
        unknown = set(sizes) - set(MESH_AXES)
        if unknown:
            raise ValueError(f"MeshConfig got unknown axes {sorted(unknown)}; known axes are {list(MESH_AXES)}")
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def make_mesh(mesh_config: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """A mesh with axes MESH_AXES (all `AxisType.Auto`) over the first `mesh_config.size` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if mesh_config.size > len(devices):
        raise ValueError(
            f"MeshConfig {dict(zip(MESH_AXES, mesh_config.shape, strict=True))} needs {mesh_config.size} devices "
            f"(the product of the axis sizes) but only {len(devices)} are available")
    grid = np.asarray(devices[:mesh_config.size], dtype=object).reshape(mesh_config.shape)
    return jax.sharding.Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def param_specs(state: nnx.State) -> Any:
    """Tree of PartitionSpecs (no mesh needed) matching `state`, from each Param's logical axes."""
    def spec(var):
        axes = var.get_metadata().get("logical_axes")
        return logical_to_spec(axes) if axes is not None else PartitionSpec()
    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def check_divisible(state: nnx.State, mesh: jax.sharding.Mesh) -> None:
    """ValueError naming the parameter, its logical axis and the sizes when a mesh axis does not
    divide the dimension it shards."""
    def check(path, var):
        axes = var.get_metadata().get("logical_axes") or ()
        spec = logical_to_spec(axes)
        for dim, (name, mesh_axes) in enumerate(zip(axes, spec, strict=True)):
            mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
            shards = math.prod(mesh.shape[a] for a in mesh_axes)
            if var.shape[dim] % shards:
                raise ValueError(
                    f"parameter {_path_name(path)} dimension {dim} ({name!r}, size {var.shape[dim]}) is sharded "
                    f"over mesh axes {mesh_axes} of total size {shards}, which does not divide {var.shape[dim]}; "
                    f"change the mesh sizes or the model dimension")
    jax.tree_util.tree_map_with_path(check, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(state: nnx.State, mesh: jax.sharding.Mesh) -> Any:
    """NamedShardings of every variable in `state` (an nnx.State or its abstract version)."""
    check_divisible(state, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(state),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


# Below this many parameters a random init compiles for a CPU without LLVM's optimisations. The init program
# is compiled once and run once, and its threefry draws take LLVM long to optimise: measured on a 2-core
# machine, the demo's 0.12M-parameter decoder compiled in 2.51 s and ran in 0.003 s fully optimised, and
# 0.79 s and 0.024 s without (most of a CPU run's start); a 187M-parameter one compiled in 4.68 s and ran in
# 1.6 s fully optimised, 2.48 s and 10.2 s without. The unoptimised run costs ~46 ns a parameter more, so the
# saving lasts to ~40M parameters; a tenth of that is the bound.
FAST_COMPILE_INIT_PARAMETERS = 4_000_000
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def init_compiler_options(abstract_state: nnx.State, platform: str) -> dict:
    """XLA options for compiling the random init of ``abstract_state`` on ``platform``: a CPU and
    fewer than ``FAST_COMPILE_INIT_PARAMETERS`` parameters compile without LLVM's optimisations (the
    same draws, about 4% of them 1-2 ulp apart, sooner); otherwise XLA's defaults."""
    parameters = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state))
    return dict(_FAST_COMPILE) if platform == "cpu" and parameters < FAST_COMPILE_INIT_PARAMETERS else {}


def create_sharded_model(build: Callable[[], nnx.Module], mesh: jax.sharding.Mesh):
    """Build `build()` (e.g. `lambda: Decoder(config, rngs=nnx.Rngs(0))`) directly sharded on `mesh`.

    Initialisation runs under jit with `out_shardings`, so no device ever holds the full model
    (compiled with :func:`init_compiler_options`). Returns (model, shardings) where `shardings` is
    the NamedSharding tree of `nnx.state(model)`.
    """
    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh)

    def init():
        return nnx.split(build())[1]

    options = init_compiler_options(abstract_state, mesh.devices.flat[0].platform)
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings, compiler_options=options or None)()
    return nnx.merge(graphdef, state), shardings


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh):
    """Place an existing model's variables on `mesh` by their logical axes. Returns (model, shardings)."""
    graphdef, state = nnx.split(model)
    shardings = state_shardings(state, mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings)), shardings


def spec_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, a mesh axis name or a tuple of them) as a tuple of mesh axis names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _logical_devices(mesh: jax.sharding.Mesh, name: str) -> int:
    """How many ways the rules of logical axis ``name`` split it on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in LOGICAL_AXIS_RULES[name] if axis in mesh.shape)


def batch_devices(mesh: jax.sharding.Mesh) -> int:
    """How many ways the "batch" logical axis splits rows on ``mesh`` (data-parallel width)."""
    return _logical_devices(mesh, "batch")


def sequence_row_length(length: int, mesh: jax.sharding.Mesh, chunks: int = 1) -> int:
    """``length`` rounded up to a multiple of ``chunks`` times the ways the "length" logical axis splits a row
    on ``mesh``, so that context parallelism (docs/models.md#context-parallelism) can split the trainers'
    rows evenly, into ``chunks`` per shard (2 for ring attention); the extra columns are padding, segment id 0."""
    shards = _logical_devices(mesh, "length") * chunks
    return -(-length // shards) * shards


def batch_shardings(batch: Any, mesh: jax.sharding.Mesh) -> Any:
    """Shardings for a batch pytree: dim 0 is "batch", dim 1 "length", further dims replicated."""
    def sharding(x):
        names = ("batch", "length")[: np.ndim(x)] + (None,) * max(np.ndim(x) - 2, 0)
        return NamedSharding(mesh, logical_to_spec(names, np.shape(x), mesh))
    return jax.tree.map(sharding, batch)


def per_device_sequences(fn: Callable, q, k, v, q_segment_ids, kv_segment_ids, *, impl: str):
    """``fn(q, k, v, q_segment_ids, kv_segment_ids)`` run on each device's whole sequences, for an attention
    kernel the compiler cannot partition by itself (``impl``: its ``attention_impl`` name, for errors).

    Under a mesh the call runs inside ``jax.shard_map``: rows split over the "batch" axes and key/value
    heads over "act_heads", q ``[B, T, K, G, D]``, k/v ``[B, T, K, D]``, segment ids ``[B, T]``; the result
    is sharded as q. Without a mesh, or inside a shard_map already (context parallelism, which holds whole
    sequences), ``fn`` runs as it is. A mesh that shards "length" needs context parallelism: ValueError."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.are_all_axes_manual:
        return fn(q, k, v, q_segment_ids, kv_segment_ids)
    batch, length, kv_heads = k.shape[:3]
    spec = logical_to_spec(("batch", "length", "act_heads"), (batch, length, kv_heads), mesh)
    if math.prod(mesh.shape[a] for a in spec_axes(spec[1])) > 1:
        raise ValueError(f"attention_impl = {impl!r} needs whole sequences per device, but the mesh shards "
                         "'length'; set model.context_parallel to 'auto' or 'ulysses'")
    spec = PartitionSpec(spec[0], None, spec[2])
    rows = PartitionSpec(spec[0], None)
    return jax.shard_map(fn, in_specs=(spec, spec, spec, rows, rows), out_specs=spec, check_vma=False)(
        q, k, v, q_segment_ids, kv_segment_ids)
