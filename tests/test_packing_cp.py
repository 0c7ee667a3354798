"""Context parallelism over packed rows on real gloo process groups: each CP rank holds its zigzag
share of packed rows (sample ids, positions, starts) and runs the model with FSDP2, full
recompute, linear CE and EP; the ranks' per-token log-probs, loss and every parameter gradient
equal world size 1 running each sample alone, unpacked. Sample starts fall inside pieces and
exactly on piece boundaries; samples span several pieces; one sample fills a whole row. Without
CP (EP 2, FSDP2) each data rank holds one packed row, with the same per-token checks. A share
that drops the document mask, the conv's restart or the state's restart changes the log-probs.
"""

import random

import pytest
import torch

from longmoe.paired.dist_cases import _grads_by_name, candidate_run, reference_run
from longmoe.paired.harness import TOLERANCE, rel_err
from longmoe.paired.spawn import run_ranks
from test_packing_model import packed_batch, samples

S = 48
# Starts at 0, 6, 7, 24, 36: on piece boundaries for CP 4 (pieces of 6) and CP 2 (of 12), and
# inside pieces; padding 43..47; row 1 one sample of the row's length.
ROWS = [[6, 1, 17, 12, 7], [S]]


def _run(**kw):
    run = candidate_run(chunks=2, recompute="full", fsdp=True, linear_ce="chunked",
                        preset="tiny-hybrid", num_layers=4, seq_len=S, batch_size=len(ROWS), **kw)
    run["model"]["init_std"] = 0.1
    return run


def _cp_rank(rank, world, backend, run_dict, seed):
    from longmoe.model.packing import PackedRows
    from longmoe.parallel.context_parallel import local_packing, split_sequence, zigzag_positions
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model, finish_grads, loss_scale
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    model = build_model(run, layout, backend.device(rank))
    ids, labels, w, packing = packed_batch(ROWS, S, run.model.vocab_size,
                                           torch.Generator().manual_seed(seed))
    rows = slice(None)
    if layout.data_world > 1:  # one packed row per data rank
        assert layout.data_world == len(ROWS)
        rows = slice(layout.data_rank, layout.data_rank + 1)
        ids, labels, w = ids[rows], labels[rows], w[rows]
        packing = PackedRows(packing.sample_ids[rows], packing.positions[rows])
    pos = zigzag_positions(S, layout.cp, layout.cp_rank)
    ids, labels, w = (split_sequence(t, pos) for t in (ids, labels, w))
    lp, _, _, _ = model(ids, labels, packing=local_packing(packing, layout.cp, layout.cp_rank))
    loss = (lp.double() * w).sum()
    (loss * loss_scale(layout)).backward()
    finish_grads(model, layout, run.parallel.fsdp)
    return {"lp": lp.detach().double(), "rows": rows, "pos": pos, "loss": float(loss),
            "grads": _grads_by_name(model)}


def _reference(run_dict, seed):
    """World size 1, every primitive off, each sample alone in its own unpadded row."""
    from longmoe.parallel.mesh import Layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    run = from_dict(reference_run(run_dict))
    model = build_model(run, Layout(1, 0, 1, None, None, None), torch.device("cpu"))
    ids, labels, w, _ = packed_batch(ROWS, S, run.model.vocab_size,
                                     torch.Generator().manual_seed(seed))
    lp_all, loss = torch.zeros(len(ROWS), S, dtype=torch.float64), 0.0
    for r, a, n in samples(ROWS):
        sl = slice(a, a + n)
        lp, _, _, _ = model(ids[r:r + 1, sl], labels[r:r + 1, sl])
        part = (lp.double() * w[r:r + 1, sl]).sum()
        part.backward()
        lp_all[r, sl], loss = lp.detach()[0].double(), loss + float(part.detach())
    return {"lp": lp_all, "loss": loss, "grads": _grads_by_name(model), "real": labels != -100}


# cp1-ep2: no context parallelism, each of the 2 data ranks holds one packed row (EP 2 and
# FSDP2 over both ranks).
@pytest.mark.parametrize("nproc,cp,ep", [(2, 2, 1), (2, 2, 2), (4, 4, 2), (2, 1, 2)],
                         ids=["cp2", "cp2-ep2", "cp4-ep2", "cp1-ep2"])
def test_packed_context_parallel_equals_unpacked_world1(nproc, cp, ep):
    _check_against_world1(_run(cp=cp, ep=ep), nproc, ep)


def test_keep_attention_under_packed_context_parallel():
    """Full recompute around the attention kernel (parallel.keep_attention) with packed rows
    under CP 2: the kernel's saved tensors include the gathered keys and values, whose
    gradients reduce-scatter back; the same answer as world size 1."""
    run = _run(cp=2, ep=1)
    run["parallel"]["keep_attention"] = True
    _check_against_world1(run, 2, 1)


