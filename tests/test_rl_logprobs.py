"""Forward-only log-probs against transformers after a weight hand-off: a longmoe model on 2 gloo
ranks (EP 2 + FSDP2) hands its weights to a transformers model through the buckets, and
transformers' per-token log-probs and entropy then equal compute_logprobs' on every rank's batch
(the check an RL loop runs after each hand-off). Plus packed rows and bad batches."""

import random
import warnings

import pytest
import torch

from longmoe.errors import UserError

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*flash-linear-attention.*")

from test_hf import _tiny_hf  # noqa: E402  (the tiny transformers models, no hub download)


def _batch(seed, vocab, B=2, S=19):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    labels[0, :3] = -100  # a prompt: no label
    return ids, labels


def _hf_logprobs(hf, ids, labels):
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.double(), -1)
    lp = logp.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    keep = labels != -100
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


def _rank(rank, world, backend, run_dict, seed):
    from longmoe.parallel.mesh import build_layout
    from longmoe.rl.logprobs import compute_logprobs
    from longmoe.rl.weights import named_weights_for_rollout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep)
    model = build_model(run, layout, backend.device(rank))
    ids, labels = _batch(seed + rank, run.model.vocab_size)
    lp, ent = compute_logprobs(model, ids, labels, with_entropy=True)
    buckets = [[(k, t.cpu().clone()) for k, t in b]
               for b in named_weights_for_rollout(model, run, layout, 8192, senders="rank0")]
    return {"ids": ids, "labels": labels, "lp": lp, "ent": ent, "buckets": buckets}


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_transformers_after_hand_off_matches_compute_logprobs(kind, tmp_path):
    from longmoe.paired.spawn import run_ranks
    from longmoe.rl.weights import load_into_hf_model
    seed = random.randrange(1000)
    _tiny_hf(kind, seed).save_pretrained(tmp_path)  # the architecture; its weights are not used
    # longmoe's default init (std 0.02): small q/k, where an l2norm formula other than
    # transformers' (x * rsqrt(|x|^2 + 1e-6)) shows at 1e-3.
    run = {"model": {"hf_config": str(tmp_path / "config.json")},
           "parallel": {"ep": 2, "chunks": 2, "recompute": "full", "fsdp": True},
           "impl": {"gated_delta": "chunked"},
           "data": {"batch_size": 4, "seq_len": 19, "prompt_len": 3, "group_size": 1},
           "train": {"seed": seed + 1}}  # longmoe's own init: the hand-off must carry it over
    ranks = run_ranks(_rank, 2, run, seed)
    assert ranks[1]["buckets"] == []  # everything through rank 0
    hf = _tiny_hf(kind, seed + 2)
    before, _ = _hf_logprobs(hf, ranks[0]["ids"], ranks[0]["labels"])
    assert (before - ranks[0]["lp"].double()).abs().max() > 1e-2  # not already equal
    from longmoe.train.config import from_dict
    load_into_hf_model(hf, ranks[0]["buckets"], from_dict(run))
    for r in ranks:
        lp, ent = _hf_logprobs(hf, r["ids"], r["labels"])
        torch.testing.assert_close(r["lp"].double(), lp, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r["ent"].double(), ent, rtol=1e-4, atol=1e-4)
        assert (r["lp"][r["labels"] == -100] == 0).all()
        assert (r["lp"] <= 0).all()


def _one_rank_model(preset="tiny-hybrid"):
    from longmoe.config import get_preset
    from longmoe.model.transformer import MoETransformer
    cfg = get_preset(preset)
    m = MoETransformer(cfg)
    m.init_weights(3)
    for mod in m.modules():
        if hasattr(mod, "impl") and type(mod).__name__ == "GatedDeltaNet":
            mod.impl = "chunked"
    return m


