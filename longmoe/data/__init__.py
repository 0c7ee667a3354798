"""RL policy-update data: checks of single samples, samples, sources, packing into the one batch
type (token-budget rows, or one sample per row: rows.py), balance across ranks."""
