"""Reinforcement-learning policy updates: the objective (objective.py), defined once as
per-token math that the fused LM-head kernel path and the plain reference both consume."""
