"""The sampler's unrolled Threefry hash draws jax.random's own streams, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.rollout import noise

KEYS = jax.vmap(jax.random.PRNGKey)(jnp.arange(37, dtype=jnp.uint32) * 7919)


@pytest.mark.parametrize("data", [0, 1, 5, 2**31 + 3])
def test_fold_in_equals_jax_random_fold_in(data):
    expected = jax.vmap(jax.random.fold_in, in_axes=(0, None))(KEYS, data)
    np.testing.assert_array_equal(np.asarray(noise.fold_in(KEYS, jnp.uint32(data))), np.asarray(expected))


@pytest.mark.parametrize("width", [1, 2, 7, 512, 1001])
def test_gumbel_equals_jax_random_gumbel_row_by_row(width):
    """Odd and even widths (jax pads an odd counter array), jitted like the sampler runs it."""
    expected = jax.vmap(lambda key: jax.random.gumbel(key, (width,)))(KEYS)
    got = jax.jit(noise.gumbel, static_argnums=1)(KEYS, width)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_threefry_matches_the_known_answer_vector():
    """Random123's known-answer test for Threefry-2x32 with 20 rounds (key and counter all ones)."""
    ones = jnp.uint32(0xFFFFFFFF)
    y1, y2 = noise.threefry2x32(ones, ones, ones, ones)
    assert (int(y1), int(y2)) == (0x1CB996FC, 0xBB002BE7)
