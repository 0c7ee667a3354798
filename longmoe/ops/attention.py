"""Scaled-dot-product attention through torch's SDPA with a backend preference.

torch picks an SDPA backend by a fixed order. Which backend is fastest depends on the GPU and the
head dim, so the order is data: "auto" takes the order the active backend's kernels.json lists
for its arch under "sdpa", and torch's own choice where none is listed (none is: where measured,
torch's choice was already the fastest; docs/primitives/attention.md).
`impl.attention: <name>` runs that backend only: a call it cannot serve fails with torch's
"no available kernel" error rather than silently running another. Exclusive on purpose: with a
fall-through order, a full-recompute run at 64K asked for flash first and its recomputed forward
took another backend than the first forward (different saved RNG-state dtypes), which the
checkpoint rejects.

Packed rows (several samples per row) take document-causal attention instead
(longmoe.ops.document_attention): "auto" picks the fastest implementation that runs there
(varlen_attn, then FlexAttention, on GPUs; the masked-SDPA reference on CPU); `varlen`, `flex`
and `reference` name one (and serve unpacked rows too, as one segment per row); an SDPA
backend name runs the masked reference through that backend only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from longmoe.ops.document_attention import DOCUMENT_ATTENTION, DocumentSpan

SDPA_NAMES = ("flash", "cudnn", "efficient", "math")
DOCUMENT_NAMES = ("varlen", "flex", "reference")
IMPL_NAMES = ("auto", *SDPA_NAMES, *DOCUMENT_NAMES)  # valid impl.attention values


def _enum(name: str):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_backends(order: list[str] | None):
    """Context that lets SDPA use exactly `order`, tried in that order; None: torch's choice."""
    if not order:
        return contextlib.nullcontext()
    bad = [n for n in order if n not in SDPA_NAMES]
    if bad:
        raise ValueError(f"unknown SDPA backend {bad[0]!r}; valid: {', '.join(SDPA_NAMES)}")
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel([_enum(n) for n in order], set_priority=True)


def preferred_order(impl: str = "auto", device: torch.device | None = None) -> list[str] | None:
    """The SDPA backends for `impl` ("auto" or a backend name) on `device`, in order; None leaves
    the choice to torch."""
    if impl != "auto":
        if impl not in SDPA_NAMES + DOCUMENT_NAMES:
            raise ValueError(f"unknown attention implementation {impl!r}; "
                             f"valid: {', '.join(IMPL_NAMES)}")
        return [impl] if impl in SDPA_NAMES else None
    if device is not None and device.type == "cpu":
        return None
    from longmoe.backends import active_backend
    try:
        return list(active_backend().kernel_config("sdpa")["order"])
    except KeyError:
        return None


class Attention:
    """SDPA with the order for one implementation choice, resolved once per device."""

    def __init__(self, impl: str = "auto"):
        preferred_order(impl)  # validate the name now (config time), not at the first call
        self.impl = impl
        self._orders: dict[str, list[str] | None] = {}

    def _order(self, device):
        key = str(device)
        if key not in self._orders:
            self._orders[key] = preferred_order(self.impl, device)
        return self._orders[key]

    def __call__(self, q, k, v, *, is_causal=False, attn_mask=None, enable_gqa=False):
        if self.impl in DOCUMENT_NAMES and (is_causal or _lower_right(attn_mask)):
            # a document implementation named for unpacked rows: one segment per row
            B, _, Sq, _ = q.shape
            span = DocumentSpan.causal(B, k.shape[2], k.shape[2] - Sq, q.device)
            return self.packed(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               span).transpose(1, 2)
        with sdpa_backends(self._order(q.device)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                  is_causal=is_causal, enable_gqa=enable_gqa)

    def packed(self, q_BSND, k_BSKD, v_BSKD, span: DocumentSpan):
        """Document-causal attention of [B, Sq, N, D] queries against [B, Sk, K, D] keys and
        values over `span`; [B, Sq, N, D] out."""
        name = self.impl if self.impl in DOCUMENT_NAMES + ("auto",) else "reference"
        impl = DOCUMENT_ATTENTION.select(name, q_BSND, k_BSKD, v_BSKD, span)
        if impl.name != "reference":
            return impl.fn(q_BSND, k_BSKD, v_BSKD, span)
        with sdpa_backends(self._order(q_BSND.device)):
            return impl.fn(q_BSND, k_BSKD, v_BSKD, span)


def _lower_right(mask) -> bool:
    from torch.nn.attention.bias import CausalBias, CausalVariant
    return isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT
