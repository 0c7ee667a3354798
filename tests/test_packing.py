"""Packed rows (longmoe.model.packing) and document-causal attention
(longmoe.ops.document_attention): every implementation that runs on CPU gives, on a packed row,
each sample's outputs and gradients as if it ran alone; so does the model's attention layer
(output gate, GQA, qk-norm, partial rotary with positions restarting per sample).

Legend: B rows, S tokens per row, N query heads, K kv heads, D head dim, H hidden.
"""

import random

import pytest
import torch
import torch.nn.functional as F

from longmoe.model.packing import PackedRows
from longmoe.ops.attention import IMPL_NAMES, Attention
from longmoe.ops.document_attention import (DOCUMENT_ATTENTION, DocumentSpan,
                                            flex_document_attention)
from longmoe.ops.registry import ImplUnavailable
from longmoe.paired.harness import TOLERANCE, rel_err
from _packed_rows import samples_of as _samples

# Row 0: a one-token sample, odd lengths and padding; row 1: one sample exactly the row length.
S = 25
ROWS = [[1, 5, 13, 4], [S]]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))



# ---- the description ---------------------------------------------------------------------------

def test_from_lengths_views():
    p = PackedRows.from_lengths(ROWS, S)
    ids, pos = p.sample_ids.tolist(), p.positions.tolist()
    assert ids[0] == [0] + [1] * 5 + [2] * 13 + [3] * 4 + [-1] * 2 and ids[1] == [4] * S
    assert pos[0] == [0, 0, 1, 2, 3, 4] + list(range(13)) + list(range(4)) + [0, 1]
    assert pos[1] == list(range(S))
    assert p.cu_seqlens.tolist() == [0, 1, 6, 19, 23, 25, 50] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == S
    assert p.starts[0].nonzero()[:, 0].tolist() == [0, 1, 6, 19, 23] and p.starts[1].sum() == 1
    assert torch.equal(p.history, p.positions)  # positions restart at every segment start
    assert p.padding.sum() == 2 and p.padding[0, -2:].all()
    assert p.segments[1].unique().tolist() == [5]
    p.check()


def test_unpacked_is_one_sample_per_row():
    p = PackedRows.unpacked(3, 7)
    assert p.cu_seqlens.tolist() == [0, 7, 14, 21] and p.max_seqlen == 7
    assert torch.equal(p.positions, torch.arange(7).expand(3, 7))
    p.check()


@pytest.mark.parametrize("rows,ids,msg", [
    ([[3, 0]], None, "row 0, sample 1: length 0"),
    ([[10]], None, "exceed"),
    ([[2, 2]], [[0]], "2 lengths but 1 ids"),
    ([[2]], [[-3]], "id -3"),
])
def test_from_lengths_rejects(rows, ids, msg):
    with pytest.raises(ValueError, match=msg):
        PackedRows.from_lengths(rows, 8, sample_ids=ids)


def test_check_names_the_bad_row():
    ids = torch.tensor([[0, 0, 1, 1], [2, 2, 0, 0]])
    with pytest.raises(ValueError, match="row 1: sample 0 is split"):
        PackedRows(ids, torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]])).check()
    with pytest.raises(ValueError, match="row 0, token 2: position 2"):
        PackedRows(ids[:1], torch.tensor([[0, 1, 2, 3]])).check()
    with pytest.raises(ValueError, match="integers"):
        PackedRows(ids.float(), ids)
    with pytest.raises(AttributeError):
        PackedRows(ids, ids).positions = ids


def test_select_keeps_the_whole_rows_meaning():
    p = PackedRows.from_lengths([[4, 1, 7]], 12)
    idx = torch.tensor([0, 1, 2, 9, 10, 11])  # two pieces, as a zigzag rank holds them
    share = p.select(idx)
    assert share.whole is p and share.starts[0].tolist() == [True] + [False] * 5
    assert share.history[0].tolist() == [0, 1, 2, 4, 5, 6]
    assert share.to("cpu").history[0].tolist() == [0, 1, 2, 4, 5, 6]
    with pytest.raises(ValueError, match="whole rows"):
        share.span()


