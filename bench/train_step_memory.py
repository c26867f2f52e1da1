"""Peak compiled memory of a full train step (model forward + backward + optimizer update)
with the chunked LM head vs full [B, T, V] logits, for a large vocabulary (V = 151,936).

Only compiles (inputs are abstract), so nothing of that size is allocated. Peak = arguments +
outputs + temporaries - aliased, from `compiled.memory_analysis()`.

    python bench/train_step_memory.py [--batch 4] [--length 2048] [--dtype bfloat16]
"""

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.losses.entropy import token_entropy_from_logits, token_logprobs_from_logits
from jaxrl.models import Decoder, MeshConfig, ModelConfig, make_mesh
from jaxrl.trainer.update import abstract_train_state, build_train_step


def chunked_loss(model, batch):
    logp, entropy, _ = model.token_logprobs(batch["ids"], batch["positions"], None, batch["targets"],
                                            chunk_size=1024, vocab_chunk_size=32768)
    return -jnp.mean(logp) - 0.01 * jnp.mean(entropy), {}


def full_logits_loss(model, batch):
    logits = model.logits(batch["ids"], batch["positions"])
    logp = token_logprobs_from_logits(logits, batch["targets"])
    return -jnp.mean(logp) - 0.01 * jnp.mean(token_entropy_from_logits(logits)), {}


def peak_bytes(config: ModelConfig, loss_fn, batch_size: int, length: int) -> tuple[int, dict]:
    mesh = make_mesh(MeshConfig())
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    step = build_train_step(graphdef, params, optax.adamw(1e-5), loss_fn, mesh)
    tokens = jax.ShapeDtypeStruct((batch_size, length), jnp.int32)
    batch = {"ids": tokens, "positions": tokens, "targets": tokens}
    memory = step.lower(abstract_train_state(step, params), batch).compile().memory_analysis()
    parts = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
             "temporaries": memory.temp_size_in_bytes, "aliased": memory.alias_size_in_bytes}
    return parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"], parts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    config = ModelConfig(vocab_size=151_936, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=64, dtype=args.dtype, param_dtype="float32")
    gib = 2.0 ** 30
    logits_gib = args.batch * args.length * config.vocab_size * 4 / gib
    print(f"backend {jax.default_backend()}; V={config.vocab_size}, d={config.hidden_size}, "
          f"{config.num_layers} layers, B*T={args.batch}x{args.length}, compute {args.dtype}; "
          f"one float32 [B,T,V] = {logits_gib:.2f} GiB")
    full, full_parts = peak_bytes(config, full_logits_loss, args.batch, args.length)
    chunked, chunked_parts = peak_bytes(config, chunked_loss, args.batch, args.length)
    for name, peak, parts in (("full [B,T,V] logits", full, full_parts), ("chunked head", chunked, chunked_parts)):
        detail = ", ".join(f"{key} {value / gib:.2f}" for key, value in parts.items())
        print(f"peak train-step memory, {name:20s}: {peak / gib:8.2f} GiB ({detail})")
    print(f"chunked / full = {chunked / full:.3f}  (saves {(full - chunked) / gib:.2f} GiB)")


if __name__ == "__main__":
    main()
