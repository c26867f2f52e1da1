"""Pure-functional RL losses for LLM post-training (SPEC sections 1-5)."""
