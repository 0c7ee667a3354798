"""RL policy-update data: samples, sources, packing into token-budget rows, balance across ranks."""
