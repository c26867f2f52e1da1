"""Linear-attention kernels: lightning attention and the gated delta rule (docs/models.md#linear-attention).

Both layers keep a per-head matrix state `S [Dk, Dv]` instead of a KV cache, so prefill costs
O(T) and a decode step costs O(1) in the sequence length:

- lightning attention (MiniMax-Text-01, Ring-Linear), per-head exponential decay
  `lambda_h = exp(log_decay_h)`:  `S_t = lambda_h S_{t-1} + k_t^T v_t`,  `o_t = q_t S_t`;
- gated delta rule (Qwen3-Next, Gated DeltaNet), per-token gate `g_t <= 0` and write
  strength `beta_t`:  `S_t = e^{g_t} S_{t-1} + k_t^T (beta_t (v_t - k_t e^{g_t} S_{t-1}))`,
  `o_t = q_t S_t`.

Each comes in two forms that compute the same numbers:

- a chunked parallel form for training and prefill: the sequence is cut into chunks of
  `chunk_size` (T is zero-padded up to a multiple; padded positions have `g = 0`, `k = v = 0`,
  so they leave the state alone); work inside a chunk is a `[C, C]` masked matmul, chunks are
  linked through the state, so the cost is O(T C) rather than O(T^2);
- a recurrent single-step form for decode.

Packed rows: the chunked forms take `reset [B, T]` (True where a token starts a new sequence). A
reset drops the state carried into the token, i.e. its decay is 0 (log-decay -inf):
`S_t = [not reset_t] lambda_t S_{t-1} + ...`, so every segment of a row gets exactly the outputs it
gets alone. Inside a chunk a decay from position j to i is `exp(cum_i - cum_j)` when no reset lies
in (j, i] and 0 otherwise, and the decay from the chunk's start to i is `exp(cum_i)` when no reset
lies in [start, i]; `cum` itself stays finite (an -inf in the cumulative sum would make `cum_i -
cum_j` NaN), the resets enter as a mask on the decays (`_chunk_decays`), and the gated delta rule's
`cum` restarts at each reset (`_segment_cumsum`), so not even a rounding of one segment depends on
another's values. The recurrent step has no reset: decoding holds one sequence per row.

The state is carried in float32 whatever the input dtype (Ring-Linear: a bfloat16 state drifts
from the training side); inputs are upcast to float32 inside, outputs return in the input dtype.
Layout: `[batch, time, heads, dim]` for sequences, `[batch, heads, Dk, Dv]` for the state.
Lightning attention links chunks with an associative scan (its transition is a per-head scalar,
so all chunk states come out in parallel, in log-depth); the delta rule's transition is a matrix
that depends on the chunk, and is scanned sequentially over chunks as in the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STATE_DTYPE = jnp.float32


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunk_size={chunk_size!r}: the chunked linear-attention form needs a positive integer "
            "chunk length (64 is typical); pass chunk_size >= 1."
        )


def check_state(state: jax.Array, expected_shape: tuple[int, ...], name: str = "state",
                layout: str = "[batch, heads, key_dim, value_dim]") -> None:
    """Raise a ValueError naming `name` when a decode state has the wrong shape."""
    if tuple(state.shape) != tuple(expected_shape):
        raise ValueError(
            f"{name} has shape {tuple(state.shape)}, expected {tuple(expected_shape)} ({layout}); pass the "
            "state returned by prefill of the same layer and batch, or None to start from zeros."
        )


def _initial_state(initial_state, batch: int, heads: int, key_dim: int, value_dim: int):
    shape = (batch, heads, key_dim, value_dim)
    if initial_state is None:
        return jnp.zeros(shape, STATE_DTYPE)
    check_state(initial_state, shape, "initial_state")
    return initial_state.astype(STATE_DTYPE)


def _to_chunks(x: jax.Array, chunk_size: int) -> jax.Array:
    """[B, T, H, ...] -> [B, H, N, C, ...] float32, zero-padding T up to N * C."""
    pad = -x.shape[1] % chunk_size
    x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(x.shape[:2] + (-1, chunk_size) + x.shape[3:])


def _from_chunks(x: jax.Array, length: int, dtype) -> jax.Array:
    """[B, H, N, C, D] -> [B, length, H, D] in `dtype`, dropping the padding."""
    x = x.reshape(x.shape[:2] + (-1, x.shape[-1]))[:, :, :length]
    return jnp.moveaxis(x, 1, 2).astype(dtype)


def _chunk_runs(reset: jax.Array | None, chunk_size: int) -> jax.Array | None:
    """`reset [B, T]` bool -> `[B, N, C]` int32: the resets from the chunk's start through position i
    inclusive (chunk padding never resets). Two positions of a chunk are in the same segment iff
    their counts are equal; a position still sees the chunk's incoming state iff its count is 0."""
    if reset is None:
        return None
    reset = jnp.pad(reset.astype(jnp.int32), [(0, 0), (0, -reset.shape[1] % chunk_size)])
    return jnp.cumsum(reset.reshape(reset.shape[0], -1, chunk_size), axis=-1)


