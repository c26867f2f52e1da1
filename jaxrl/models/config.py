"""Typed, validated configuration of the decoder family (Qwen3 dense and Qwen3-MoE).

`ModelConfig` holds one attention kind and one MLP kind per layer, so hybrids (MoE every
other layer, linear attention on some layers) are a config change, not a new model.
`from_hf` / `to_hf` translate to and from a transformers `config.json` dictionary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

MLP_KINDS = ("dense", "moe")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# transformers `architectures` / `model_type` of the families this package reads and writes.
HF_FAMILIES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder: embeddings, `num_layers` blocks (attention + MLP, pre-RMSNorm), final norm, LM head.

    `layer_types[i]` names the attention kind of layer i (a key of
    `jaxrl.models.decoder.ATTENTION_KINDS`, "full_attention" = softmax GQA with RoPE and
    per-head q/k RMSNorm); `mlp_types[i]` is "dense" (SwiGLU, `intermediate_size`) or "moe"
    (top-`num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`,
    plus a shared SwiGLU expert of width `shared_expert_intermediate_size` when > 0).
    Empty tuples mean "full_attention" / "dense" on every layer.
    `param_dtype` stores the weights, `dtype` is the matmul compute dtype; norms, the residual
    stream, router, LM head and log-softmax stay float32 (SPEC section 5).
    `remat` is the activation-rematerialisation policy of each block: "none" or a key of
    `jaxrl.models.decoder.REMAT_POLICIES`.
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

    def __post_init__(self):
        # Tuples (not lists) keep the config hashable, so it can be a static jit argument.
        for key, default in (("layer_types", "full_attention"), ("mlp_types", "dense")):
            value = tuple(getattr(self, key)) or (default,) * self.num_layers
            object.__setattr__(self, key, value)
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
        from jaxrl.models.decoder import ATTENTION_KINDS, REMAT_POLICIES  # registries live beside the layers
        for i, kind in enumerate(self.layer_types):
            if kind not in ATTENTION_KINDS:
                raise ValueError(f"ModelConfig.layer_types[{i}] = {kind!r}; known kinds: {sorted(ATTENTION_KINDS)}")
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
        if self.remat != "none" and self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat = {self.remat!r}; choose 'none' or one of {list(REMAT_POLICIES)}")

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
        """Read a transformers Qwen3 / Qwen3-MoE `config.json` dict; `overrides` set our own fields
        (dtype, param_dtype, remat). Another architecture raises a ValueError naming it."""
        model_type = hf.get("model_type")
        architectures = hf.get("architectures") or []
        if model_type not in HF_FAMILIES or any(a != HF_FAMILIES[model_type] for a in architectures):
            raise ValueError(
                f"unsupported checkpoint architecture: model_type={model_type!r}, architectures={architectures}; "
                f"this loader reads {sorted(HF_FAMILIES.values())}")
        for key in ("attention_bias", "use_sliding_window"):
            if hf.get(key):
                raise ValueError(f"config.json sets {key}=True, which the Qwen3 decoder here does not implement")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"config.json rope type {rope.get('rope_type', rope.get('type'))!r} is not supported; "
                             "only the default rotary embedding is implemented")
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
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
        )
        if model_type == "qwen3_moe":
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
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """A transformers `config.json` dict (Qwen3ForCausalLM, or Qwen3MoeForCausalLM when any
        layer is MoE). Raises ValueError for what the two HF families cannot express."""
        if any(kind != "full_attention" for kind in self.layer_types):
            raise ValueError(f"ModelConfig.layer_types {self.layer_types} has no Qwen3/Qwen3-MoE HF equivalent")
        moe = "moe" in self.mlp_types
        if self.shared_expert_intermediate_size:
            raise ValueError("ModelConfig.shared_expert_intermediate_size > 0 has no Qwen3-MoE HF equivalent")
        model_type = "qwen3_moe" if moe else "qwen3"
        hf: dict[str, Any] = {
            "architectures": [HF_FAMILIES[model_type]], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
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
        return hf
