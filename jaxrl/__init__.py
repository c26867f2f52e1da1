"""jaxrl: JAX-native RL post-training for LLMs.

Imports nothing: ``jaxrl.losses`` needs only the base install (jax, numpy); the other packages
need the ``[train]`` extra (docs/install.md).
"""

# The one place the version is written: pyproject.toml reads it (dynamic version), ``jaxrl --version`` prints it.
__version__ = "0.1.0"
