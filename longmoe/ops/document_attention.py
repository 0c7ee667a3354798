"""Document-causal attention over packed rows: a token sees only earlier tokens of its own segment
(one sample, or a row's padding), so samples laid end to end in one row never read each other.

A `DocumentSpan` says which keys each query may read. Queries are tokens [q_start, Sk) of every
row, keys tokens [0, Sk): q_start = 0 for a whole row, > 0 for one piece of a context-parallel
split against the keys gathered before it. `segments` gives each key token its segment id; ids
are unique over all rows and never decrease along the flattened rows (a run-length code), which
is what the variable-length kernels take.

Implementations (registry "document_attention"), all [B, Sq, N, D] queries against
[B, Sk, K, D] keys/values (GQA: N a multiple of K), [B, Sq, N, D] out:
  reference  SDPA with a boolean [B, Sq, Sk] mask built from the segment ids; runs everywhere,
             memory grows as Sq*Sk (fine for tests and short rows).
  flex       FlexAttention with a document block mask, compiled: blocks outside every segment are
             skipped, nothing Sq*Sk is materialised. GPUs only (torch has no FlexAttention
             backward on CPU).
  varlen     torch.nn.attention.varlen.varlen_attn (flash kernels over cu_seqlens): every segment
             is its own causal sequence; fp16/bf16 on GPUs.
Legend: B rows, Sq query tokens, Sk key tokens per row, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import inspect
from functools import cached_property

import torch
import torch.nn.functional as F

from longmoe.ops.compiled import compile_unavailable, compiled
from longmoe.ops.registry import Registry, trial_call

DOCUMENT_ATTENTION = Registry("document_attention")


class VarlenLayout:
    """The flattened layout varlen kernels take: per query segment its run of queries (cu_q) and
    of keys (cu_k) and the longest of each; `key_index` picks the keys those runs cover, in
    order, from the flattened [B * Sk] keys (None: all of them)."""

    def __init__(self, cu_q, cu_k, max_q: int, max_k: int, key_index):
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k
        self.key_index = key_index


class DocumentSpan:
    """Queries [q_start, Sk) of each row against keys [0, Sk); query token i reads key token j
    when both lie in one segment and j <= i. Derived views are built once, on first use, and
    shared by every layer that attends over this span."""

    def __init__(self, segments_BK: torch.Tensor, q_start: int = 0):
        if segments_BK.dim() != 2:
            raise ValueError(f"segments must be [rows, keys], got shape {tuple(segments_BK.shape)}")
        if not 0 <= q_start < segments_BK.shape[1]:
            raise ValueError(f"q_start {q_start} outside the {segments_BK.shape[1]} keys")
        self.segments = segments_BK
        self.q_start = int(q_start)
        self._flex: dict[str, object] = {}

    @classmethod
    def causal(cls, rows: int, keys: int, q_start: int = 0, device=None) -> "DocumentSpan":
        """One segment per row: plain causal attention (bottom-right aligned when q_start > 0)."""
        seg = torch.arange(rows, device=device)[:, None].expand(rows, keys)
        return cls(seg, q_start)

    @property
    def rows(self) -> int:
        return self.segments.shape[0]

    @property
    def keys(self) -> int:
        return self.segments.shape[1]

    @property
    def queries(self) -> int:
        return self.keys - self.q_start

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, Sq, Sk] bool: may query i read key j."""
        seg_q = self.segments[:, self.q_start:]
        q_pos = torch.arange(self.q_start, self.keys, device=self.segments.device)
        k_pos = torch.arange(self.keys, device=self.segments.device)
        return (seg_q[:, :, None] == self.segments[:, None, :]) & (k_pos[None, :] <= q_pos[:, None])

    @cached_property
    def varlen(self) -> VarlenLayout:
        """The varlen layout; one host sync (the run lengths) per span."""
        seg_q = self.segments[:, self.q_start:].reshape(-1)
        ids, q_counts = torch.unique_consecutive(seg_q, return_counts=True)
        flat_k = self.segments.reshape(-1)
        k_counts = torch.bincount(flat_k - flat_k.min(), minlength=1)[ids - flat_k.min()]
        zero = q_counts.new_zeros(1)
        cu_q = torch.cat([zero, q_counts.cumsum(0)]).to(torch.int32)
        cu_k = torch.cat([zero, k_counts.cumsum(0)]).to(torch.int32)
        max_q, max_k = (int(x) for x in torch.stack([q_counts.max(), k_counts.max()]).tolist())
        # A query segment's keys are its whole segment up to the row's last query: contiguous in
        # the flattened keys, and in segment order, so selecting them keeps the cu_k layout.
        key_index = None if self.q_start == 0 else torch.isin(flat_k, ids).nonzero()[:, 0]
        return VarlenLayout(cu_q, cu_k, max_q, max_k, key_index)

    def block_mask(self, device: torch.device):
        """FlexAttention's block mask for this span on `device` (cached per device)."""
        key = str(device)
        if key not in self._flex:
            from torch.nn.attention.flex_attention import create_block_mask
            seg, q0 = self.segments.to(device), self.q_start

            def document_causal(b, h, q_idx, kv_idx):
                return (seg[b, q_idx + q0] == seg[b, kv_idx]) & (kv_idx <= q_idx + q0)

            # Compiled on GPUs: uncompiled, the mask is evaluated densely (Sq*Sk booleans).
            self._flex[key] = create_block_mask(document_causal, self.rows, None, self.queries,
                                                self.keys, device=device,
                                                _compile=device.type != "cpu")
        return self._flex[key]


