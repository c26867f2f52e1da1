"""CPU stand-in for ``sgl_kernel`` (SGLang's compiled kernels); test-only, CPU-only.

SGLang 0.5.23 imports eight ``sgl_kernel`` names at start-up (two KV-cache helpers
and six speculative-decoding kernels) but, with the CPU flags in
docs/sglang-cpu.md, calls none of them. Each is a function here that
raises ``NotImplementedError`` naming itself, so a later SGLang that does call
one fails loudly and says which. Every other name and every submodule stays
missing (``ImportError``/``AttributeError``): SGLang falls back to pure PyTorch
when it cannot import them, and a catch-all stand-in would defeat those fallbacks.
Never put this on ``PYTHONPATH`` on a GPU machine: install the real
``sglang-kernel`` there (``pip install jaxrl[sglang]``).
"""

from __future__ import annotations

IMPORTED_AT_STARTUP = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def _missing_kernel(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is jaxrl's CPU stand-in for sgl_kernel "
            "(scripts/sglang_cpu/sgl_kernel). This SGLang code path needs the compiled kernels: "
            "run it on a GPU with `pip install jaxrl[sglang]`, or turn off the feature that calls it."
        )

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


globals().update({name: _missing_kernel(name) for name in IMPORTED_AT_STARTUP})
