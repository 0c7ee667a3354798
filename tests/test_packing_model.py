"""The whole model on packed rows (tiny: full attention; tiny-hybrid: Gated DeltaNet + full
attention): per-token log-probs and every parameter's gradient equal running each sample alone
in its own unpadded row. Padding and each sample's last token carry the label -100.

Legend: B rows, S tokens per row, V vocab.
"""

import random

import pytest
import torch

from longmoe.config import get_preset
from longmoe.model import MoETransformer
from longmoe.model.packing import PackedRows
from longmoe.paired.harness import TOLERANCE, rel_err

S = 40
# Row 0: a one-token sample, odd lengths, padding; row 1: one sample exactly the row length.
ROWS = [[1, 11, 6, 17], [S]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def packed_batch(rows, seq_len, vocab, gen):
    """(ids, labels, weights, packing): random tokens; labels are the next token inside each
    sample, -100 on its last token and on padding; weights are per-token loss weights (0 where
    the label is -100)."""
    packing = PackedRows.from_lengths(rows, seq_len)
    B = len(rows)
    ids = torch.randint(0, vocab, (B, seq_len), generator=gen)
    labels = torch.full((B, seq_len), -100)
    for r, lengths in enumerate(rows):
        a = 0
        for n in lengths:
            labels[r, a:a + n - 1] = ids[r, a + 1:a + n]
            a += n
    w = torch.randn(B, seq_len, generator=gen, dtype=torch.float64) * (labels != -100)
    return ids, labels, w, packing


def samples(rows):
    out = []
    for r, lengths in enumerate(rows):
        a = 0
        for n in lengths:
            out.append((r, a, n))
            a += n
    return out


def _grads(model):
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_packed_equals_each_sample_alone(preset, dtype):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    cfg = get_preset(preset).replace(init_std=0.1)
    model = MoETransformer(cfg).to(dtype)
    model.init_weights(seed=gen.initial_seed() % 1000)
    # Gated DeltaNet's cores compute in fp32 whatever the model's dtype.
    exact = dtype == torch.float64 and preset == "tiny"
    _check_packed_equals_alone(model, cfg, gen, TOLERANCE[torch.float64] if exact else
                               5 * TOLERANCE[torch.float32])


# The eager implementations that run on CPU with gradients, beside the test above's auto
# choice (reference attention, chunked core). torch's FlexAttention has no CPU backward; the
# compiled core is checked per layer (test_packing_deltanet) and in the whole model under CP
# (test_packing_cp): here its recompiles for every sample length alone took a minute.
@pytest.mark.parametrize("attention,gated_delta", [("math", "chunked"), ("reference", "reference")])
def test_model_packed_equals_alone_per_implementation(attention, gated_delta):
    from longmoe.model.deltanet import GatedDeltaNet
    from longmoe.model.layers import Attention
    from longmoe.ops.attention import Attention as SDPA
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    cfg = get_preset("tiny-hybrid").replace(init_std=0.1)
    model = MoETransformer(cfg)
    model.init_weights(seed=gen.initial_seed() % 1000)
    kinds = set()
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            m.impl = gated_delta
            kinds.add("linear")
        if isinstance(m, Attention):
            m.sdpa = SDPA(attention)
            kinds.add("full")
    assert kinds == {"linear", "full"}
    _check_packed_equals_alone(model, cfg, gen, 5 * TOLERANCE[torch.float32])


def _check_packed_equals_alone(model, cfg, gen, tol):
    ids, labels, w, packing = packed_batch(ROWS, S, cfg.vocab_size, gen)

    lp, _, _, _ = model(ids, labels, packing=packing)
    (lp.double() * w).sum().backward()
    got_lp, got = lp.detach().double(), _grads(model)
    model.zero_grad(set_to_none=True)

    want_lp = torch.zeros_like(got_lp)
    for r, a, n in samples(ROWS):
        sl = slice(a, a + n)
        lp1, _, _, _ = model(ids[r:r + 1, sl], labels[r:r + 1, sl])
        (lp1.double() * w[r:r + 1, sl]).sum().backward()  # gradients sum over the samples
        want_lp[r:r + 1, sl] = lp1.detach().double()
    want = _grads(model)

    real = labels != -100
    assert rel_err(got_lp[real], want_lp[real]) < tol, gen.initial_seed()
    assert got.keys() == want.keys() and len(got) > 10
    for name in want:
        assert rel_err(got[name], want[name]) < tol, (name, gen.initial_seed())
    if cfg.layer_types:
        assert any("A_log" in n for n in got)

    # The check can fail: the same row unpacked (every sample reading the earlier ones) differs.
    leaky, _, _, _ = model(ids, labels)
    assert rel_err(leaky.detach()[0][real[0]], want_lp[0][real[0]]) > 1e-4


def test_packing_arguments_are_checked():
    cfg = get_preset("tiny").replace(num_layers=1)
    model = MoETransformer(cfg)
    ids = torch.zeros(2, 8, dtype=torch.long)
    p = PackedRows.unpacked(2, 8)
    with pytest.raises(ValueError, match="positions=None"):
        model(ids, ids, torch.arange(8), packing=p)
    with pytest.raises(ValueError, match="does not match"):
        model(ids[:, :6], ids[:, :6], packing=p)


def test_unpacked_packing_is_the_unpacked_model():
    # PackedRows.unpacked gives what no packing gives (one sample per row at 0..S-1).
    cfg = get_preset("tiny-hybrid")
    model = MoETransformer(cfg)
    model.init_weights(seed=1)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=gen)
    with torch.no_grad():
        a, _, _, _ = model(ids, ids)
        b, _, _, _ = model(ids, ids, packing=PackedRows.unpacked(2, 19))
    assert rel_err(b, a) < 5 * TOLERANCE[torch.float32]