def _masked_exp(log_decay: jax.Array, keep: jax.Array | None) -> jax.Array:
    """exp(log_decay) where `keep`, else exactly 0 (log-decay -inf: a reset lies in between)."""
    return jnp.exp(log_decay if keep is None else jnp.where(keep, log_decay, -jnp.inf))


def _segment_cumsum(g: jax.Array, runs: jax.Array | None) -> jax.Array:
    """`g [B, H, N, C]` log-decays -> their sum from the chunk's start through i, restarted at every reset:
    positions before the chunk's first reset keep the plain cumsum (unpacked rows: the same numbers); a
    later segment's sums read its own gates only (masked entries add exact zeros), so no rounding of
    theirs depends on an earlier segment's values."""
    cum = jnp.cumsum(g, axis=-1)
    if runs is None:
        return cum
    runs, size = runs[:, None], g.shape[-1]
    same_run = jnp.tril(jnp.ones((size, size), bool)) & (runs[..., :, None] == runs[..., None, :])
    restarted = jnp.sum(jnp.where(same_run, g[..., None, :], 0.0), axis=-1)
    return jnp.where(runs == 0, cum, restarted)


def _chunk_decays(cum: jax.Array, runs: jax.Array | None = None):
    """Decays inside each chunk from `cum [B, H, N, C]`, the log-decay (<= 0) accumulated from the
    chunk's start through position i inclusive, and `runs [B, N, C]` from `_chunk_runs` (or None).

    Returns `pairwise [B,H,N,C,C]` = exp(cum_i - cum_j) for j <= i with no reset in (j, i], else 0
    (from the difference, never as exp(cum_i) * exp(-cum_j), which overflows for long chunks);
    `to_end [B,H,N,C]` = exp(cum_last - cum_j) with no reset in (j, last], else 0, the decay from j
    to the chunk's end; `from_start [B,H,N,C]` = exp(cum_i) with no reset in [start, i], else 0, the
    decay of the chunk's incoming state to i (its last entry links the chunk to the next).
    """
    size = cum.shape[-1]
    keep = jnp.tril(jnp.ones((size, size), bool))
    keep_end = keep_start = None
    if runs is not None:
        runs = runs[:, None]  # the same segments for every head
        keep = keep & (runs[..., :, None] == runs[..., None, :])
        keep_end, keep_start = runs == runs[..., -1:], runs == 0
    pairwise = _masked_exp(cum[..., :, None] - cum[..., None, :], keep)
    to_end = _masked_exp(cum[..., -1:] - cum, keep_end)
    return pairwise, to_end, _masked_exp(cum, keep_start)


def _check_qkv(q, k, v, reset=None, **gates):
    """q, k, v as documented; reset `[batch, time]` or None; each named gate `[batch, time, heads]`."""
    if q.shape != k.shape or q.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: expected q and k [batch, time, heads, key_dim] "
            "and v [batch, time, heads, value_dim] with the same batch, time and heads."
        )
    for name, gate in gates.items():
        if tuple(gate.shape) != tuple(q.shape[:3]):
            raise ValueError(f"{name} has shape {tuple(gate.shape)}, expected {tuple(q.shape[:3])} "
                             "[batch, time, heads].")
    if reset is not None and tuple(reset.shape) != tuple(q.shape[:2]):
        raise ValueError(f"reset has shape {tuple(reset.shape)}, expected {tuple(q.shape[:2])} [batch, time]: "
                         "True where a token starts a new sequence.")


