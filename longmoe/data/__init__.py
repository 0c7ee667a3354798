"""RL policy-update data: checks of single samples, samples, sources, packing into token-budget
rows, balance across ranks."""
