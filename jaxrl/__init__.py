"""jaxrl: JAX-native RL post-training for LLMs."""
