"""Rotary position embedding (RoPE) and the `rope_scaling` types that stretch it past the pretrained window.

`RopeScaling` is `ModelConfig.rope_scaling` (None: plain RoPE): typed, frozen, validated, read from and written
to a transformers `config.json` (`rope_parameters` in transformers 5, `rope_scaling` before) so that the
learner, the embedded sampler (the same code) and SGLang (the same config.json) rotate alike. The tables
follow transformers' `modeling_rope_utils` operation by operation in float32 (docs/models.md#rope-scaling):

- `linear` (position interpolation, https://arxiv.org/abs/2306.15595): every frequency divided by `factor`;
- `yarn` (https://arxiv.org/abs/2309.00071): high frequencies kept, low ones interpolated, a linear ramp
  between, and cos/sin scaled by the attention factor `0.1 ln(factor) + 1`;
- `llama3` (Llama 3.1): long wavelengths divided by `factor`, short ones kept, a smooth blend between.

`dynamic` (NTK) is refused: transformers recomputes its base from the longest position of each forward
(and keeps the largest seen), SGLang fixes it once at `factor x max_position_embeddings`, so no fixed
table matches both, and a KV cache would hold keys rotated at shorter lengths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.config import FieldError

F32 = jnp.float32

# rope_type -> (the keys it needs, the keys it may have); a key only other types read is refused.
ROPE_SCALING_KEYS = {
    "linear": (("factor",), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "llama3": (("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"), ()),
}
REFUSED_TYPES = {
    "dynamic": "its frequencies depend on the longest position of each call (transformers recomputes them per "
               "forward, SGLang fixes them at factor x max_position_embeddings), so the learner, a KV cache "
               "and the engine would not agree; use yarn",
    "longrope": "it is not implemented here",
    "default": "plain RoPE is rope_scaling: null",
}
REFUSED_KEYS = {  # transformers keys that SGLang (0.5.23) does not read: the engine would rotate otherwise
    "attention_factor": "SGLang ignores it (it reads attn_factor), so the engine's logprobs would differ from the "
                        "learner's; leave it out to get the default 0.1 ln(factor) + 1",
}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One `rope_scaling` entry, with transformers' key names (None: not given, the reference default applies).

    rope_type: one of `ROPE_SCALING_KEYS`. factor: the stretch (>= 1; 1 leaves RoPE unchanged).
    original_max_position_embeddings: the pretrained window (yarn, llama3). beta_fast [32], beta_slow [1]:
    YaRN's ramp bounds in rotations over that window; mscale, mscale_all_dim: both given, the attention factor
    is (0.1 mscale ln s + 1) / (0.1 mscale_all_dim ln s + 1) (DeepSeek); truncate [true]: round the ramp's
    ends to whole dimensions. low_freq_factor, high_freq_factor: llama3's wavelength bounds
    (original / factor).
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self):
        def bad(key, expected):
            raise FieldError("ModelConfig.rope_scaling", key, getattr(self, key), expected)

        if self.rope_type not in ROPE_SCALING_KEYS:
            why = f" ({self.rope_type} is refused: {REFUSED_TYPES[self.rope_type]})" if (
                self.rope_type in REFUSED_TYPES) else ""
            bad("rope_type", f"one of {list(ROPE_SCALING_KEYS)}{why}")
        needed, optional = ROPE_SCALING_KEYS[self.rope_type]
        keys = needed + optional
        for key in needed:
            if getattr(self, key) is None:
                bad(key, f"given for rope_type {self.rope_type}")
        for field in dataclasses.fields(self):
            if field.name not in keys + ("rope_type",) and getattr(self, field.name) is not None:
                bad(field.name, f"left out: rope_type {self.rope_type} reads only {list(keys)}")
        if not (_number(self.factor) and self.factor >= 1):
            bad("factor", "a number >= 1")
        original = self.original_max_position_embeddings
        if original is not None and (not isinstance(original, int) or isinstance(original, bool) or original < 1):
            bad("original_max_position_embeddings", "a positive integer")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor", "high_freq_factor"):
            if getattr(self, key) is not None and not (_number(getattr(self, key)) and getattr(self, key) > 0):
                bad(key, "a number > 0")
        if self.truncate is not None and not isinstance(self.truncate, bool):
            bad("truncate", "true or false")
        if (self.beta_fast or 32) < (self.beta_slow or 1):
            bad("beta_fast", f">= beta_slow ({self.beta_slow or 1})")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            bad("high_freq_factor", f"> low_freq_factor ({self.low_freq_factor})")

    @classmethod
    def from_hf(cls, rope: dict[str, Any], where: str, max_position_embeddings: int,
                original_max_position_embeddings: int | None = None) -> RopeScaling | None:
        """The scaling of a config.json's `rope_parameters` / `rope_scaling` dict `rope` (named `where` in errors;
        `type` or `rope_type`), None for the default RoPE. As transformers: a missing
        `original_max_position_embeddings` is the config's top-level one, else `max_position_embeddings`; keys
        of other types are ignored; a null value is a key not given."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            return None
        for key, reason in REFUSED_KEYS.items():
            if rope.get(key) is not None:
                raise ValueError(f"config.json {where}.{key} is not supported: {reason}")
        keys = sum(ROPE_SCALING_KEYS.get(rope_type, ()), ())
        fields = {key: rope[key] for key in keys if rope.get(key) is not None}
        if "original_max_position_embeddings" in keys:
            fields["original_max_position_embeddings"] = (original_max_position_embeddings
                                                          or fields.get("original_max_position_embeddings")
                                                          or max_position_embeddings)
        try:
            return cls(rope_type=rope_type, **{"factor": None, **fields})
        except FieldError as e:
            raise ValueError(f"config.json {where}.{e.key}={e.value!r} must be {e.expected}") from None

    def to_hf(self) -> dict[str, Any]:
        """The keys given, as transformers 5 writes them in `rope_parameters` (older ones: `rope_scaling`)."""
        given = {key: getattr(self, key) for key in sum(ROPE_SCALING_KEYS[self.rope_type], ())}
        return {"rope_type": self.rope_type, **{key: value for key, value in given.items() if value is not None}}