def _check_against_world1(run, nproc, ep):
    seed = random.randrange(2**31)
    ranks = run_ranks(_cp_rank, nproc, run, seed)
    ref = _reference(run, seed)
    tol = 5 * TOLERANCE[torch.float32]
    lp = torch.zeros_like(ref["lp"])
    for r in ranks:
        lp[r["rows"], r["pos"]] = r["lp"]
    real = ref["real"]
    assert rel_err(lp[real], ref["lp"][real]) < tol, seed
    scale = float((ref["lp"].abs() * real).sum() / real.sum())  # the loss sums signed terms
    assert rel_err(torch.tensor(sum(r["loss"] for r in ranks)), torch.tensor(ref["loss"]),
                   scale=scale) < tol, seed
    experts = {n for n in ref["grads"] if ".experts." in n}
    assert experts and len(ref["grads"]) > 20
    for name, g_ref in ref["grads"].items():
        if name in experts and ep > 1:  # each EP rank holds its slice of the experts
            got = torch.cat([ranks[i]["grads"][name] for i in range(ep)])
        else:
            got = ranks[0]["grads"][name]
        assert rel_err(got, g_ref) < tol, (name, seed)


def test_packed_context_parallel_through_the_compiled_core(monkeypatch):
    # The GPU path (compiled core pieces with their reset masks, the masked conv with halos, the
    # gated norm) under CP 2; on CPU the graphs run through the partitioner inductor uses, in
    # every spawned rank.
    monkeypatch.setenv("LONGMOE_FORCE_COMPILE", "aot_eager_decomp_partition")
    seed = random.randrange(2**31)
    run = _run(cp=2, ep=1, gated_delta="chunked_compiled")
    ranks = run_ranks(_cp_rank, 2, run, seed)
    monkeypatch.delenv("LONGMOE_FORCE_COMPILE")
    ref = _reference(run, seed)
    tol = 5 * TOLERANCE[torch.float32]
    for name, g_ref in ref["grads"].items():
        assert rel_err(ranks[0]["grads"][name], g_ref) < tol, (name, seed)
    lp = torch.zeros_like(ref["lp"])
    for r in ranks:
        lp[:, r["pos"]] = r["lp"]
    assert rel_err(lp[ref["real"]], ref["lp"][ref["real"]]) < tol, seed


class _LeakyShare:
    """A CP rank's share of packed rows that drops one restart: `attention` the document mask
    over the gathered keys (the whole rows' segments of unpacked rows), `conv` the conv's
    history (halos included), `state` the state restarts inside pieces. RoPE positions and the
    other two restarts stay the real share's."""

    def __init__(self, real, plain, leak):
        self.shape, self.positions = real.shape, real.positions
        self.whole = (plain if leak == "attention" else real).whole
        self.history = (plain if leak == "conv" else real).history
        self.starts = (plain if leak == "state" else real).starts


def _cp_leak_rank(rank, world, backend, run_dict, seed):
    from longmoe.model.deltanet import GatedDeltaNet
    from longmoe.model.packing import PackedRows
    from longmoe.parallel.context_parallel import local_packing, split_sequence, zigzag_positions
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    model = build_model(run, layout, backend.device(rank))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # mild decay (A < 1): a leaked state is still there tokens later
        for m in model.modules():
            if isinstance(m, GatedDeltaNet):
                m.A_log.copy_((torch.rand(m.A_log.shape, generator=gen) * 0.9 + 0.1).log())
    ids, labels, _, packing = packed_batch(ROWS, S, run.model.vocab_size, gen)
    pos = zigzag_positions(S, layout.cp, layout.cp_rank)
    ids, labels = (split_sequence(t, pos) for t in (ids, labels))
    real = local_packing(packing, layout.cp, layout.cp_rank)
    plain = local_packing(PackedRows.unpacked(*packing.shape), layout.cp, layout.cp_rank)
    out = {}
    with torch.no_grad():
        for leak in ("none", "attention", "conv", "state"):
            share = real if leak == "none" else _LeakyShare(real, plain, leak)
            out[leak] = model(ids, labels, packing=share)[0].double()
    return {"lp": out, "real": labels != -100}


@pytest.mark.slow  # the slow tier: four forward passes per rank
def test_leaks_across_boundaries_under_context_parallel_are_caught():
    # Each of the three restarts is needed under CP 2: dropping one changes the per-token
    # log-probs of the samples after a boundary (the check above would fail), while the row
    # holding one sample is unchanged.
    seed = random.randrange(2**31)
    run = _run(cp=2, ep=1)
    run["parallel"]["fsdp"] = False  # the ranks set each layer's A_log, whole
    ranks = run_ranks(_cp_leak_rank, 2, run, seed)
    for r in ranks:
        good, trained = r["lp"]["none"], r["real"]
        for leak in ("attention", "conv", "state"):
            bad = r["lp"][leak]
            assert rel_err(bad[0][trained[0]], good[0][trained[0]]) > 1e-2, (leak, seed)
            assert rel_err(bad[1], good[1]) < 5 * TOLERANCE[torch.float32], (leak, seed)
