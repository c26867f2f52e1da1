"""The embedded JAX sampler: jaxrl's default rollout engine, in the learner's process.

``JaxSampler(model)`` implements ``RolloutEngine`` with batched prefill and
decode through the model's KV cache (``Decoder.__call__`` with a
``DecodeCache``), the whole generation one jitted function per static shape:
the batch is padded to a power of two (at most ``max_batch`` rows per call),
prompts are left-padded to a power-of-two length bucket (at least
``min_prompt_bucket``; left, so that linear-attention recurrent states stay
exact), the cache holds prompt bucket + new-token bucket rows (a generation past ``round_tokens``
runs in rounds whose cache holds only the unfinished sequences: ``jaxrl.rollout.rounds``). Left padding also
puts every row's next token at the same cache row, so the cache is written with
one dynamic-update-slice per array (``init_cache(shared_index=True)``), not a
scatter; and the top-k/top-p sort is skipped when both are off. Sampling parameters are traced
arguments, so changing temperature, top-p, top-k, stop ids or the seed never
recompiles.

Weights: the sampler holds the learner's parameter arrays themselves (the
``nnx.State`` of its model); ``update_weights`` swaps in the new state by
reference. JAX arrays are immutable, so when learner and sampler share devices
nothing is copied; the arrays keep their shardings, so generation runs on the
learner's mesh and layout (``mesh`` enables the model's activation sharding
hints, prompts are split over the batch axes).

Logprobs (``SamplingParams.logprob_kind``, module doc of ``jaxrl.rollout.base``):
RAW is ``log_softmax(logits)`` of the decode step's float32 logits; PROCESSED
is the distribution actually sampled: ``logits / T``, then top-k (the ``k``
largest, ties broken toward the lower token id), then top-p on the
renormalised top-k distribution (the smallest prefix of tokens sorted by
probability whose mass reaches ``p``: a token is kept when the mass strictly
before it is ``< p``), renormalised. Temperature 0 is greedy (argmax, lowest
id on ties), whose processed distribution is a point mass (logprob 0).

Randomness: sample ``j`` of prompt ``i`` draws from
``fold_in(fold_in(fold_in(PRNGKey(seed), i), j), step)``, so a sample does not
depend on the batch it was generated in.

Float32 recompute (learner ``token_logprobs`` on the generated sequence vs the
RAW logprobs returned here) is not bit-identical on XLA CPU; the residual is
a few float32 ulps of the logits. Why it cannot be zero with a KV cache:
decode multiplies ``[B, 1, D]`` activations where the recompute multiplies
``[B, T, D]``, and XLA:CPU's matmul kernels (YNNPACK, Eigen) pick their
tiling, and so the order of the float32 sums over ``D``, from the shapes: for
a ``[M, 256] @ [256, 1024]`` product the rows for ``M`` in 2..50 differ from
the same rows computed with ``M = 640`` (``M = 1`` and ``M >= 51`` agree,
measured with jax 0.10.2); attention likewise reduces over the cache length in
decode but over the sequence in the recompute. ``jaxrl align localize --path
decode`` shows the first difference at ``layers.0.attn``, about 2e-7 relative,
staying at that level through the layers; engine-vs-recompute max |dlogp| is
about 1e-6 and k3 about 1e-13 (tests/rollout/test_sampler.py,
docs/alignment.md#embedded-sampler-versus-learner, bench/sampler_throughput.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl import distributed
from jaxrl.errors import needs_extra
from jaxrl.models.sharding import batch_shardings
from jaxrl.rollout.base import Conversation, LogprobKind, RolloutEngine, Sample, SamplingParams
from jaxrl.rollout.decode import decode_loop, forget_unwritten, processed_logits, row_keys, sample_step
from jaxrl.rollout.rounds import DEFAULT_ROUND_TOKENS, decode_rounds, power_of_two, regrown, round_jit, round_schedule
from jaxrl.rollout.turn_cache import Continuation, TurnCache, continue_jit, continued_prompt_routes, keeps_turns

with needs_extra("jaxrl.rollout.sampler"):
    from flax import nnx

# Stop ids travel as a fixed-size array (-1 = unused) so their number never recompiles.
MAX_STOP_IDS = 16


def _generate(graphdef, state, prompt_ids, prompt_lengths, rows, row_keys, temperature, top_k, top_p,
              stop_ids, max_new_tokens, *, new_token_bucket: int, cache_len: int, keep_cache: bool = False):
    """Prefill + decode loop. prompt_ids [U, P] the distinct prompts, left-padded, of
    prompt_lengths [U] tokens; rows [B]: the prompt of each sequence, -1 for padding rows (the
    samples of one prompt share its prefill: its cache rows are copied, not recomputed);
    row_keys [B, 2].

    Left padding keeps recurrent (linear-attention) state exact: padding is zeroed at the input,
    so a zero state stays zero until the first real token, and every row writes its decode
    tokens at the same cache row P + step (positions still count from each row's first token).
    Returns (tokens, raw and processed logprobs [B, N], lengths [B], stopped [B], routed experts
    [B, N, L_moe, k] and the prefill's routed experts [B, P, L_moe, k] (both None for dense
    models)), N = new_token_bucket, and with ``keep_cache`` what ``jaxrl.rollout.turn_cache`` and
    the later rounds of a long generation (``jaxrl.rollout.rounds``) continue from: (the cache after
    the call, rows past each sequence's tokens marked empty; the routes of each sequence's last
    token, or None; the next-token logits [B, V] after it), else None.
    """
    model = nnx.merge(graphdef, state)
    prompt_bucket = prompt_ids.shape[1]
    pad = (prompt_bucket - prompt_lengths)[:, None]
    slots = jnp.arange(prompt_bucket, dtype=jnp.int32)[None, :]
    prompt_segments = (slots >= pad).astype(jnp.int32)
    positions = jnp.maximum(slots - pad, 0)
    init = model.init_cache(prompt_ids.shape[0], cache_len, shared_index=True)
    out = model(prompt_ids, positions, prompt_segments, cache=init)
    per_row = lambda x: jnp.take(x, jnp.maximum(rows, 0), axis=0)  # noqa: E731  (prompt -> sequence)
    logits = per_row(model.head(out.hidden[:, -1:])[:, 0])
    cache = out.cache._replace(layers=jax.tree.map(per_row, out.cache.layers),
                               segment_ids=per_row(out.cache.segment_ids))
    prompt_lengths = jnp.where(rows >= 0, per_row(prompt_lengths), 0)
    prompt_routes = None if out.routed_experts is None else per_row(out.routed_experts)
    d = decode_loop(model, logits, cache, prompt_lengths, prompt_lengths == 0, row_keys, temperature, top_k, top_p,
                    stop_ids, max_new_tokens, None if prompt_routes is None else prompt_routes[:, -1],
                    new_token_bucket=new_token_bucket, feed_last=keep_cache)
    kept = (forget_unwritten(d.cache, prompt_bucket, d.lengths), d.last_routes, d.logits) if keep_cache else None
    return (d.tokens, d.raw, d.processed, d.lengths, d.stopped, d.routes, prompt_routes), kept


# One jit for every sampler instance: samplers of equal models share compiled buckets.
_generate_jit = jax.jit(_generate, static_argnums=(0,), static_argnames=("new_token_bucket", "cache_len", "keep_cache"))


class JaxSampler(RolloutEngine):
    """In-process sampler over a ``jaxrl.models.Decoder`` (see the module doc).

    model: the learner's model (its parameter arrays are used by reference).
    max_cache_len: cache rows per sequence (prompt + new tokens); defaults to the model's
      ``max_position_embeddings``. Longer requests raise ``ValueError`` naming the prompt.
    max_batch: most sequences per jitted call (larger requests are split).
    min_prompt_bucket: smallest prompt-length bucket.
    mesh: the learner's mesh, or None on one device.
    keep_turns: keep the cache between ``continue_conversations`` calls, so that a model turn
      reads only the tokens appended since the last (``jaxrl.rollout.turn_cache``; False reads
      every conversation afresh). ``turn_calls`` counts the calls that continued a kept cache
      ("continued") and those that read afresh ("fresh").
    round_tokens: ``generate`` decodes a generation whose new-token bucket exceeds this many tokens
      in rounds whose cache holds only the unfinished sequences and doubles each round
      (``jaxrl.rollout.rounds``); 0 keeps one dense cache for the whole generation. Shorter
      generations, and ``continue_conversations``, run the one-call program either way.
      ``cache_shapes`` lists (rows, cache rows) of each program the last ``generate`` ran.
    """

    holds_references = True

    def __init__(self, model: nnx.Module, *, max_cache_len: int | None = None, max_batch: int = 64,
                 min_prompt_bucket: int = 16, mesh: jax.sharding.Mesh | None = None,
                 weight_version: str = "0", keep_turns: bool = True, round_tokens: int = DEFAULT_ROUND_TOKENS):
        config = model.config
        self.max_cache_len = int(max_cache_len or config.max_position_embeddings)
        if self.max_cache_len > config.max_position_embeddings:
            raise ValueError(f"max_cache_len={self.max_cache_len} exceeds the model's max_position_embeddings="
                             f"{config.max_position_embeddings}")
        for name, value in (("max_cache_len", self.max_cache_len), ("max_batch", max_batch),
                            ("min_prompt_bucket", min_prompt_bucket)):
            if value < 1:
                raise ValueError(f"JaxSampler {name} must be >= 1, got {value}")
        if round_tokens < 0:
            raise ValueError(f"JaxSampler round_tokens must be >= 0 (0 = no rounds), got {round_tokens}")
        self.round_tokens = round_tokens
        self.cache_shapes: list[tuple[int, int]] = []
        self.vocab_size = config.vocab_size
        self._layer_types = config.layer_types
        self.max_batch = max_batch
        self.min_prompt_bucket = min_prompt_bucket
        self.mesh = mesh
        self._graphdef, self._state = nnx.split(model)
        self._version = str(weight_version)
        self.keep_turns = keep_turns and keeps_turns(config)
        self._turns: TurnCache | None = None
        self.turn_calls = {"continued": 0, "fresh": 0}

    # ------------------------------------------------------------------ weights
    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def state(self) -> nnx.State:
        """The parameter state generation reads (the learner's arrays, not a copy)."""
        return self._state

    def update_weights(self, params, version: str) -> None:
        """Samples from ``params`` from now on: an ``nnx.Module``, its ``nnx.State``, or a train
        state dict holding the state under "params". Kept by reference (no copy), so after a
        train step that donates its state, call this with the new state before generating."""
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        elif isinstance(params, dict) and "params" in params:
            params = params["params"]
        new_struct, old_struct = jax.tree.structure(params), jax.tree.structure(self._state)
        if new_struct != old_struct:
            raise ValueError(f"update_weights: the parameter tree differs from the model's "
                             f"(got {new_struct}, expected {old_struct}); pass the learner model's nnx.State")
        pairs = zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(self._state), strict=True)
        for (path, new), old in pairs:
            if jnp.shape(new) != jnp.shape(old) or jnp.result_type(new) != jnp.result_type(old):
                raise ValueError(f"update_weights: parameter {jax.tree_util.keystr(path)} has shape "
                                 f"{jnp.shape(new)} {jnp.result_type(new)}, expected {jnp.shape(old)} "
                                 f"{jnp.result_type(old)}")
        self._state = params
        self._version = str(version)
        self._turns = None

    # ------------------------------------------------------------------ generation
    def _check_prompts(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[np.ndarray]:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if len(params.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"SamplingParams.stop_token_ids has {len(params.stop_token_ids)} ids; "
                             f"the sampler takes at most {MAX_STOP_IDS}")
        arrays = []
        for i, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"prompt {i}: expected a non-empty 1-D list of token ids, got shape "
                                 f"{ids.shape} dtype {ids.dtype}")
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                raise ValueError(f"prompt {i}: token ids must be in [0, {self.vocab_size}), got "
                                 f"min {ids.min()} max {ids.max()}")
            need = ids.size + params.max_new_tokens
            if need > self.max_cache_len:
                raise ValueError(
                    f"prompt {i} has {ids.size} tokens; with max_new_tokens={params.max_new_tokens} it needs "
                    f"{need} cache rows but the sampler's cache holds {self.max_cache_len} (max_cache_len): "
                    f"shorten the prompt, lower max_new_tokens or raise max_cache_len")
            arrays.append(ids.astype(np.int32))
        return arrays

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> list[list[Sample]]:
        if n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
        self._check_weights()
        arrays = self._check_prompts(prompts, params)
        self.cache_shapes = []
        jobs = [(i, j) for i in range(len(arrays)) for j in range(n)]
        results: list[list[Sample | None]] = [[None] * n for _ in arrays]
        for start in range(0, len(jobs), self.max_batch):
            chunk = jobs[start:start + self.max_batch]
            for (i, j), sample in zip(chunk, self._run([arrays[i] for i, _ in chunk], chunk, params)[0], strict=True):
                results[i][j] = sample
        return results  # type: ignore[return-value]

    def continue_conversations(self, conversations: Sequence[Conversation],
                               params: SamplingParams) -> list[Conversation]:
        """One more model turn for each conversation; with ``keep_turns``, from the cache the
        last call kept when every conversation continues one of its rows (module doc of
        ``jaxrl.rollout.turn_cache``), else by reading the conversations afresh."""
        if not self.keep_turns or len(conversations) > self.max_batch:
            return super().continue_conversations(conversations, params)
        self._check_weights()
        prompts = self._check_prompts([c.token_ids for c in conversations], params)
        plan = None if self._turns is None else self._turns.plan(conversations, self._version)
        samples, kept = (None, None) if plan is None else self._continue(plan, prompts, params)
        self.turn_calls["fresh" if kept is None else "continued"] += 1
        if kept is None:
            samples, kept = self._run(prompts, [(i, 0) for i in range(len(prompts))], params, keep_cache=True)
        self._turns = TurnCache.after(kept, prompts, [s.output_ids for s in samples], self._version)
        return [c.add_model_turn(s) for c, s in zip(conversations, samples, strict=True)]

    def end_conversations(self) -> None:
        """Frees the kept cache (the rollout's conversations have all ended)."""
        self._turns = None

    def _continue(self, plan: Continuation, prompts: list[np.ndarray], params: SamplingParams):
        """(samples, kept cache) of one call that continues the kept cache along ``plan``, or
        (None, None) when the grown cache would not fit ``max_cache_len``."""
        rows, width = power_of_two(len(prompts), 1), power_of_two(max(c.size for c in plan.chunks), 1)
        new_bucket = power_of_two(params.max_new_tokens, 1)
        kept = self._turns.cache
        need = self._turns.index + width + new_bucket
        if need > self.max_cache_len:
            return None, None
        cache_len = max(kept.segment_ids.shape[1], min(power_of_two(need, 1), self.max_cache_len))
        take = np.zeros(rows, np.int32)
        take[:len(prompts)] = plan.take
        chunk_ids = np.zeros((rows, width), np.int32)
        chunk_lengths = np.zeros(rows, np.int32)
        for r, chunk in enumerate(plan.chunks):
            chunk_ids[r, width - chunk.size:] = chunk
            chunk_lengths[r] = chunk.size
        base = np.zeros(rows, np.int32)
        base[:len(prompts)] = plan.base
        job = np.zeros((rows, 2), np.int32)
        job[:len(prompts), 0] = np.arange(len(prompts))
        args = (take, chunk_ids, chunk_lengths, base, row_keys(np.uint32(params.seed), job))
        if self.mesh is not None:
            args = jax.device_put(args, batch_shardings(args, self.mesh))
        outputs, kept = self._call(lambda: continue_jit(
            self._graphdef, self._state, kept, self._turns.last_routes, *args, *self._scalars(params),
            new_token_bucket=new_bucket, cache_len=cache_len))
        tokens, raw, processed, lengths, stopped, routes, chunk_routes, previous = jax.device_get(outputs)
        samples = self._samples(prompts, params, tokens, raw, processed, lengths, stopped)
        if routes is not None:
            for r, (sample, chunk) in enumerate(zip(samples, plan.chunks, strict=True)):
                sample.routed_experts = routes[r, :len(sample.output_ids)].copy()
                sample.prompt_routed_experts = continued_prompt_routes(
                    len(prompts[r]), chunk.size, width, previous[r], chunk_routes[r])
        return samples, kept

    def _check_weights(self) -> None:
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(self._state)):
            # A train step that donates its state deletes the arrays the sampler holds by reference.
            raise RuntimeError(f"the sampler's weights (version {self._version!r}) were deleted, most likely "
                               "donated to the learner's update step; call update_weights(new_state, version) "
                               "with the updated state before generating")

    @staticmethod
    def _scalars(params: SamplingParams) -> tuple:
        """The sampling settings as traced host scalars (numpy, not jnp: no per-call dispatch of
        tiny conversion programs), so changing them never recompiles."""
        stop = np.full(MAX_STOP_IDS, -1, np.int32)
        stop[:len(params.stop_token_ids)] = params.stop_token_ids
        return (np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p), stop,
                np.int32(params.max_new_tokens))

    def _shapes(self, sequences: int, distinct: int, longest: int, max_new_tokens: int) -> tuple[int, ...]:
        """The static shapes of one call: (rows, distinct-prompt rows, prompt bucket, new-token bucket,
        cache rows) for ``sequences`` sequences of ``distinct`` prompts, the longest of ``longest`` tokens."""
        # Decode writes cache rows prompt_bucket .. prompt_bucket + max_new_tokens - 1: shrink the
        # bucket when a power of two would run past the cache (the prompt check keeps it >= longest).
        prompt_bucket = min(power_of_two(longest, self.min_prompt_bucket), self.max_cache_len - max_new_tokens)
        new_bucket = power_of_two(max_new_tokens, 1)
        cache_len = min(prompt_bucket + new_bucket, self.max_cache_len)
        return power_of_two(sequences, 1), power_of_two(distinct, 1), prompt_bucket, new_bucket, cache_len

    def lower(self, sequences: int, distinct: int, longest: int, max_new_tokens: int):
        """``jax.jit(...).lower`` of the prefill + decode program one call runs (the shapes of ``_shapes``)
        over the sampler's weights, real or abstract (ShapeDtypeStructs with shardings): ahead-of-time
        compilation for the mesh's devices (``jaxrl compile``)."""
        rows, prompt_rows, prompt_bucket, new_bucket, cache_len = self._shapes(
            min(sequences, self.max_batch), distinct, longest, max_new_tokens)
        args = (jax.ShapeDtypeStruct((prompt_rows, prompt_bucket), jnp.int32),
                jax.ShapeDtypeStruct((prompt_rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                jax.ShapeDtypeStruct((rows, 2), jnp.uint32))
        if self.mesh is not None:
            args = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                         for x, s in zip(args, batch_shardings(args, self.mesh), strict=True))
        scalars = self._scalars(SamplingParams(max_new_tokens=max_new_tokens))
        return self._call(lambda: _generate_jit.lower(self._graphdef, self._state, *args, *scalars,
                                                      new_token_bucket=new_bucket, cache_len=cache_len))

    def _run(self, prompts: list[np.ndarray], ids: list[tuple[int, int]], params: SamplingParams,
             keep_cache: bool = False) -> tuple[list[Sample], object]:
        """The samples of one jitted call, and with ``keep_cache`` its cache (else None)."""
        # One prefill per distinct prompt (a GRPO group's samples share theirs).
        distinct = {i: None for i, _ in ids}
        rows, prompt_rows, prompt_bucket, new_bucket, _ = self._shapes(
            len(prompts), len(distinct), max(p.size for p in prompts), params.max_new_tokens)
        index = {i: u for u, i in enumerate(distinct)}
        first_row = {i: r for r, (i, _) in reversed(list(enumerate(ids)))}
        prompt_ids = np.zeros((prompt_rows, prompt_bucket), np.int32)
        prompt_lengths = np.zeros(len(prompt_ids), np.int32)
        for i, u in index.items():
            p = prompts[first_row[i]]
            prompt_ids[u, prompt_bucket - p.size:] = p
            prompt_lengths[u] = p.size
        row_prompts = np.full(rows, -1, np.int32)
        row_prompts[:len(ids)] = [index[i] for i, _ in ids]
        job = np.zeros((rows, 2), np.int32)
        job[:len(ids)] = ids
        keys = row_keys(np.uint32(params.seed), job)
        args = (prompt_ids, prompt_lengths, row_prompts, keys)
        if self.mesh is not None:
            args = jax.device_put(args, batch_shardings(args, self.mesh))
        schedule = round_schedule(new_bucket, 0 if keep_cache else self.round_tokens)
        first_rows = schedule[0][1]
        first_len = min(prompt_bucket + first_rows, self.max_cache_len)
        self.cache_shapes.append((rows, first_len))
        outputs, kept = self._call(lambda: _generate_jit(self._graphdef, self._state, *args, *self._scalars(params),
                                                         new_token_bucket=first_rows, cache_len=first_len,
                                                         keep_cache=keep_cache or len(schedule) > 1))
        if len(schedule) > 1:
            start_positions = np.where(row_prompts >= 0, prompt_lengths[np.maximum(row_prompts, 0)], 0)
            generation = self._rounds(outputs[:6], kept, schedule, params, start_positions, np.asarray(keys),
                                      prompt_bucket)
            kept = None  # rounds run only without keep_cache
            tokens, raw, processed, lengths, stopped, routes = generation.outputs()
            prompt_routes = distributed.to_host(outputs[6])
        else:
            # to_host, not device_get: with several processes the outputs span all of them.
            tokens, raw, processed, lengths, stopped, routes, prompt_routes = distributed.to_host(outputs)
        samples = self._samples(prompts, params, tokens, raw, processed, lengths, stopped)
        if routes is not None:
            for r, (sample, p) in enumerate(zip(samples, prompts, strict=True)):
                sample.routed_experts = routes[r, :len(sample.output_ids)].copy()
                # Left padding: the prompt fills the last p.size slots; the last one is routes[r, 0].
                sample.prompt_routed_experts = prompt_routes[r, prompt_bucket - p.size:prompt_bucket - 1].copy()
        return samples, kept

    def _rounds(self, first_round, kept, schedule, params, start_positions, keys, prompt_bucket):
        """The later rounds of a long generation whose round 0 gave ``first_round`` and ``kept``."""
        scalars, layer_types = self._scalars(params), self._layer_types

        def run(kept, take, done, positions, keys, first_step, *, cache_len, **shapes):
            args = (done, positions, keys)
            if self.mesh is not None:
                args = jax.device_put(args, batch_shardings(args, self.mesh))
            cache, last_routes, logits = kept
            cache = self._call(lambda: regrown(cache, take, cache_len, layer_types))
            out = self._call(lambda: round_jit(self._graphdef, self._state, cache, logits, last_routes, take, *args,
                                               first_step, *scalars, **shapes))
            for x in (logits, last_routes):  # read by the round (its rows gathered): freed now, not at the end
                if x is not None:
                    x.delete()
            return out

        return decode_rounds(first_round, kept, schedule, run=run, start_positions=start_positions, keys=keys,
                             max_new_tokens=params.max_new_tokens,
                             cache_rows=lambda new_rows: min(prompt_bucket + new_rows, self.max_cache_len),
                             on_round=lambda rows, cache_len: self.cache_shapes.append((rows, cache_len)))

    def _call(self, fn):
        """``fn()`` under the sampler's mesh, if any."""
        if self.mesh is None:
            return fn()
        with jax.set_mesh(self.mesh):
            return fn()

    def _samples(self, prompts, params, tokens, raw, processed, lengths, stopped) -> list[Sample]:
        """Host outputs [rows, N] -> one Sample per prompt (the first len(prompts) rows)."""
        chosen = raw if params.logprob_kind == LogprobKind.RAW else processed
        return [Sample(prompt_ids=p, output_ids=tokens[r, :int(lengths[r])].copy(),
                       output_logprobs=chosen[r, :int(lengths[r])].copy(),
                       finish_reason="stop" if stopped[r] else "length", weight_version=self._version,
                       logprob_kind=params.logprob_kind)
                for r, p in enumerate(prompts)]


__all__ = ["JaxSampler", "processed_logits", "sample_step"]