def test_packed_rows_match_separate_samples():
    from longmoe.model.packing import PackedRows
    from longmoe.rl.logprobs import compute_logprobs
    m = _one_rank_model()
    V = m.cfg.vocab_size
    lengths = [7, 10]
    samples = [_batch(20 + i, V, B=1, S=n) for i, n in enumerate(lengths)]
    S = sum(lengths) + 3  # padding after the samples
    ids = torch.zeros(1, S, dtype=torch.long)
    labels = torch.full((1, S), -100)
    at = 0
    for (i, l), n in zip(samples, lengths):
        ids[0, at:at + n], labels[0, at:at + n] = i[0], l[0]
        at += n
    packing = PackedRows.from_lengths([lengths], S)
    lp, ent = compute_logprobs(m, ids, labels, packing=packing, with_entropy=True)
    at = 0
    for (i, l), n in zip(samples, lengths):
        lp1, ent1 = compute_logprobs(m, i, l, with_entropy=True)
        torch.testing.assert_close(lp[0, at:at + n], lp1[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[0, at:at + n], ent1[0], rtol=1e-5, atol=1e-5)
        at += n
    assert (lp[0, at:] == 0).all()
    assert not torch.is_grad_enabled() or lp.grad_fn is None


def test_bad_batches_name_the_field():
    from longmoe.model.packing import PackedRows
    from longmoe.rl.logprobs import compute_logprobs
    m = _one_rank_model("tiny")
    V = m.cfg.vocab_size
    ids, labels = _batch(0, V)
    bad = ids.clone()
    bad[1, 4] = V
    with pytest.raises(UserError, match=rf"input_ids\[1, 4\]={V} is outside the vocabulary"):
        compute_logprobs(m, bad, labels)
    bad = labels.clone()
    bad[0, 5] = -3
    with pytest.raises(UserError, match=r"labels\[0, 5\]=-3 is outside"):
        compute_logprobs(m, ids, bad)
    with pytest.raises(UserError, match=r"labels \(2, 18\) and input_ids \(2, 19\) differ"):
        compute_logprobs(m, ids, labels[:, :-1])
    with pytest.raises(UserError, match="input_ids must be an integer tensor"):
        compute_logprobs(m, ids.float(), labels)
    with pytest.raises(UserError, match=r"positions \(5,\) must be \[19\]"):
        compute_logprobs(m, ids, labels, positions=torch.arange(5))
    with pytest.raises(UserError, match="packing .* does not match"):
        compute_logprobs(m, ids, labels, packing=PackedRows.from_lengths([[4], [4]], 8))


def test_logprobs_bench_smoke():
    """The bench times both modes over the same micro-batches of a packed step, and leaves no
    gradient behind (its training passes are not a step)."""
    from longmoe.bench.logprobs import markdown_table, run_bench
    r = run_bench(None, ["model.preset=tiny-hybrid", "data.seq_len=96", "data.prompt_len=6",
                         "data.batch_size=4", "data.packing=true",
                         "data.max_tokens_per_micro_batch=96",
                         "data.response_len=lognormal:30:80"], 1)
    assert set(r["modes"]) == {"train", "logprobs", "logprobs+entropy"}
    assert r["packing"] and r["micro_batches"] >= 1 and r["trained_tokens"] > 0
    for m in r["modes"].values():
        assert m["s"] > 0 and m["tokens_per_s"] == pytest.approx(r["trained_tokens"] / m["s"])
    assert "logprobs+entropy" in markdown_table(r)


def test_host_checked_ids_skip_the_device_reads():
    """check_values=False (PolicyTrainer, which range-checks token ids on the host before the
    copy) reads no token id back: the range reductions and their host reads are gone, shapes
    are still checked, and the log-probs are the same."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from longmoe.rl.logprobs import compute_logprobs
    m = _one_rank_model("tiny")
    ids, labels = _batch(0, m.cfg.vocab_size)

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.any.default, torch.ops.aten._local_scalar_dense.default,
                               torch.ops.aten.is_nonzero.default)
            return func(*args, **(kwargs or {}))

    got = {}
    for values in (True, False):
        with Reads() as reads:
            lp, _ = compute_logprobs(m, ids, labels, check_values=values)
        got[values] = (reads.n, lp)
    assert got[True][0] - got[False][0] >= 2, {k: v[0] for k, v in got.items()}
    torch.testing.assert_close(got[True][1], got[False][1], rtol=0, atol=0)
    with pytest.raises(UserError, match="labels .* differ"):
        compute_logprobs(m, ids, labels[:, :-1], check_values=False)