# ---- spans -------------------------------------------------------------------------------------

def _mask_by_hand(ids_row, q_start):
    n = len(ids_row)
    return [[ids_row[i] == ids_row[j] and j <= i for j in range(n)] for i in range(q_start, n)]


@pytest.mark.parametrize("q_start,keys", [(0, S), (6, 19), (19, 25)])
def test_span_mask_and_varlen_layout(q_start, keys):
    p = PackedRows.from_lengths(ROWS, S)
    span = p.span(q_start, keys)
    assert p.span(q_start, keys) is span  # built once, shared by every layer
    for r in range(2):
        ids = p.sample_ids[r, :keys].tolist()
        assert span.mask[r].tolist() == _mask_by_hand(ids, q_start)
    lay = span.varlen
    # Each query run is one segment; its keys are that segment up to the row's last query.
    seg_q = p.segments[:, q_start:keys].reshape(-1)
    flat = p.segments[:, :keys].reshape(-1)
    runs = torch.unique_consecutive(seg_q)
    assert lay.cu_q.diff().tolist() == [int((seg_q == s).sum()) for s in runs]
    assert lay.cu_k.diff().tolist() == [int((flat == s).sum()) for s in runs]
    keys_taken = torch.arange(flat.numel()) if lay.key_index is None else lay.key_index
    assert torch.equal(flat[keys_taken], torch.repeat_interleave(runs, lay.cu_k.diff().long()))
    assert lay.max_q == int(lay.cu_q.diff().max()) and lay.max_k == int(lay.cu_k.diff().max())


# ---- attention implementations ----------------------------------------------------------------

def _qkv(gen, B, Sq, Sk, N, K, D, dtype):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return r(B, Sq, N, D), r(B, Sk, K, D), r(B, Sk, K, D)


def _alone(q, k, v):
    """Causal SDPA of one sample [1, n, H, D], in fp64."""
    o = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)),
                                       is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _varlen_emulated(q, k, v, span):
    """What varlen_attn computes over the span's layout, written out per segment (tests only):
    checks the layout (cu_q, cu_k, key_index, bottom-right causal alignment) without its
    kernels."""
    B, Sq, N, D = q.shape
    lay = span.varlen
    qf, kf, vf = q.reshape(B * Sq, N, D), k.reshape(-1, k.shape[2], D), v.reshape(-1, k.shape[2], D)
    if lay.key_index is not None:
        kf, vf = kf[lay.key_index], vf[lay.key_index]
    outs = []
    for i in range(lay.cu_q.numel() - 1):
        qs = qf[int(lay.cu_q[i]):int(lay.cu_q[i + 1])].transpose(0, 1)[None]
        ks, vs = (t[int(lay.cu_k[i]):int(lay.cu_k[i + 1])].transpose(0, 1)[None] for t in (kf, vf))
        nq, nk = qs.shape[2], ks.shape[2]
        lower_right = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=lower_right,
                                           enable_gqa=N != k.shape[2])
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs).view(B, Sq, N, D)


