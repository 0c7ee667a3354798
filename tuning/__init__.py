"""longmoe.tuning: how many chunks chunked EP splits a MoE layer's tokens into.

The runtime asks `default_chunks`; the tuner (issue F) will write measured caches next to this
file and the runtime will prefer them. Until then the default is a formula:

    chunks = clamp(local_tokens // 8192, 1, 8)

Why: the all-to-all of a chunk can only hide under another chunk's expert GEMMs when both are
large enough to keep the GPU busy; below ~8K tokens per chunk (x top-8 = 64K rows) the GEMMs
and the collective are latency-bound and extra chunks only add launches and host work. The seeds
saw speedups growing from 4K to 64K local tokens; 8 chunks caps the per-layer overhead.
"""

from __future__ import annotations

TOKENS_PER_CHUNK = 8192
MAX_CHUNKS = 8


def default_chunks(local_tokens: int) -> int:
    return max(1, min(MAX_CHUNKS, local_tokens // TOKENS_PER_CHUNK))
