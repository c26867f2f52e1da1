"""Modules marked ``fully_optimised`` (``pytestmark``) compare jaxrl's numerics with transformers' at
float32 rounding: they compile fully optimised, as users' programs are, not with the rest of the
suite's cheaper LLVM pipeline (tests/suite_settings.py), whose different rounding can take a
forward a few 1e-6 further from the reference (measured: Qwen3-Next's logits 5.6e-5 from float64,
against a bound of 5.5e-5). The other model tests compare jaxrl with itself, both sides compiled alike."""

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _fully_optimised(request):
    if request.node.get_closest_marker("fully_optimised") is None:
        yield
        return
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()  # no program compiled the cheaper way is reused (the option is not in jit's cache key)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
