"""Router replay: a token's experts given per MoE layer (the rollout engine's routing, or the
trainer's own recorded in an earlier forward) replace the router's top-k, weighted by the
router's own probabilities for them; -1 leaves a token to the router. Checked: the router
against its definition, a forward replaying its own recorded routes is bit for bit the plain one
(log-probs, loss, gradients), routes follow their samples through packing, truncation, context
parallelism and EP x FSDP2 ranks, and bad routes are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from longmoe.data.packing import pack_rows
from longmoe.data.sample import Sample
from longmoe.errors import UserError
from longmoe.paired.spawn import run_ranks
from longmoe.rl.logprobs import compute_logprobs

from _api_samples import make_samples, run_dict


def _trainer(d=None):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    return PolicyTrainer(from_dict(d or run_dict(4)))


def own_routes(pt, s: Sample) -> torch.Tensor:
    """The experts pt's model routes each token of `s` to, per layer: [len(s), layers, top_k]."""
    ids = torch.cat([s.prompt, s.response])[None]
    with pt.model.record_routes() as take:
        compute_logprobs(pt.model, ids, torch.full_like(ids, -100))
        return take(1, ids.shape[1])[0]


def foreign_routes(pt, s: Sample, seed: int) -> torch.Tensor:
    """Random distinct experts per token and layer (another engine's routing)."""
    cfg = pt.run.model
    g = torch.Generator().manual_seed(seed)
    return torch.rand(len(s), cfg.num_layers, cfg.num_experts, generator=g).argsort(-1)[
        ..., :cfg.top_k]


def test_router_takes_the_replayed_experts_with_its_own_probabilities():
    from longmoe.config import get_preset
    from longmoe.model.moe import Router
    cfg = get_preset("tiny").replace(num_experts=8, top_k=3)
    r = Router(cfg)
    torch.nn.init.normal_(r.weight, std=0.5)
    x = torch.randn(11, cfg.hidden_size)
    idx0, w0, p0 = r(x)
    replay = torch.rand(11, 8).argsort(-1)[:, :3]
    replay[::4] = -1                                   # these tokens: the router's own choice
    idx, w, p = r(x, replay)
    keep = replay[:, 0] < 0
    assert torch.equal(idx[keep], idx0[keep]) and torch.equal(idx[~keep], replay[~keep])
    want = p.gather(1, idx)
    if cfg.norm_topk_prob:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(w, want, rtol=0, atol=0)
    torch.testing.assert_close(p, p0, rtol=0, atol=0)
    (g,) = torch.autograd.grad(w[~keep].sum() * 0 + (w * torch.randn_like(w)).sum(), [r.weight])
    assert bool(g.abs().sum() > 0)                     # the router still learns from replay


def test_replaying_own_routes_is_the_plain_forward_and_backward():
    pt, ref = _trainer(), _trainer()
    samples = make_samples(5, 4)
    mine = [dataclasses.replace(s, routed_experts=own_routes(pt, s)) for s in samples]
    lp, lp_mine = pt.compute_logprobs(samples), pt.compute_logprobs(mine)
    for a, b in zip(lp, lp_mine):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    out, out_mine = ref.forward_backward(samples), pt.forward_backward(mine)
    assert out["loss"] == out_mine["loss"]
    for (n, p), q in zip(ref.model.named_parameters(), pt.model.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


def test_compute_logprobs_records_the_routes_a_later_step_replays():
    """R2 through the API: compute_logprobs(with_routes=True) returns each token's experts
    (those of a forward of the sample alone), its log-probs unchanged; attached to the samples
    they make the next forward_backward the plain one."""
    pt, ref = _trainer(), _trainer()
    samples = make_samples(9, 5)
    lp, ent, routes = pt.compute_logprobs(samples, with_entropy=True, with_routes=True)
    lp0, ent0 = pt.compute_logprobs(samples, with_entropy=True)
    for a, b, c, d, r, s in zip(lp, lp0, ent, ent0, routes, samples):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(c, d, rtol=0, atol=0, equal_nan=True)
        assert r.dtype == torch.int16 and torch.equal(r.long(), own_routes(pt, s))
    replayed = [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, routes)]
    assert pt.forward_backward(replayed)["loss"] == ref.forward_backward(samples)["loss"]