def _shapes(q, k, v, span: DocumentSpan) -> str | None:
    B, Sq, N, _ = q.shape
    if k.shape[:2] != (span.rows, span.keys) or v.shape[:2] != k.shape[:2]:
        return f"keys/values {tuple(k.shape)} do not match the span's {span.rows}x{span.keys} keys"
    if (B, Sq) != (span.rows, span.queries):
        return f"queries {tuple(q.shape)} do not match the span's {span.rows}x{span.queries}"
    if N % k.shape[2]:
        return f"query heads {N} are not a multiple of kv heads {k.shape[2]}"
    return None


@DOCUMENT_ATTENTION.register("reference", priority=0, reference=True, check=_shapes)
def _reference(q, k, v, span: DocumentSpan):
    """Masked SDPA (under whatever SDPA backend order the caller has entered)."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=span.mask[:, None].to(q.device),
                                       enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def flex_document_attention(q, k, v, span: DocumentSpan, compile: bool = True):
    """FlexAttention with the span's block mask; `compile=False` runs torch's unfused eager form
    (forward only on CPU: tests)."""
    from torch.nn.attention.flex_attention import flex_attention
    fn = compiled(flex_attention) if compile else flex_attention
    o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
           block_mask=span.block_mask(q.device), enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _flex_check(q, k, v, span):
    if q.device.type == "cpu":
        return "torch's FlexAttention has no backward on CPU"
    why = compile_unavailable(q.device)
    if why:
        return why
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"this torch has no FlexAttention ({type(e).__name__})"
    return _shapes(q, k, v, span)


@DOCUMENT_ATTENTION.register("flex", priority=5, check=_flex_check)
def _flex(q, k, v, span: DocumentSpan):
    return flex_document_attention(q, k, v, span)


def _varlen_fn():
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn, inspect.signature(varlen_attn).parameters


def varlen_document_attention(q, k, v, span: DocumentSpan):
    """varlen_attn over the span's layout. torch's API moved between releases: the causal flag
    is `window_size=(-1, 0)` where that parameter exists, else `is_causal=True`; where there is
    no `enable_gqa`, the kv heads are repeated for the query heads (same result, more memory)."""
    fn, params = _varlen_fn()
    B, Sq, N, D = q.shape
    Kh = k.shape[2]
    lay = span.varlen
    q_f = q.reshape(B * Sq, N, D)
    k_f, v_f = k.reshape(-1, Kh, D), v.reshape(-1, Kh, v.shape[-1])
    if lay.key_index is not None:
        idx = lay.key_index.to(q.device)
        k_f, v_f = k_f.index_select(0, idx), v_f.index_select(0, idx)
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if N != Kh:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k_f, v_f = (t.repeat_interleave(N // Kh, dim=1) for t in (k_f, v_f))
    o = fn(q_f, k_f, v_f, lay.cu_q.to(q.device), lay.cu_k.to(q.device), lay.max_q, lay.max_k, **kw)
    return o.view(B, Sq, N, -1)


_VARLEN_TRIAL: dict[tuple, str | None] = {}


def _varlen_trial(device, dtype, head_dim: int) -> str | None:
    """One small call per (device, dtype, head dim) against the reference: a GPU or torch build
    whose flash kernels refuse the call, or align the causal mask of a piece whose queries are
    fewer than its keys other than bottom-right (context parallelism relies on that), falls back
    through "auto" instead of training on a wrong mask."""
    key = (str(device), dtype, head_dim)
    if key not in _VARLEN_TRIAL:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            seg = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16, [3] * 20 + [4] * 12], device=device)
            span = DocumentSpan(seg, q_start=12)
            q, k, v = (torch.randn(2, s, h, head_dim, generator=gen, device=device)
                       for s, h in ((20, 4), (32, 2), (32, 2)))
            with trial_call():
                leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
                got = varlen_document_attention(*leaves, span)
                got.float().sum().backward()
            # Detached: inside a recomputed block's forward, arithmetic on `got` (which has a
            # graph) would save tensors the recomputation, finding the verdict cached, never saves.
            with torch.no_grad():
                want = _reference(q, k, v, span)
                err = float((got.detach().float() - want).abs().max() / want.abs().max())
            _VARLEN_TRIAL[key] = None if err < 3e-2 else \
                f"varlen_attn disagreed with the masked reference in a trial call (error {err:.2g})"
        except Exception as e:  # noqa: BLE001 - any refusal means "use another implementation"
            _VARLEN_TRIAL[key] = f"varlen_attn refused a trial call: {str(e)[:160]}"
    return _VARLEN_TRIAL[key]


def _varlen_check(q, k, v, span):
    if q.device.type == "cpu":
        return "varlen_attn's flash kernels need a GPU"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn's flash kernels take fp16/bf16, not {q.dtype}"
    try:
        _varlen_fn()
    except Exception as e:  # noqa: BLE001
        return f"this torch has no varlen_attn ({type(e).__name__})"
    return _shapes(q, k, v, span) or _varlen_trial(q.device, q.dtype, q.shape[-1])


@DOCUMENT_ATTENTION.register("varlen", priority=10, check=_varlen_check)
def _varlen(q, k, v, span: DocumentSpan):
    return varlen_document_attention(q, k, v, span)
