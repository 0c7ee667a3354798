"""Every compiled piece of the tiny hybrid model (Gated DeltaNet and gated attention layers, the
GPU path run on CPU through the partitioner inductor uses) over packed rows of several lengths:
how many forward and backward graphs each compiled function gets under full recompute; the
compiled causal conv, whose row length is symbolic, against the eager conv in fp64 at odd
lengths, outputs and every gradient; FlexAttention's forward graphs (static) per row length.

Legend: B rows, T/S tokens of a row, C conv channels, K conv taps.
"""

from __future__ import annotations

import random
import re
from functools import partial

import pytest
import torch
from torch import nn

from longmoe.config import get_preset
from longmoe.model import MoETransformer
from longmoe.model.deltanet import GatedDeltaNet, causal_conv_silu
from longmoe.model.packing import PackedRows
from longmoe.ops import compiled as comp
from longmoe.ops.recompute import apply_recompute
from longmoe.paired.harness import TOLERANCE, rel_err


def counting_backend(counts: dict):
    """What "aot_eager_decomp_partition" does (inductor's decompositions and partitioner, no
    code generated), counting the graphs it gets in `counts` {(function, "forward" or
    "backward"): n}; the function is the compiled one (the outermost frame of its ops)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import select_decomp_table

    def backend(gm, example_inputs):
        name = next(re.findall(r'File "[^"]+", line \d+, in (\w+)', n.meta["stack_trace"])[0]
                    for n in gm.graph.nodes if n.meta.get("stack_trace"))

        def nop(kind):
            def compile_graph(graph, _inputs):
                counts[name, kind] = counts.get((name, kind), 0) + 1
                return make_boxed_func(graph.forward)
            return compile_graph
        return aot_autograd(fw_compiler=nop("forward"), bw_compiler=nop("backward"),
                            decompositions=select_decomp_table(),
                            partition_fn=partial(min_cut_rematerialization_partition,
                                                 compiler="inductor"))(gm, example_inputs)
    return backend


def _graphs_per_function(counts: dict) -> dict:
    """{function: (forward graphs, backward graphs)}."""
    names = sorted({name for name, _ in counts})
    return {n: (counts.get((n, "forward"), 0), counts.get((n, "backward"), 0)) for n in names}


# Packed micro-batch rows are padded to data.row_multiple; 64-token multiples here, as 1024 on a
# GPU: whole chunks of the compiled Gated DeltaNet core.
ROW_LENGTHS = [128, 192, 256]
# One graph each way for any row length, except the compiled core (static: once per length) and
# the q/k norm with RoPE (once per head count: q's 4, k's 2).
GRAPHS = {"rms_norm": (1, 1), "norm_rope": (2, 2), "gated_rms_norm": (1, 1),
          "causal_conv_silu": (1, 1), "_chunk_terms": (3, 3), "_chunk_output": (3, 3)}


def _packed_step(model, cfg, S, gen):
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=gen)
    packing = PackedRows.from_lengths([[S - 37, 37], [S // 2 + 3]], S)
    model.zero_grad()
    lp, _, aux, _ = model(ids, ids, packing=packing)
    (lp.sum() + aux).backward()
    return lp.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_packed_rows_compile_each_piece_once_but_the_core(monkeypatch):
    """Forward and backward of packed rows of three lengths under full recompute: the row-wise
    pieces (RMSNorm, the q/k norm with RoPE, the gated norm, the causal conv) keep one graph each
    way for all lengths; the compiled core's two pieces compile once per length. The last step's
    log-probs and gradients equal the eager model's."""
    monkeypatch.delenv("LONGMOE_COMPILE_SHAPES", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add overhead on a shared 2-core machine
    cfg = get_preset("tiny-hybrid")
    model = MoETransformer(cfg)
    model.init_weights(seed=random.randrange(2**31))
    model.layers = nn.ModuleList(apply_recompute(b, "full") for b in model.layers)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    counts: dict = {}
    torch._dynamo.reset()
    try:
        with comp.forced(counting_backend(counts)):
            for S in ROW_LENGTHS:
                state = gen.get_state()
                lp, grads = _packed_step(model, cfg, S, gen)
        gen.set_state(state)
        want_lp, want_grads = _packed_step(model, cfg, ROW_LENGTHS[-1], gen)   # eager on CPU
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    assert _graphs_per_function(counts) == GRAPHS, counts
    tol = TOLERANCE[torch.float32]
    assert rel_err(lp, want_lp) < tol
    assert len(grads) == len(want_grads) > 0
    for got, want in zip(grads, want_grads):
        assert rel_err(got, want) < tol


def _packing(gen, T: int) -> PackedRows:
    """Two rows of T tokens: random sample lengths (the first of each row at least 16), the
    second row padded at its end."""
    def lengths(total):
        out = []
        while total > 0:
            n = min(total, int(torch.randint(16 if not out else 1, 40, (), generator=gen)))
            out.append(n)
            total -= n
        return out
    return PackedRows.from_lengths([lengths(T), lengths(T - 1 - T // 3)], T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_conv_on_rows_of_odd_lengths_equals_the_eager_conv(monkeypatch, dtype):
    """The layer's compiled conv (symbolic row length) on packed rows of four odd lengths,
    without and with a context-parallel halo: its output and the gradients of its input, its
    weight and the halo equal the eager conv's in fp64; two graphs each way (halo or not)."""
    monkeypatch.delenv("LONGMOE_COMPILE_SHAPES", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no interpreter: the Triton conv
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(get_preset("tiny-hybrid"))
    with torch.no_grad():
        layer.conv1d.weight.copy_(torch.randn(layer.conv1d.weight.shape, generator=gen))
    layer = layer.to(dtype)
    C, K = layer.conv_dim, layer.kernel
    counts: dict = {}
    backend = counting_backend(counts)
    torch._dynamo.reset()
    try:
        for T, with_halo in ((37, False), (101, True), (173, False), (211, True)):
            # a halo'd piece starts inside the rows (as under context parallelism): its first
            # tokens' samples began in the halo or before
            offset = 9 if with_halo else 0
            history = _packing(gen, T + offset).history[:, offset:]
            x = torch.randn(2, T, C, generator=gen).to(dtype).requires_grad_()
            halo = torch.randn(2, K - 1, C, generator=gen).to(dtype).requires_grad_() \
                if with_halo else None
            dy = torch.randn(2, T, C, generator=gen, dtype=torch.float64)
            with comp.forced(backend):
                y = layer._conv(x, halo, history)
            leaves = [x, layer.conv1d.weight] + ([halo] if with_halo else [])
            got = [y, *torch.autograd.grad((y.double() * dy).sum(), leaves)]
            ref = [t.detach().double().requires_grad_() for t in leaves]
            w64 = ref[1][:, 0]
            y64 = causal_conv_silu(ref[0], w64, ref[2] if with_halo else None, history)
            want = [y64, *torch.autograd.grad((y64 * dy).sum(), ref)]
            for name, a, b in zip(("y", "dx", "dw", "dhalo"), got, want):
                assert a.shape == b.shape and b.abs().max() > 0, name
                assert rel_err(a, b) < TOLERANCE[dtype], (T, name, seed)
    finally:
        torch._dynamo.reset()
    assert _graphs_per_function(counts) == {"causal_conv_silu": (2, 2)}, counts


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_compiled_flex_forward_compiles_once_per_row_length():
    """FlexAttention stays static-shaped: a new row length compiles it again, a new sample
    layout at a length seen does not (forward only: torch has no FlexAttention backward on
    CPU)."""
    from longmoe.ops.document_attention import flex_document_attention
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    counts: dict = {}
    backend = counting_backend(counts)
    torch._dynamo.reset()
    try:
        for S, rows in ((128, [[100, 28], [64]]), (128, [[30, 98], [60, 4]]),
                        (192, [[150, 42], [64]]), (256, [[200, 56], [64]])):
            span = PackedRows.from_lengths(rows, S).span()
            q, k, v = (torch.randn(2, S, h, 16, generator=gen) for h in (4, 2, 2))
            with comp.forced(backend):
                o = flex_document_attention(q, k, v, span)
            want = flex_document_attention(q, k, v, span, compile=False)
            assert rel_err(o, want) < TOLERANCE[torch.float32]
    finally:
        torch._dynamo.reset()
    assert _graphs_per_function(counts) == {"flex_attention": (3, 0)}, counts