IMPLS = {
    "auto": lambda q, k, v, span: Attention("auto").packed(q, k, v, span),
    "reference": lambda q, k, v, span: Attention("reference").packed(q, k, v, span),
    "math-backend": lambda q, k, v, span: Attention("math").packed(q, k, v, span),
    "varlen-layout": _varlen_emulated,
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_attention_equals_each_sample_alone(gen, impl, dtype):
    N, K, D = 4, 2, 8
    p = PackedRows.from_lengths(ROWS, S)
    q, k, v = (t.requires_grad_() for t in _qkv(gen, 2, S, S, N, K, D, dtype))
    w = torch.randn(2, S, N, D, generator=gen, dtype=torch.float64)
    out = IMPLS[impl](q, k, v, p.span())
    grads = torch.autograd.grad((out.double() * w).sum(), (q, k, v))
    # Each sample alone, written into the packed layout; padding is compared nowhere.
    want = [torch.zeros(t.shape, dtype=torch.float64) for t in (out, q, k, v)]
    for r, a, n in _samples(ROWS):
        sl = slice(a, a + n)
        leaves = [t.detach()[r:r + 1, sl].double().requires_grad_() for t in (q, k, v)]
        ref = _alone(*leaves)
        for acc, t in zip(want, [ref, *torch.autograd.grad((ref * w[r:r + 1, sl]).sum(), leaves)]):
            acc[r:r + 1, sl] = t
    real = ~p.padding
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        assert rel_err(got[real], ref[real]) < TOLERANCE[dtype], (impl, name, gen.initial_seed())


@pytest.mark.parametrize("impl", ["reference", "varlen-layout"])
@pytest.mark.parametrize("q_start,keys", [(6, 19), (12, 25)])
def test_context_parallel_piece_equals_the_rows_slice(gen, impl, q_start, keys):
    # A CP piece: queries [q_start, keys) against keys [0, keys) give the whole rows' outputs there.
    p = PackedRows.from_lengths(ROWS, S)
    q, k, v = _qkv(gen, 2, S, S, 4, 2, 8, torch.float64)
    full = IMPLS["reference"](q, k, v, p.span())
    piece = IMPLS[impl](q[:, q_start:keys], k[:, :keys], v[:, :keys], p.span(q_start, keys))
    assert rel_err(piece, full[:, q_start:keys]) < 1e-12


@pytest.mark.parametrize("compile", [False, True])
def test_flex_forward_on_cpu_equals_the_reference(gen, compile):
    # torch's FlexAttention has no backward on CPU: the forward here, eager and through the
    # compile path (the partitioner inductor uses, without generating kernels).
    from longmoe.ops.compiled import forced
    p = PackedRows.from_lengths(ROWS, S)
    q, k, v = _qkv(gen, 2, S, S, 4, 2, 8, torch.float32)
    for q_start in (0, 12):
        span = p.span(q_start)
        want = IMPLS["reference"](q[:, q_start:], k, v, span)
        with forced("aot_eager_decomp_partition"):
            got = flex_document_attention(q[:, q_start:], k, v, span, compile=compile)
        assert rel_err(got, want) < TOLERANCE[torch.float32], (q_start, gen.initial_seed())


def test_a_leaking_mask_is_caught(gen):
    # The check above can fail: plain causal attention over the packed row differs.
    p = PackedRows.from_lengths(ROWS, S)
    q, k, v = _qkv(gen, 2, S, S, 4, 2, 8, torch.float64)
    packed = IMPLS["reference"](q, k, v, p.span())
    leaky = _alone(q, k, v)
    assert rel_err(packed[0, 1:], leaky[0, 1:]) > 1e-3
    assert rel_err(packed[1], leaky[1]) < 1e-12  # the one-sample row is plain causal


def test_registry_on_cpu():
    q, k, v = _qkv(torch.Generator().manual_seed(0), 1, 8, 8, 2, 2, 4, torch.float32)
    span = DocumentSpan.causal(1, 8)
    assert DOCUMENT_ATTENTION.select("auto", q, k, v, span).name == "reference"
    for name, why in (("varlen", "GPU"), ("flex", "CPU")):
        with pytest.raises(ImplUnavailable, match=why):
            Attention(name).packed(q, k, v, span)
    assert {"varlen", "flex", "reference"} <= set(IMPL_NAMES)
    with pytest.raises(ImplUnavailable, match="do not match"):
        Attention().packed(q, k[:, :5], v[:, :5], span)


def test_document_impl_named_for_unpacked_rows(gen):
    # impl.attention: reference on unpacked rows is causal attention over one segment per row.
    q, k, v = (t.transpose(1, 2) for t in _qkv(gen, 2, 9, 9, 4, 2, 8, torch.float64))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = Attention("reference")(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(got, want) < 1e-12
    from torch.nn.attention.bias import causal_lower_right
    bias = causal_lower_right(4, 9)
    want = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=bias, enable_gqa=True)
    assert rel_err(Attention("reference")(q[:, :, 5:], k, v, attn_mask=bias, enable_gqa=True),
                   want) < 1e-12


# ---- the model's attention layer ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gated", [True, False])
def test_attention_layer_packed_equals_alone(gen, dtype, gated):
    from longmoe.config import ModelConfig
    from longmoe.model.layers import Attention as Layer, rope_cos_sin
    cfg = ModelConfig(hidden_size=24, num_heads=6, num_kv_heads=2, head_dim=8,
                      partial_rotary_factor=0.5, rope_theta=100.0, attn_output_gate=gated,
                      qk_norm=True, norm_unit_offset=gated)
    layer = Layer(cfg).to(dtype)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64) * 0.5)
    p = PackedRows.from_lengths(ROWS, S)
    x = torch.randn(2, S, cfg.hidden_size, generator=gen, dtype=torch.float64)
    w = torch.randn(2, S, cfg.hidden_size, generator=gen, dtype=torch.float64)
    w[p.padding] = 0  # padding carries no loss
    params = list(layer.parameters())

    def run(x_in, pos, packing=None):
        xi = x_in.to(dtype).requires_grad_()
        cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, dtype)
        y = layer(xi, cos, sin, packing)
        return y, xi

    y, xi = run(x, p.positions, p)
    grads = torch.autograd.grad((y.double() * w).sum(), [xi] + params)
    want = [torch.zeros(y.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)]
    want += [torch.zeros(g.shape, dtype=torch.float64) for g in grads[1:]]
    for r, a, n in _samples(ROWS):
        sl = slice(a, a + n)
        ya, xa = run(x[r:r + 1, sl], torch.arange(n))
        ga = torch.autograd.grad((ya.double() * w[r:r + 1, sl]).sum(), [xa] + params)
        want[0][r:r + 1, sl], want[1][r:r + 1, sl] = ya.detach(), ga[0]
        for acc, g in zip(want[2:], ga[1:]):
            acc += g.double()  # a parameter's gradient sums over the samples
    real = ~p.padding
    tol = TOLERANCE[dtype] * (1 if dtype == torch.float64 else 5)
    assert rel_err(y[real], want[0][real]) < tol, gen.initial_seed()
    assert rel_err(grads[0][real], want[1][real]) < tol, gen.initial_seed()
    for prm, g, gr in zip(params, grads[1:], want[2:]):
        assert rel_err(g, gr) < tol, gen.initial_seed()


