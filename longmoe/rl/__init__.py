"""RL post-training on top of the model: weights for the rollout engine, forward-only log-probs."""
