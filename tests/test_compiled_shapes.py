"""ops.compiled's shape modes on the row-wise pieces (RMSNorm, the gated norm, the causal conv)
over rows whose length changes (packed rows): with torch's automatic dynamic shapes
(`dynamic=None`) each compiles at most twice (the first length, then one graph for any length);
static shapes compile once per new length."""

from __future__ import annotations

import torch

from longmoe.model.deltanet import causal_conv_silu, gated_rms_norm
from longmoe.model.layers import rms_norm
from longmoe.ops import compiled as comp


def _graphs(fn, dynamic, make, lengths):
    torch._dynamo.reset()
    seen = []

    def counting(gm, example_inputs):
        seen.append(len(example_inputs))
        return gm.forward

    with comp.forced(counting):
        f = comp.compiled(fn, dynamic=dynamic)
        for T in lengths:
            args = make(T)
            got = f(*args)
            torch.testing.assert_close(got, fn(*args), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    return len(seen)


PIECES = {
    "rms_norm": (rms_norm, lambda T: (torch.randn(1, T, 24), torch.randn(24), 1e-6, True)),
    "gated_rms_norm": (gated_rms_norm, lambda T: (torch.randn(1, T, 3, 8), torch.randn(1, T, 3, 8),
                                                  torch.randn(8), 1e-6)),
    "causal_conv_silu": (causal_conv_silu, lambda T: (torch.randn(1, T, 12), torch.randn(12, 4))),
}


def test_packed_lengths_compile_at_most_twice():
    lengths = [96, 160, 224, 352, 417]
    for name, (fn, make) in PIECES.items():
        dynamic = _graphs(fn, None, make, lengths)
        static = _graphs(fn, False, make, lengths)
        assert dynamic <= 2, (name, dynamic)
        assert static == len(lengths), (name, static)   # what dynamic=None avoids


def test_static_pieces_keep_compiling_past_dynamo_default_limit():
    """Static shapes: a packed run meets up to budget / data.row_multiple lengths (32 at a 32K
    budget in 1K multiples); past dynamo's default limit of 8 graphs a function would run
    eagerly for every new length. compiled() lifts the limit so each length gets its graph."""
    lengths = [64 * i for i in range(1, 13)]
    fn, make = PIECES["rms_norm"]
    assert _graphs(fn, False, make, lengths) == len(lengths)
