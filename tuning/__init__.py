"""longmoe.tuning: how many chunks chunked EP splits a MoE layer's tokens into.

The runtime (`parallel.chunks: auto`) asks `resolve_chunks`: a measured entry from the tuning
cache (`longmoe tune chunks`, see cache.py for the key) when one matches this machine and layer,
otherwise the formula

    chunks = clamp(local_tokens // 8192, 1, 8)

and it reports which one it used. Why the formula: the all-to-all of a chunk can only hide under
another chunk's expert GEMMs when both are large enough to keep the GPU busy; below ~8K tokens
per chunk (x top-8 = 64K rows) the GEMMs and the collective are latency-bound and extra chunks
only add launches and host work. The seeds saw speedups growing from 4K to 64K local tokens;
8 chunks caps the per-layer overhead.
"""

from __future__ import annotations

TOKENS_PER_CHUNK = 8192
MAX_CHUNKS = 8
FORMULA = f"clamp(local_tokens // {TOKENS_PER_CHUNK}, 1, {MAX_CHUNKS})"


def default_chunks(local_tokens: int) -> int:
    return max(1, min(MAX_CHUNKS, local_tokens // TOKENS_PER_CHUNK))


def cache_key_for(backend, ep: int, hidden: int, top_k: int, dtype: str, local_tokens: int) -> str:
    from longmoe.tuning.cache import interconnect_signature, make_key
    probe = backend.probe()
    return make_key(backend.name, backend.arch, interconnect_signature(probe), ep, hidden, top_k,
                    dtype, local_tokens)


def _tuned_entry(backend, ep: int, hidden: int, top_k: int, dtype: str, local_tokens: int,
                 chunk_by: str) -> tuple[dict | None, str, str]:
    """(the cache entry for this layer if it was measured with `chunk_by` chunks, where it came
    from, a note on an entry skipped for its chunk kind)."""
    if ep <= 1:
        return None, "", ""
    from longmoe.tuning.cache import lookup
    key = cache_key_for(backend, ep, hidden, top_k, dtype, local_tokens)
    entry, path = lookup(key)
    if entry is not None and entry.get("chunk_by", "tokens") == chunk_by:
        predicted = " (predicted by the cost model, not measured)" if entry.get("predicted") else ""
        return entry, f"tuning cache {path} [{key}]{predicted}", ""
    if entry is not None:
        return None, "", (f" (the tuning cache's entry for this layer was measured with "
                          f"{entry.get('chunk_by', 'tokens')} chunks, not {chunk_by})")
    return None, "", ""


def resolve_chunks(setting, backend, ep: int, hidden: int, top_k: int, dtype: str,
                   local_tokens: int, chunk_by: str = "experts") -> tuple[int, str]:
    """(chunks, where the number came from) for a `parallel.chunks` setting (int or "auto").
    A cache entry counts only for the kind of chunk it was measured with (entries without a
    `chunk_by` were measured with token chunks, before expert chunks existed)."""
    if setting != "auto":
        return int(setting), "config"
    entry, source, note = _tuned_entry(backend, ep, hidden, top_k, dtype, local_tokens, chunk_by)
    if entry is not None:
        return min(int(entry["chunks"]), local_tokens), source
    return min(default_chunks(local_tokens), local_tokens), f"formula {FORMULA}{note}"


def resolve_transport(setting: str, backend, device, ep: int, hidden: int, top_k: int,
                      dtype: str, local_tokens: int, chunk_by: str = "experts") -> tuple[str, str]:
    """(transport name or "auto", where it came from) for `parallel.a2a_transport`: "auto" takes
    the transport the tuning cache measured best for this layer when it can run here, else the
    adapter's first available one."""
    if setting != "auto":
        return setting, "config"
    entry, source, _ = _tuned_entry(backend, ep, hidden, top_k, dtype, local_tokens, chunk_by)
    name = (entry or {}).get("transport")
    if name and backend.collective.a2a_unavailable(name, device) is None:
        return name, source
    return "auto", "first available"
