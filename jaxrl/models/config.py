"""Typed, validated configuration of the decoder family (Qwen3 dense and Qwen3-MoE).

`ModelConfig` holds one attention kind and one MLP kind per layer, so hybrids (MoE every
other layer, linear attention on some layers) are a config change, not a new model.
`from_hf` / `to_hf` translate to and from a transformers `config.json` dictionary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from jaxrl.models.rope import RopeScaling

# Attention kind of each layer (`ModelConfig.layer_types`) and remat policy of each block
# (`ModelConfig.remat`, besides "none"); `jaxrl.models.decoder` maps each name to its module
# class (ATTENTION_KINDS) and checkpoint policy (REMAT_POLICIES).
ATTENTION_KIND_NAMES = ("full_attention", "lightning_attention", "gated_deltanet")
REMAT_POLICY_NAMES = ("full", "save_dots", "save_attention_out")
MLP_KINDS = ("dense", "moe")
# Softmax-attention implementation (`ModelConfig.attention_impl`): "auto" picks one per backend;
# `jaxrl.models.attention.ATTENTION_IMPLS` maps every other name to its function.
ATTENTION_IMPL_NAMES = ("auto", "xla", "chunked", "splash", "cudnn")
# Context parallelism of the full forward (`ModelConfig.context_parallel`): "auto" = Ulysses when the current
# mesh shards "length" (jaxrl.models.context_parallel), "none" = never, "ulysses" = always (error without),
# "ring" = ring attention for the softmax layers (jaxrl.models.ring; error without such a mesh).
CONTEXT_PARALLEL_NAMES = ("auto", "none", "ulysses", "ring")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# transformers `architectures` / `model_type` of the families this package reads and writes.
HF_FAMILIES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "minimax": "MiniMaxForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}

# Per family: our layer kind -> the HF `layer_types` name, and the ModelConfig switches it fixes.
_QWEN3_FLAGS = dict(qk_norm=True, attention_output_gate=False, partial_rotary_factor=1.0, norm_weight_offset=False,
                    shared_expert_gate=False, residual_from_norm=False)
HF_LAYER_TYPES = {
    "qwen3": {"full_attention": "full_attention"},
    "qwen3_moe": {"full_attention": "full_attention"},
    "minimax": {"lightning_attention": "linear_attention", "full_attention": "full_attention"},
    "qwen3_next": {"gated_deltanet": "linear_attention", "full_attention": "full_attention"},
}
HF_FAMILY_FLAGS = {
    "qwen3": _QWEN3_FLAGS,
    "qwen3_moe": _QWEN3_FLAGS,
    "minimax": dict(_QWEN3_FLAGS, qk_norm=False, residual_from_norm=True, norm_topk_prob=True,
                    shared_expert_intermediate_size=0),
    "qwen3_next": dict(qk_norm=True, attention_output_gate=True, norm_weight_offset=True, shared_expert_gate=True,
                       residual_from_norm=False),
}
# MiniMax residual scalings this decoder implements only at their default of 1.
MINIMAX_UNIT_FACTORS = ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor",
                        "linear_attn_beta_factor", "mlp_alpha_factor", "mlp_beta_factor")


def layer_pattern(pattern: str, num_layers: int) -> tuple[str, ...]:
    """`layer_types` from a repeating pattern: "lightning_attention*7,full_attention" over 16 layers is
    7 linear : 1 softmax twice (Ring-Linear / MiniMax-Text-01 hybrids). `kind*n` repeats a kind n times."""
    cycle: list[str] = []
    for item in pattern.replace(" ", "").split(","):
        kind, _, count = item.partition("*")
        if kind not in ATTENTION_KIND_NAMES:
            raise ValueError(f"layer pattern {pattern!r} names unknown layer type {kind!r}; "
                             f"known types: {sorted(ATTENTION_KIND_NAMES)}")
        if count and (not count.isdigit() or int(count) < 1):
            raise ValueError(f"layer pattern {pattern!r}: repeat count {count!r} of {kind!r} "
                             "must be a positive integer")
        cycle += [kind] * int(count or 1)
    return tuple(cycle[i % len(cycle)] for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder: embeddings, `num_layers` blocks (attention + MLP, pre-RMSNorm), final norm, LM head.

    `layer_types[i]` names the attention kind of layer i (one of `ATTENTION_KIND_NAMES`,
    "full_attention" = softmax GQA with RoPE and per-head q/k RMSNorm); `mlp_types[i]` is
    "dense" (SwiGLU, `intermediate_size`) or "moe" (top-`num_experts_per_tok` of `num_experts`
    SwiGLU experts of width `moe_intermediate_size`, plus a shared SwiGLU expert of width
    `shared_expert_intermediate_size` when > 0).
    Empty tuples mean "full_attention" / "dense" on every layer.
    `param_dtype` stores the weights, `dtype` is the matmul compute dtype; norms, the residual
    stream, router, LM head and log-softmax stay float32 (docs/models.md#numerics-and-dtypes).
    `remat` is the activation-rematerialisation policy of each block: "none" or one of
    `REMAT_POLICY_NAMES`. `attention_impl` (one of `ATTENTION_IMPL_NAMES`) is how softmax attention
    runs and `attention_block_size` the query/key block of the chunked form
    (docs/models.md#attention-implementations); `context_parallel` (one of `CONTEXT_PARALLEL_NAMES`) whether
    the full forward's token mixers split the sequence, Ulysses style or with ring attention for the softmax
    layers (docs/models.md#context-parallelism).
    `scan_layers` runs the full forward's blocks as one `lax.scan` (one compiled block body; needs
    every layer of one kind; docs/models.md#scanned-layers).
    Like `dtype` and `remat` they are runtime choices, not HF fields.
    `rope_scaling` (None: plain RoPE; HF's `rope_parameters`) stretches the rotary past the pretrained window:
    yarn, linear or llama3 (`jaxrl.models.rope.RopeScaling`, docs/models.md#rope-scaling; a mapping of its keys
    is accepted).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[str, ...] = ()
    mlp_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    attention_impl: str = "auto"
    attention_block_size: int = 512
    context_parallel: str = "auto"
    # Hybrid linear-attention families (MiniMax-Text-01, Qwen3-Next); defaults give Qwen3.
    qk_norm: bool = True  # per-head q/k RMSNorm in softmax attention (MiniMax: False)
    attention_output_gate: bool = False  # Qwen3-Next: q_proj also yields a per-head sigmoid output gate
    partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim features (Qwen3-Next: 0.25)
    norm_weight_offset: bool = False  # Qwen3-Next RMSNorms scale by (1 + w), w initialised to 0
    shared_expert_gate: bool = False  # Qwen3-Next: shared expert scaled by sigmoid(x @ w_gate)
    residual_from_norm: bool = False  # MiniMax blocks: the residual branch starts after the input norm
    linear_chunk_size: int = 64  # chunk length of the chunked linear-attention form
    linear_num_key_heads: int = 0  # gated DeltaNet key heads / value heads / head dims
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def __post_init__(self):
        # Tuples (not lists) keep the config hashable, so it can be a static jit argument.
        for key, default in (("layer_types", "full_attention"), ("mlp_types", "dense")):
            value = tuple(getattr(self, key)) or (default,) * self.num_layers
            object.__setattr__(self, key, value)
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        self._validate()

    def _validate(self) -> None:
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{key} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"ModelConfig.rms_norm_eps ({self.rms_norm_eps}) and rope_theta "
                             f"({self.rope_theta}) must be positive")
        for key in ("layer_types", "mlp_types"):
            if len(getattr(self, key)) != self.num_layers:
                raise ValueError(f"ModelConfig.{key} has {len(getattr(self, key))} entries, expected "
                                 f"num_layers={self.num_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in ATTENTION_KIND_NAMES:
                raise ValueError(f"ModelConfig.layer_types[{i}] = {kind!r}; "
                                 f"known kinds: {sorted(ATTENTION_KIND_NAMES)}")
        for i, kind in enumerate(self.mlp_types):
            if kind not in MLP_KINDS:
                raise ValueError(f"ModelConfig.mlp_types[{i}] = {kind!r}; known kinds: {list(MLP_KINDS)}")
        if "dense" in self.mlp_types and self.intermediate_size <= 0:
            raise ValueError(f"ModelConfig.intermediate_size must be positive for dense layers, "
                             f"got {self.intermediate_size}")
        if "moe" in self.mlp_types:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ValueError(f"ModelConfig has MoE layers but num_experts={self.num_experts}, "
                                 f"moe_intermediate_size={self.moe_intermediate_size}; both must be positive")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                                 f"[1, num_experts={self.num_experts}]")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(f"ModelConfig.shared_expert_intermediate_size must be >= 0, "
                             f"got {self.shared_expert_intermediate_size}")
        for key in ("param_dtype", "dtype"):
            if getattr(self, key) not in DTYPES:
                raise ValueError(f"ModelConfig.{key} = {getattr(self, key)!r}; choose one of {list(DTYPES)}")
        if not isinstance(self.linear_chunk_size, int) or self.linear_chunk_size < 1:
            raise ValueError("ModelConfig.linear_chunk_size must be a positive integer, "
                             f"got {self.linear_chunk_size!r}")
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor = {self.partial_rotary_factor} must be in (0, 1] "
                             f"and give an even rotary width of head_dim={self.head_dim}")
        if "gated_deltanet" in self.layer_types:
            for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, key) <= 0:
                    raise ValueError(f"ModelConfig.{key} must be positive for gated_deltanet layers, "
                                     f"got {getattr(self, key)}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"ModelConfig.linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                                 f"multiple of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.attention_impl not in ATTENTION_IMPL_NAMES:
            raise ValueError(f"ModelConfig.attention_impl = {self.attention_impl!r}; "
                             f"choose one of {list(ATTENTION_IMPL_NAMES)}")
        if (not isinstance(self.attention_block_size, int) or isinstance(self.attention_block_size, bool)
                or self.attention_block_size < 1):
            raise ValueError("ModelConfig.attention_block_size must be a positive integer, "
                             f"got {self.attention_block_size!r}")
        if self.context_parallel not in CONTEXT_PARALLEL_NAMES:
            raise ValueError(f"ModelConfig.context_parallel = {self.context_parallel!r}; "
                             f"choose one of {list(CONTEXT_PARALLEL_NAMES)}")
        if self.remat != "none" and self.remat not in REMAT_POLICY_NAMES:
            raise ValueError(f"ModelConfig.remat = {self.remat!r}; choose 'none' or one of {list(REMAT_POLICY_NAMES)}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"ModelConfig.scan_layers must be true or false, got {self.scan_layers!r}")
        if self.scan_layers and (len(set(self.layer_types)) > 1 or len(set(self.mlp_types)) > 1):
            raise ValueError("ModelConfig.scan_layers needs every layer of one attention kind and one MLP kind; "
                             f"this model mixes layer_types {sorted(set(self.layer_types))} and mlp_types "
                             f"{sorted(set(self.mlp_types))}: set scan_layers false")
        if self.scan_layers and "lightning_attention" in self.layer_types:
            raise ValueError("ModelConfig.scan_layers cannot scan lightning_attention layers: each layer's decay "
                             "rates depend on its depth, so the blocks differ; set scan_layers false")

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.mlp_types) if kind == "moe")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return DTYPES[self.param_dtype]

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json ---------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
        """Read a transformers Qwen3 / Qwen3-MoE / MiniMax / Qwen3-Next `config.json` dict; `overrides` set our own
        fields (dtype, param_dtype, remat, attention_impl, attention_block_size, context_parallel). Another
        architecture raises a ValueError naming it."""
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or []
        if model_type not in HF_FAMILIES or any(a != HF_FAMILIES[model_type] for a in architectures):
            raise ValueError(
                f"unsupported checkpoint architecture: model_type={model_type!r}, architectures={architectures}; "
                f"this loader reads {sorted(HF_FAMILIES.values())}")
        for key in ("attention_bias", "use_sliding_window"):
            if hf.get(key):
                raise ValueError(f"config.json sets {key}=True, which the Qwen3 decoder here does not implement")
        # transformers 5 writes rope_parameters; older checkpoints rope_scaling, which wins where both are set.
        rope_key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = hf.get(rope_key) or {}
        max_position_embeddings = hf.get("max_position_embeddings", 32768)
        rope_scaling = RopeScaling.from_hf(rope, rope_key, max_position_embeddings,
                                           hf.get("original_max_position_embeddings"))
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
        num_layers = hf["num_hidden_layers"]
        num_heads = hf["num_attention_heads"]
        fields = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0), num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling,
        )
        if model_type in ("qwen3_moe", "qwen3_next"):
            sparse_step = hf.get("decoder_sparse_step", 1)
            dense_layers = set(hf.get("mlp_only_layers") or [])
            num_experts = hf.get("num_experts", hf.get("num_local_experts", 0))
            fields.update(
                mlp_types=tuple("moe" if num_experts > 0 and i not in dense_layers and (i + 1) % sparse_step == 0
                                else "dense" for i in range(num_layers)),
                num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
        if model_type in ("minimax", "qwen3_next"):
            fields.update(HF_FAMILY_FLAGS[model_type], layer_types=cls._layer_types_from_hf(hf, model_type))
        if model_type == "qwen3_next":
            fields.update(
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) if num_experts else 0,
                partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
                **{key: hf[key] for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                            "linear_value_head_dim", "linear_conv_kernel_dim")})
        if model_type == "minimax":
            for key in MINIMAX_UNIT_FACTORS + ("sliding_window",):
                if hf.get(key) not in (None, 1):
                    raise ValueError(f"config.json sets {key}={hf[key]!r}; this decoder implements MiniMax only "
                                     "with residual factors of 1 and no sliding window")
            fields.update(
                mlp_types=("moe",) * num_layers, num_experts=hf["num_local_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["intermediate_size"],
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
                linear_chunk_size=hf.get("block_size", 256))
        fields.update(overrides)
        return cls(**fields)

    @staticmethod
    def _layer_types_from_hf(hf: dict[str, Any], model_type: str) -> tuple[str, ...]:
        names = hf.get("layer_types") or [  # Qwen3-Next configs may give only the interval
            "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(hf["num_hidden_layers"])]
        ours = {hf_name: kind for kind, hf_name in HF_LAYER_TYPES[model_type].items()}
        for i, name in enumerate(names):
            if name not in ours:
                raise ValueError(f"config.json layer_types[{i}] = {name!r}; {model_type} layers are {sorted(ours)}")
        return tuple(ours[name] for name in names)

    @property
    def hf_family(self) -> str:
        """model_type of the transformers family that can express this config."""
        if "lightning_attention" in self.layer_types or self.residual_from_norm:
            return "minimax"
        if "gated_deltanet" in self.layer_types or self.attention_output_gate or self.norm_weight_offset:
            return "qwen3_next"
        return "qwen3_moe" if "moe" in self.mlp_types else "qwen3"

    def to_hf(self) -> dict[str, Any]:
        """A transformers `config.json` dict of `hf_family` (Qwen3, Qwen3-MoE, MiniMax, Qwen3-Next).
        Raises ValueError for what that family cannot express."""
        model_type = self.hf_family
        moe = "moe" in self.mlp_types
        layer_names = HF_LAYER_TYPES[model_type]
        for i, kind in enumerate(self.layer_types):
            if kind not in layer_names:
                raise ValueError(f"ModelConfig.layer_types[{i}] = {kind!r} has no {HF_FAMILIES[model_type]} "
                                 f"equivalent (it has {sorted(layer_names)})")
        for key, value in HF_FAMILY_FLAGS[model_type].items():
            if getattr(self, key) != value and not (
                    key == "shared_expert_gate" and not self.shared_expert_intermediate_size):
                raise ValueError(f"ModelConfig.{key} = {getattr(self, key)!r} has no {HF_FAMILIES[model_type]} "
                                 f"equivalent (it needs {value!r})")
        if model_type in ("qwen3", "qwen3_moe") and self.shared_expert_intermediate_size:
            raise ValueError("ModelConfig.shared_expert_intermediate_size > 0 has no Qwen3-MoE HF equivalent")
        if model_type == "minimax" and "dense" in self.mlp_types:
            raise ValueError("ModelConfig.mlp_types has dense layers, which MiniMaxForCausalLM cannot express")
        hf: dict[str, Any] = {
            "architectures": [HF_FAMILIES[model_type]], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                **(self.rope_scaling.to_hf() if self.rope_scaling else {})},
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False,
            "use_sliding_window": False, "torch_dtype": self.param_dtype, "dtype": self.param_dtype,
        }
        if moe:
            hf.update(
                num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef, decoder_sparse_step=1,
                mlp_only_layers=[i for i, kind in enumerate(self.mlp_types) if kind == "dense"],
            )
        if model_type in ("minimax", "qwen3_next"):
            hf["layer_types"] = [layer_names[kind] for kind in self.layer_types]
        if model_type == "qwen3_next":
            hf["rope_parameters"]["partial_rotary_factor"] = hf["partial_rotary_factor"] = self.partial_rotary_factor
            hf.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                      linear_num_key_heads=self.linear_num_key_heads,
                      linear_num_value_heads=self.linear_num_value_heads,
                      linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
                      linear_conv_kernel_dim=self.linear_conv_kernel_dim)
        if model_type == "minimax":
            for key in ("num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                        "mlp_only_layers", "use_sliding_window", "attention_bias"):  # Qwen3 keys MiniMax lacks
                hf.pop(key, None)
            hf.update({key: 1 for key in MINIMAX_UNIT_FACTORS}, intermediate_size=self.moe_intermediate_size,
                      num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      router_aux_loss_coef=self.router_aux_loss_coef, block_size=self.linear_chunk_size,
                      sliding_window=None)
        return hf