def test_replayed_routes_follow_their_samples_through_packing():
    """Samples with foreign routes and without, packed together: each equals its own forward
    (alone in a row) with its routes; those without equal the plain forward."""
    pt = _trainer()
    samples = make_samples(6, 5)
    mixed = [dataclasses.replace(s, routed_experts=foreign_routes(pt, s, i)) if i % 2 else s
             for i, s in enumerate(samples)]
    together = pt.compute_logprobs(mixed)
    plain = pt.compute_logprobs(samples)
    changed = 0
    for i, s in enumerate(mixed):
        alone = pt.compute_logprobs([s])[0]
        torch.testing.assert_close(together[i], alone, atol=1e-6, rtol=0, equal_nan=True)
        if s.routed_experts is None:
            torch.testing.assert_close(together[i], plain[i], atol=1e-6, rtol=0, equal_nan=True)
        else:
            changed += not torch.allclose(together[i], plain[i], atol=1e-4, equal_nan=True)
    assert changed >= 1   # another router's experts change the log-probs


def test_pack_rows_and_truncation_carry_routes():
    g = torch.Generator().manual_seed(0)
    s = [Sample(torch.randint(0, 9, (p,), generator=g), torch.randint(0, 9, (r,), generator=g),
                advantage=0.0, routed_experts=torch.randint(0, 8, (p + r, 2, 2), generator=g))
         for p, r in ((2, 3), (1, 4))]
    pb = pack_rows([[s[0], dataclasses.replace(s[1], routed_experts=None)]], pad_multiple=4)
    assert pb.routed_experts.shape == (1, 12, 2, 2) and pb.routed_experts.dtype == torch.int16
    assert torch.equal(pb.routed_experts[0, :5].long(), s[0].routed_experts)
    assert bool((pb.routed_experts[0, 5:] == -1).all())    # no routes, and padding
    cut = s[1].truncated(3)
    assert torch.equal(cut.routed_experts, s[1].routed_experts[:3])
    assert pack_rows([[s[1].truncated(3)]]).routed_experts.shape[1] == 3


def _ranks_rank(rank, world, backend, d, samples):
    return _trainer(d).compute_logprobs(samples, with_routes=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"ep": 2, "fsdp": True}, {"cp": 2}])
def test_replay_on_two_ranks_equals_one_process(layout):
    """EP 2 x FSDP2 (each rank routes its own tokens) and CP 2 (each rank holds a zigzag slice
    of every row, its routes sliced alike) against one process."""
    d1 = run_dict(4)
    pt = _trainer(d1)
    samples = [dataclasses.replace(s, routed_experts=foreign_routes(pt, s, i))
               for i, s in enumerate(make_samples(8, 4))]
    want, want_routes = pt.compute_logprobs(samples, with_routes=True)
    # the replayed experts are what each token used; the ones left to the router (none here)
    # would be its own
    for s, r in zip(samples, want_routes):
        assert torch.equal(r.long(), s.routed_experts)
    for got, routes in run_ranks(_ranks_rank, 2, run_dict(4, **layout), samples):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, equal_nan=True)
        for a, b in zip(routes, want_routes):
            assert torch.equal(a, b)


@pytest.mark.parametrize("bad,match", [
    (lambda r: r[:-1], r"must be an integer tensor \[\d+, 2, 2\]"),
    (lambda r: r.float(), r"must be an integer tensor"),
    (lambda r: r.index_fill(0, torch.tensor([1]), 99), r"routed_experts\[1, 0, 0\]: 99 is not"),
    (lambda r: r.index_fill(0, torch.tensor([2]), -3), r"-3 is not an expert id"),
    (lambda r: torch.cat([r[:1, :, :1], torch.full_like(r[:1, :, :1], -1)], -1).expand(
        r.shape[0], -1, -1).contiguous(), r"all ids or all -1"),
    (lambda r: r[..., :1].expand(-1, -1, 2).contiguous(), r"repeats an expert"),
])
def test_bad_routes_are_refused_by_name(bad, match):
    pt = _trainer()
    s = make_samples(5, 1)[0]
    s = dataclasses.replace(s, routed_experts=bad(foreign_routes(pt, s, 0)))
    for call in (lambda: pt.compute_logprobs([s]), lambda: pt.forward_backward([s])):
        with pytest.raises(UserError, match=r"samples\[0\].*" + match):
            call()