def default_inverse_frequencies(dim: int, theta: float) -> jax.Array:
    """RoPE's `inv_freq_i = theta^(-2i/dim)`, i < dim/2 (https://arxiv.org/abs/2104.09864), float32."""
    return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.int32).astype(F32) / dim))


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """YaRN's cos/sin scale `mscale(s) = 0.1 ln(s) + 1` (1 for s <= 1), or with `mscale` and `mscale_all_dim`
    the ratio `mscale(s, mscale) / mscale(s, mscale_all_dim)`, `mscale(s, m) = 0.1 m ln(s) + 1`
    (https://arxiv.org/abs/2309.00071, eq. 22; the ratio is DeepSeek-V2's)."""
    def mscale(m: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale(1.0)


def yarn_correction_range(scaling: RopeScaling, dim: int, theta: float) -> tuple[float, float]:
    """The dimensions (in pairs, i < dim/2) where YaRN's ramp runs: dimension `d(r) = dim ln(L / (2 pi r)) /
    (2 ln theta)` turns r times over the pretrained window L, from r = beta_fast (above: kept) to r = beta_slow
    (below: interpolated); with `truncate` floored/ceiled to whole dimensions, clipped to [0, dim - 1]
    (https://arxiv.org/abs/2309.00071, eq. 17-18)."""
    window = scaling.original_max_position_embeddings

    def dimension(rotations: float) -> float:
        return dim * math.log(window / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast or 32), dimension(scaling.beta_slow or 1)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inverse_frequencies(scaling: RopeScaling, dim: int, theta: float) -> jax.Array:
    """YaRN's "NTK-by-parts" frequencies `inv_freq_i = (1 - g_i) inv_freq_i / s + g_i inv_freq_i`, with
    `g_i = 1 - clip((i - low) / (high - low), 0, 1)` over `yarn_correction_range`
    (https://arxiv.org/abs/2309.00071, eq. 19-20)."""
    low, high = yarn_correction_range(scaling, dim, theta)
    if low == high:
        high += 0.001  # as transformers: no division by zero when the ramp is one dimension wide
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.int32).astype(F32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    kept = 1 - jnp.clip((jnp.arange(dim // 2, dtype=F32) - low) / (high - low), 0, 1)
    return interpolation * (1 - kept) + extrapolation * kept


def llama3_inverse_frequencies(scaling: RopeScaling, dim: int, theta: float) -> jax.Array:
    """Llama 3.1's frequencies: wavelength `w_i = 2 pi / inv_freq_i` above L / low_freq_factor divided by s,
    below L / high_freq_factor kept, between blended by `t = (L / w_i - low_freq_factor) / (high_freq_factor -
    low_freq_factor)` as `(1 - t) inv_freq_i / s + t inv_freq_i` (L: the pretrained window;
    https://arxiv.org/abs/2407.21783)."""
    inv_freq = default_inverse_frequencies(dim, theta)
    window, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelength > window / low, inv_freq / scaling.factor, inv_freq)
    smooth = (window / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelength < window / high) & ~(wavelength > window / low)
    return jnp.where(medium, blended, scaled)


def rope_tables(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[jax.Array, float]:
    """(inverse frequencies [dim/2] float32, the factor cos and sin are multiplied by) of `scaling`."""
    if scaling is None:
        return default_inverse_frequencies(dim, theta), 1.0
    if scaling.rope_type == "linear":
        return default_inverse_frequencies(dim, theta) / scaling.factor, 1.0
    if scaling.rope_type == "yarn":
        return yarn_inverse_frequencies(scaling, dim, theta), yarn_attention_factor(scaling)
    return llama3_inverse_frequencies(scaling, dim, theta), 1.0


def rotary(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None,
           scaling: RopeScaling | None = None) -> jax.Array:
    """Rotate-half RoPE as in transformers' Qwen3 (float32 tables, applied in float32), on the first
    `rotary_dim` features (all by default; Qwen3-Next's partial rotary leaves the rest unchanged), with
    `scaling`'s frequencies and cos/sin factor. The tables depend on the config alone, so the full forward and
    each decode step (any position, any cache row) rotate a position alike.

    x: [B, T, H, Dh]; positions: [B, T] int. Returns float32 [B, T, H, Dh].
    """
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq, attention_factor = rope_tables(dim, theta, scaling)
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    x = x.astype(F32)
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    cos, sin = jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)
