"""ops.compiled's shape modes on the row-wise pieces (RMSNorm, the gated norm, the causal conv)
over rows whose length changes (packed rows): with torch's automatic dynamic shapes
(`dynamic=None`) each compiles at most twice (the first length, then one graph for any length);
static shapes compile once per new length; a named token dim (`token_dims`, what the model's
pieces use) compiles once for every length."""

from __future__ import annotations

import pytest
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


def _graph_count(fn) -> int:
    """Graphs dynamo holds for `fn` (one per guard set: a new static shape adds one)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    return len(_debug_get_cache_entry_list(fn.__code__))


def _packed_steps(lengths):
    """Forward and backward of the tiny hybrid model on packed rows of each length in turn, its
    pieces compiled with dynamo's plain "eager" backend (guards and recompiles as under inductor,
    no code generated; the norms' impl.norm "auto" takes the compiled norms on CPU under
    forced); (graphs per row-wise piece, the last log-probs)."""
    from longmoe.config import get_preset
    from longmoe.model import MoETransformer
    from longmoe.model.layers import norm_rope
    from longmoe.model.packing import PackedRows
    cfg = get_preset("tiny-hybrid")
    model = MoETransformer(cfg)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    torch._dynamo.reset()
    with comp.forced("eager"):
        for S in lengths:
            ids = torch.randint(0, cfg.vocab_size, (2, S), generator=gen)
            packing = PackedRows.from_lengths([[S - 17, 17], [S // 2]], S)
            lp, _, _, _ = model(ids, ids, packing=packing)
            lp.sum().backward()
    graphs = {f.__name__: _graph_count(f) for f in (rms_norm, norm_rope, gated_rms_norm)}
    torch._dynamo.reset()
    with torch.no_grad():
        want, _, _, _ = model(ids, ids, packing=packing)
    torch.testing.assert_close(lp.detach(), want, rtol=1e-5, atol=1e-5)
    return graphs


def test_packed_rows_of_new_lengths_reuse_the_row_pieces_graphs(monkeypatch):
    """The model's row-wise pieces name their token dim (ops.compiled's token_dims): packed
    micro-batches of three row lengths compile RMSNorm once, the norm+RoPE once per head count
    (q, k) and the gated norm once, whatever the number of lengths. (The lengths are off the
    CPU compiled core's 64-token chunks: a row that fills them gets a head-major o from it, one
    more layout and graph of the gated norm.) LONGMOE_COMPILE_SHAPES=static compiles each
    piece once per length."""
    lengths = [80, 104, 136]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add overhead on a shared 2-core machine
    monkeypatch.delenv("LONGMOE_COMPILE_SHAPES", raising=False)
    graphs = _packed_steps(lengths)
    assert graphs == {"rms_norm": 1, "norm_rope": 2, "gated_rms_norm": 1}, graphs
    monkeypatch.setenv("LONGMOE_COMPILE_SHAPES", "static")
    static = _packed_steps(lengths[:2])
    torch.set_num_threads(threads)
    assert static["rms_norm"] == 2 and static["norm_rope"] == 4, static


@pytest.mark.slow
def test_row_pieces_under_inductor_take_any_row_length(monkeypatch):
    """Inductor itself (CPU code here) on the symbolic token dim: one graph per piece over three
    row lengths, forward and backward, equal to the eager functions."""
    from longmoe.config import get_preset
    from longmoe.model.deltanet import GatedDeltaNet, GatedRMSNorm
    from longmoe.model.layers import RMSNorm, norm_rope, rope_cos_sin
    from longmoe.model.packing import PackedRows
    torch._dynamo.reset()
    norm, qk, gated = RMSNorm(24, 1e-6, True), RMSNorm(16, 1e-6, True), GatedRMSNorm(8, 1e-6)
    conv = GatedDeltaNet(get_preset("tiny-hybrid"))  # its compiled conv (no Triton interpreter)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LONGMOE_COMPILE_SHAPES", raising=False)
    with torch.no_grad():
        for m in (norm, qk, gated):
            m.weight.normal_()
            m.impl = "compiled"  # impl.norm: the compiled norms, not our kernels
    with comp.forced("inductor"):
        for T in (96, 160, 353):
            x = torch.randn(2, T, 24, requires_grad=True)
            y = norm(x)
            gx, = torch.autograd.grad(y.square().sum(), x)
            want = rms_norm(x, norm.weight, 1e-6, True)
            torch.testing.assert_close(y, want)
            torch.testing.assert_close(gx, torch.autograd.grad(want.square().sum(), x)[0])
            cos, sin = rope_cos_sin(torch.arange(T).repeat(2, 1), 4, 1e4, torch.float32)
            q = torch.randn(2, T, 3, 16)
            torch.testing.assert_close(qk.with_rope(q, cos, sin),
                                       norm_rope(q, qk.weight, 1e-6, True, cos, sin))
            a, g = torch.randn(2, T, 3, 8), torch.randn(2, T, 3, 8)
            torch.testing.assert_close(gated(a, g, fused=True),
                                       gated_rms_norm(a, g, gated.weight, 1e-6))
            x = torch.randn(2, T, conv.conv_dim, requires_grad=True)
            history = PackedRows.from_lengths([[T // 3, T - T // 3], [T - 5]], T).history
            y = conv._conv(x, history_BS=history)
            gx, = torch.autograd.grad(y.square().sum(), x)
            want = causal_conv_silu(x, conv.conv1d.weight[:, 0], None, history)
            torch.testing.assert_close(y, want)
            torch.testing.assert_close(gx, torch.autograd.grad(want.square().sum(), x)[0])
    graphs = [_graph_count(f) for f in (rms_norm, norm_rope, gated_rms_norm, causal_conv_silu)]
    torch._dynamo.reset()
    assert graphs == [1, 1, 1, 1], graphs
