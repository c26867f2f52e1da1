"""A Qwen3 1B-class train step compiled ahead of time for described devices (TPU or GPU): the
per-device memory the attention benches compare (bench/tpu_attention_aot.py, bench/gpu_attention_aot.py).

A 1B-class width (d=2048, 16 query / 8 key-value heads of 128, MLP 6144, V=151,936, bfloat16 compute,
float32 master weights, chunked LM head) with ``layers`` of its 28 layers; one row of ``length``
tokens per device (mesh data = devices).
"""

from __future__ import annotations

GIB = 2.0 ** 30


def one_b_config(length: int, layers: int, impl: str, remat: str):
    from jaxrl.models import ModelConfig

    return ModelConfig(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_layers=layers,
                       num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=max(length, 512),
                       tie_word_embeddings=True, dtype="bfloat16", attention_impl=impl,
                       attention_block_size=512, remat=remat)


def train_step_memory(devices, length: int, layers: int, impl: str, remat: str = "full"):
    """``(arguments + temporaries, temporaries)`` bytes per device of one compiled train step, and its
    compiled HLO text; raises what the compiler raises."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxrl.models import Decoder, MeshConfig, make_mesh
    from jaxrl.trainer.update import abstract_train_state, build_train_step

    def loss_fn(model, batch):
        logp, _, _ = model.token_logprobs(batch["ids"], batch["positions"], batch["segments"], batch["ids"])
        return -jnp.mean(logp), {}

    mesh = make_mesh(MeshConfig(data=len(devices)), devices)
    config = one_b_config(length, layers, impl, remat)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    step = build_train_step(graphdef, params, optax.adamw(1e-5), loss_fn, mesh)
    tokens = jax.ShapeDtypeStruct((len(devices), length), jnp.int32)
    compiled = step.lower(abstract_train_state(step, params),
                          {"ids": tokens, "positions": tokens, "segments": tokens}).compile()
    memory = compiled.memory_analysis()
    return memory.argument_size_in_bytes + memory.temp_size_in_bytes, memory.temp_size_in_bytes, compiled.as_text()