def lightning_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    log_decay: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    reset: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked lightning attention: `S_t = exp(log_decay) S_{t-1} + k_t^T v_t; o_t = q_t S_t`
    (docs/models.md#linear-attention); with `reset_t`, `S_t = k_t^T v_t` (a new sequence starts).

    Args: q, k `[B, T, H, Dk]`; v `[B, T, H, Dv]`; log_decay `[H]` (<= 0, MiniMax: -slope);
      initial_state `[B, H, Dk, Dv]` or None (zeros); reset `[B, T]` bool or None (no resets).
    Returns: (o `[B, T, H, Dv]` in v's dtype, final state `[B, H, Dk, Dv]` float32).
    """
    _check_chunk_size(chunk_size)
    _check_qkv(q, k, v, reset=reset)
    if tuple(log_decay.shape) != q.shape[2:3]:
        raise ValueError(f"log_decay has shape {tuple(log_decay.shape)}, expected {q.shape[2:3]}: "
                         "one log-decay (<= 0) per head.")
    batch, length, heads, key_dim = q.shape
    state0 = _initial_state(initial_state, batch, heads, key_dim, v.shape[-1])
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q, k, v))
    # Constant decay: cum = log_decay * (positions of the chunk up to i that are not padding).
    chunk_start = np.arange(qc.shape[2])[:, None] * chunk_size
    steps = np.minimum(np.arange(1, chunk_size + 1)[None, :], length - chunk_start).astype(np.float32)  # [N, C]
    cum = jnp.broadcast_to(log_decay.astype(jnp.float32)[:, None, None] * steps, qc.shape[:4])
    pairwise, to_end, from_start = _chunk_decays(cum, _chunk_runs(reset, chunk_size))

    intra = jnp.einsum("bhnij,bhnjv->bhniv", jnp.einsum("bhnik,bhnjk->bhnij", qc, kc) * pairwise, vc)
    chunk_update = jnp.einsum("bhnjk,bhnjv->bhnkv", kc * to_end[..., None], vc)
    chunk_decay = from_start[..., -1]  # [B, H, N]: 0 for a chunk holding a reset

    def combine(earlier, later):
        decay_a, update_a = earlier
        decay_b, update_b = later
        return decay_a * decay_b, decay_b[..., None, None] * update_a + update_b

    decay_through, update_through = jax.lax.associative_scan(combine, (chunk_decay, chunk_update), axis=2)
    end_states = decay_through[..., None, None] * state0[:, :, None] + update_through  # [B, H, N, Dk, Dv]
    start_states = jnp.concatenate([state0[:, :, None], end_states[:, :, :-1]], axis=2)
    inter = jnp.einsum("bhnik,bhnkv->bhniv", qc * from_start[..., None], start_states)
    return _from_chunks(inter + intra, length, v.dtype), end_states[:, :, -1]


def gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    reset: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule: `S_t = e^{g_t} S_{t-1} + k_t^T beta_t (v_t - k_t e^{g_t} S_{t-1}); o_t = q_t S_t`.

    Within a chunk the delta-rule corrections form a unit lower-triangular system
    `(I + tril_{-1}(diag(beta) K K^T * decay)) [U | W] = [diag(beta) V | diag(beta e^cum) K]`
    (the UT transform of DeltaNet); then per chunk `V' = U - W S`, `o = (Q e^cum) S + (Q K^T *
    decay) V'`, `S <- e^{cum_last} S + (K e^{cum_last - cum})^T V'` (the reference's algorithm).
    With `reset_t` (a new sequence starts at t), `e^{g_t} = 0`: every decay across t, pairwise or
    from the chunk's start (`e^cum` above), is 0 (`_chunk_decays`). The system then splits into one
    block per segment and `S_t = k_t^T beta_t v_t`, exactly as for a sequence starting at t.
    No normalisation or scaling of q and k happens here; the layer does it.

    Args: q, k `[B, T, H, Dk]`; v `[B, T, H, Dv]`; g `[B, T, H]` log-decay (<= 0);
      beta `[B, T, H]`; initial_state `[B, H, Dk, Dv]` or None (zeros); reset `[B, T]` bool or None.
    Returns: (o `[B, T, H, Dv]` in v's dtype, final state `[B, H, Dk, Dv]` float32).
    """
    _check_chunk_size(chunk_size)
    _check_qkv(q, k, v, g=g, beta=beta, reset=reset)
    batch, length, heads, key_dim = q.shape
    state0 = _initial_state(initial_state, batch, heads, key_dim, v.shape[-1])
    qc, kc, vc = (_to_chunks(x, chunk_size) for x in (q, k, v))
    betac = _to_chunks(beta, chunk_size)[..., None]
    runs = _chunk_runs(reset, chunk_size)
    cum = _segment_cumsum(_to_chunks(g, chunk_size), runs)
    pairwise, to_end, from_start = _chunk_decays(cum, runs)

    strictly_lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
    system = jnp.where(strictly_lower, jnp.einsum("bhnik,bhnjk->bhnij", kc * betac, kc) * pairwise, 0.0)
    system = system + jnp.eye(chunk_size, dtype=system.dtype)
    rhs = jnp.concatenate([vc * betac, kc * betac * from_start[..., None]], axis=-1)
    solved = jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    new_values, decayed_keys = solved[..., : vc.shape[-1]], solved[..., vc.shape[-1] :]
    intra_attn = jnp.einsum("bhnik,bhnjk->bhnij", qc, kc) * pairwise
    q_decayed = qc * from_start[..., None]
    k_to_end = kc * to_end[..., None]
    chunk_decay = from_start[..., -1]

    def step(state, chunk):
        values, keys_w, attn, q_dec, k_end, decay = chunk
        corrected = values - jnp.einsum("bhik,bhkv->bhiv", keys_w, state)
        out = jnp.einsum("bhik,bhkv->bhiv", q_dec, state) + jnp.einsum("bhij,bhjv->bhiv", attn, corrected)
        state = decay[..., None, None] * state + jnp.einsum("bhjk,bhjv->bhkv", k_end, corrected)
        return state, out

    per_chunk = (new_values, decayed_keys, intra_attn, q_decayed, k_to_end, chunk_decay)
    final_state, out = jax.lax.scan(step, state0, tuple(jnp.moveaxis(x, 2, 0) for x in per_chunk))
    return _from_chunks(jnp.moveaxis(out, 0, 2), length, v.dtype), final_state


def _recurrent_step(q, k, v, g, beta, state):
    """One token of either recurrence; beta None means plain decayed linear attention."""
    batch, heads, key_dim = q.shape
    check_state(state, (batch, heads, key_dim, v.shape[-1]))
    q, k, v, g = (x.astype(jnp.float32) for x in (q, k, v, g))
    state = state.astype(STATE_DTYPE) * jnp.exp(g)[..., None, None]
    if beta is not None:
        v = beta.astype(jnp.float32)[..., None] * (v - jnp.einsum("bhk,bhkv->bhv", k, state))
    state = state + jnp.einsum("bhk,bhv->bhkv", k, v)
    return jnp.einsum("bhk,bhkv->bhv", q, state), state


def lightning_attention_step(q, k, v, log_decay, state):
    """Recurrent lightning attention for one token: `S = exp(log_decay) S + k^T v; o = q S`.

    Args: q, k `[B, H, Dk]`; v `[B, H, Dv]`; log_decay `[H]`; state `[B, H, Dk, Dv]` (float32).
    Returns: (o `[B, H, Dv]` in v's dtype, new state float32).
    """
    out, state = _recurrent_step(q, k, v, jnp.broadcast_to(log_decay, q.shape[:2]), None, state)
    return out.astype(v.dtype), state


def gated_delta_rule_step(q, k, v, g, beta, state):
    """Recurrent gated delta rule for one token: `S = e^g S; S += k^T beta (v - k S); o = q S`.

    Args: q, k `[B, H, Dk]`; v `[B, H, Dv]`; g, beta `[B, H]`; state `[B, H, Dk, Dv]` (float32).
    Returns: (o `[B, H, Dv]` in v's dtype, new state float32).
    """
    out, state = _recurrent_step(q, k, v, g, beta, state)
    return out.astype(v.dtype), state
