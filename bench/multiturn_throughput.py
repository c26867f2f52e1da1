"""Multi-turn rollout throughput: batching conversations per turn vs one conversation at a time.

32 conversations of up to 4 model turns (up to 16 new tokens each, eos stops some early) on a
small random model through the embedded sampler; after every model turn the environment runs a
real tool call (the calculator) and appends its ``<tool_response>`` observation. Both modes go
through ``jaxrl.env.run_episodes``: once with all 32 conversations (each turn one batched
sampler call over the active conversations, tools run concurrently), once per conversation;
both with the sampler keeping each conversation's KV cache between turns (its default). A third
mode batches without that cache, reading every conversation afresh at each turn. Each mode runs
once untimed (compilation: the same seed gives the same shape buckets every pass), then the
modes are timed in turn ``--repeats`` times and the median pass counts. Model tokens/s =
generated tokens / wall seconds. The target: batched over one at a time.

    PYTHONPATH=. .venv/bin/python bench/multiturn_throughput.py [--conversations 32 --turns 4]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxrl.env import Calculator, Environment, EnvLimits, StepResult, call_tool, ToolCall, run_episodes  # noqa: E402
from jaxrl.models import Decoder, ModelConfig  # noqa: E402
from jaxrl.rollout.base import Conversation, SamplingParams  # noqa: E402
from jaxrl.rollout.sampler import JaxSampler  # noqa: E402

GOAL = 3.0


class CalculatorEnv(Environment):
    """Every model turn is answered with a calculator call's result (digit tokens of the vocabulary),
    so conversations last until the turn or token limit, like a tool-using policy's."""

    def __init__(self, limits: EnvLimits, vocab: int):
        self.limits, self.vocab, self.tool = limits, vocab, Calculator()

    def reset(self, row):
        return Conversation.from_prompt(row["ids"])

    def step(self, conversation, model_turn):
        call = ToolCall("calculator", {"expression": f"{len(model_turn)} * 7"})
        result = call_tool({"calculator": self.tool}, call)
        ids = [2 + int(ch) % (self.vocab - 2) for ch in result.text]
        return StepResult(observation_ids=ids, info={"tool_calls": 1})


def episodes(engine, rows, limits, params, vocab, batched: bool) -> list:
    """One pass over every row: all conversations in one run_episodes, or one run per conversation."""
    if batched:
        return [run_episodes(engine, [CalculatorEnv(limits, vocab) for _ in rows], rows, params)]
    return [run_episodes(engine, [CalculatorEnv(limits, vocab)], [row], params) for row in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7, help="timed passes per mode (the median is reported)")
    args = p.parse_args()
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_layers=args.layers, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4,
                         max_position_embeddings=256)
    model = Decoder(config, rngs=nnx.Rngs(0))
    # The sampler keeps each conversation's KV cache between turns (jaxrl.rollout.turn_cache); the
    # third mode reads every conversation afresh at each turn, to show what that cache is worth.
    engines = {True: JaxSampler(model, max_batch=args.conversations),
               False: JaxSampler(model, max_batch=args.conversations, keep_turns=False)}
    rng = np.random.default_rng(0)
    rows = [{"ids": rng.integers(2, args.vocab, size=int(rng.integers(6, 12))).tolist()}
            for _ in range(args.conversations)]
    limits = EnvLimits(max_turns=args.turns, max_total_tokens=200)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=(1,), seed=0)
    modes = {"batched across conversations": (True, True), "one conversation at a time": (False, True),
             "batched, no cache between turns": (True, False)}

    def run(mode):
        batched, keep = modes[mode]
        return episodes(engines[keep], rows, limits, params, args.vocab, batched)

    for mode in modes:
        run(mode)  # compiles every bucket (same seed, same shapes)
    seconds = {mode: [] for mode in modes}
    for _ in range(args.repeats):  # interleaved, so every mode sees the same machine load
        for mode in modes:
            start = time.perf_counter()
            run(mode)
            seconds[mode].append(time.perf_counter() - start)
    results = {}
    for mode in modes:
        median = float(np.median(seconds[mode]))
        # The same seed every pass: the same conversations, so one more pass counts every pass's tokens.
        batches = run(mode)
        tokens = sum(int(c.model_mask.sum()) for b in batches for c in b.conversations)
        turns = np.mean([c.num_model_turns for b in batches for c in b.conversations])
        results[mode] = tokens / median
        print(f"{mode:32s} {tokens:6d} model tokens in {median:7.3f} s (median of {args.repeats}) = "
              f"{tokens / median:9.1f} tokens/s ({turns:.2f} turns per conversation)")
    kept = results["batched across conversations"] / results["batched, no cache between turns"]
    print(f"the cache kept between turns: {kept:.1f}x the batched tokens/s of reading every turn afresh")
    speedup = results["batched across conversations"] / results["one conversation at a time"]
    verdict = "met" if speedup >= GOAL else "missed"
    print(f"TARGET multiturn_batching_speedup: {speedup:.1f}x (goal {GOAL:g}x) {verdict}")


if __name__ == "__main__":
    main()
