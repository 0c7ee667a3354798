"""Reinforcement-learning policy updates: the objective (objective.py), defined once as per-token
math that the fused LM-head kernel path and the plain reference both consume; weights for the
rollout engine (weights.py); forward-only log-probs (logprobs.py). Kept import-light: ops imports
rl.objective."""