# ---- GPUs --------------------------------------------------------------------------------------

@pytest.mark.needs_cuda
@pytest.mark.parametrize("impl", ["varlen", "flex", "auto"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-3)])
@pytest.mark.parametrize("q_start", [0, 500])
def test_gpu_document_attention_matches_the_reference(impl, dtype, tol, q_start):
    """The model's attention shape (head dim 256, GQA 8:1) on packed rows of odd lengths, whole
    rows and a CP piece (queries from q_start on), against the masked reference in fp32:
    outputs and gradients. varlen takes fp16/bf16 only: named with fp32 it must refuse."""
    from longmoe.backends import active_backend
    dev = active_backend().device(0)
    rows = [[1, 130, 7, 333, 29, 300], [800]]
    p = PackedRows.from_lengths(rows, 800).to(dev)
    span = p.span(q_start)
    gen = torch.Generator(device=dev).manual_seed(random.randrange(2**31))
    mk = lambda s, h: torch.randn(2, s, h, 256, generator=gen, device=dev)  # noqa: E731
    q, k, v = mk(800 - q_start, 8), mk(800, 1), mk(800, 1)
    w = torch.randn(q.shape, generator=gen, device=dev)
    att = Attention(impl)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    if impl == "varlen" and dtype == torch.float32:
        with pytest.raises(ImplUnavailable, match="fp16/bf16"):
            att.packed(*leaves, span)
        return
    out = att.packed(*leaves, span)
    got = [out, *torch.autograd.grad((out.float() * w).sum(), leaves)]
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = Attention("reference").packed(*ref_in, span)
    want = [ref, *torch.autograd.grad((ref * w).sum(), ref_in)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) < tol, (impl, name)
