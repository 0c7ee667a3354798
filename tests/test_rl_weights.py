"""Weights for a rollout engine: the buckets of every rank together are exactly what export_hf
writes (names, shapes, values), on 2 gloo ranks with EP 2 + FSDP2 and on one rank; each rank
sends only its share; buckets and the memory held stay within the bound; the receiving helper
names any mismatch."""

import math
import warnings

import pytest
import torch

from longmoe.errors import UserError

warnings.filterwarnings("ignore", message=".*flash-linear-attention.*")

BUCKET = 6 * 1024


def _run_dict(preset, num_layers, ep, fsdp):
    return {"model": {"preset": preset, "num_layers": num_layers},
            "parallel": {"ep": ep, "chunks": 2, "recompute": "none", "fsdp": fsdp},
            "data": {"batch_size": 2, "seq_len": 16, "prompt_len": 4, "group_size": 1},
            "train": {"seed": 5}}


def _largest_gathered(model, layout, senders):
    """Bytes of the largest tensors one gather step holds: a full parameter, or under "rank0"
    on rank 0 one layer's stack of every expert beside its own share of them; plus the largest
    local shard, which the all-gather copies (padded to an even split) and the collective may
    hold until its work object is released, a moment after the gather returns."""
    from torch.distributed.tensor import DTensor
    from longmoe.model.moe import GroupedExperts
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts)
                  for p in m.parameters()}
    most = shard = 0
    for p in model.parameters():
        n = p.numel() * p.element_size()  # a DTensor's numel is its full (gathered) size
        if id(p) in expert_ids and senders == "rank0":
            n *= layout.ep + 1
        most = max(most, n)
        if isinstance(p, DTensor) and p.dim():
            ways = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements)
                             if pl.is_shard())
            rows = -(-p.shape[0] // ways)  # the padded shard of an uneven dim-0 split
            shard = max(shard, rows * math.prod(p.shape[1:]) * p.element_size())
    return most + shard


def _drain(model, cfg, layout, dtype, senders):
    """Bucket sizes and the peak tensor bytes alive while draining, dropping each bucket before
    the next (the caller's side of the memory bound)."""
    from longmoe.paired.memtrack import TensorBytes
    from longmoe.rl.weights import named_weights_for_rollout
    sizes, mode = [], TensorBytes()
    with mode:
        for bucket in named_weights_for_rollout(model, cfg, layout, BUCKET, dtype, senders):
            sizes.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
            del bucket
    return sizes, mode.peak


def _collect(model, cfg, layout, dtype, senders):
    from longmoe.rl.weights import named_weights_for_rollout
    out = {}
    for bucket in named_weights_for_rollout(model, cfg, layout, BUCKET, dtype, senders):
        for k, t in bucket:
            assert k not in out, k
            out[k] = t.detach().cpu().clone()
    return out


def _weights_rank(rank, world, backend, run_dict, export_dir, dtype):
    from longmoe.model.hf import export_hf
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep)
    model = build_model(run, layout, backend.device(rank))
    export_hf(model, run.model, export_dir, dtype=dtype)
    res = {}
    for senders in ("owners", "rank0"):
        sizes, peak = _drain(model, run, layout, dtype, senders)
        res[senders] = {"sizes": sizes, "peak": peak,
                        "largest": _largest_gathered(model, layout, senders),
                        "tensors": _collect(model, run, layout, dtype, senders)}
    return res


def _exported(directory):
    import json
    from safetensors import safe_open
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for key, fname in index["weight_map"].items():
        with safe_open(str(directory / fname), "pt") as f:
            out[key] = f.get_tensor(key)
    return out


def _check_rank(res, rank, ep, exported):
    """Sizes within the bound; what this rank sent under each scheme."""
    for senders, r in res.items():
        for n, nbytes in r["sizes"]:
            assert nbytes <= BUCKET or n == 1, (senders, n, nbytes)
        sent = sum(b for _, b in r["sizes"])
        one = max([b for n, b in r["sizes"] if n == 1], default=0)  # a tensor alone: over BUCKET
        assert r["peak"] <= max(BUCKET, one) + r["largest"], (senders, rank, r["peak"], r["largest"])
        experts = [k for k in r["tensors"] if ".mlp.experts." in k]
        dense = [k for k in r["tensors"] if ".mlp.experts." not in k]
        if rank == 0:
            assert len(dense) == sum(".mlp.experts." not in k for k in exported), senders
        else:
            assert dense == [], senders
        if senders == "rank0" and rank > 0 or senders == "owners" and rank >= ep:
            assert r["tensors"] == {} and sent == 0, (senders, rank)
        elif senders == "owners":
            ids = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in experts}
            E = len({k.split(".mlp.experts.")[1].split(".")[0] for k in exported
                     if ".mlp.experts." in k})
            assert ids == set(range(rank * E // ep, (rank + 1) * E // ep)), (rank, sorted(ids))


def _union(ranks, senders):
    out = {}
    for r in ranks:
        for k, t in r[senders]["tensors"].items():
            assert k not in out, f"{k} sent by two ranks"
            out[k] = t
    return out


def _assert_same(got, exported):
    assert sorted(got) == sorted(exported)
    for k, t in exported.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k], t), k


@pytest.mark.parametrize("preset,num_layers,dtype", [("tiny", 2, torch.float32),
                                                     ("tiny-hybrid", 4, torch.bfloat16)])
def test_buckets_equal_export_on_two_ranks(preset, num_layers, dtype, tmp_path):
    from longmoe.paired.spawn import run_ranks
    ranks = run_ranks(_weights_rank, 2, _run_dict(preset, num_layers, 2, True),
                      str(tmp_path), dtype)
    exported = _exported(tmp_path)
    for rank, res in enumerate(ranks):
        _check_rank(res, rank, 2, exported)
    for senders in ("owners", "rank0"):
        _assert_same(_union(ranks, senders), exported)
        assert len(ranks[0][senders]["sizes"]) > 2  # the bucket size splits the model


def test_buckets_equal_export_on_one_rank(tmp_path):
    from longmoe.backends import get_backend
    backend = get_backend("cpu")
    res = _weights_rank(0, 1, backend, _run_dict("tiny-hybrid", 4, 1, False), str(tmp_path),
                        torch.float32)
    exported = _exported(tmp_path)
    _check_rank(res, 0, 1, exported)
    for senders in ("owners", "rank0"):
        _assert_same(res[senders]["tensors"], exported)


def _model_and_buckets():
    from longmoe.config import get_preset
    from longmoe.model.transformer import MoETransformer
    from longmoe.parallel.mesh import Layout
    from longmoe.rl.weights import named_weights_for_rollout
    cfg = get_preset("tiny").replace(num_layers=1)
    m = MoETransformer(cfg)
    m.init_weights(1)
    buckets = [list(b) for b in named_weights_for_rollout(m, cfg, Layout(1, 0, 1, None, None, None),
                                                          BUCKET)]
    return cfg, buckets


def _receiver(buckets, cfg):
    """A module whose parameter names are the buckets' keys with each layer's experts fused
    (gate_up_proj [E, 2F, H], down_proj [E, H, F]), the way transformers stores them."""
    from longmoe.model.hf import hf_config
    root = torch.nn.Module()
    root.config = hf_config(cfg)  # what load_into_hf_model checks before copying
    E, F, H = cfg.num_experts, cfg.moe_ffn_size, cfg.hidden_size

    def put(path, tensor):
        mod = root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(tensor))

    for b in buckets:
        for k, t in b:
            if ".mlp.experts." not in k:
                put(k, torch.zeros_like(t))
    for i in range(cfg.num_layers):
        put(f"model.layers.{i}.mlp.experts.gate_up_proj", torch.zeros(E, 2 * F, H))
        put(f"model.layers.{i}.mlp.experts.down_proj", torch.zeros(E, H, F))
    return root


def test_load_into_fused_receiver_and_mismatches_name_the_tensor():
    from longmoe.rl.weights import load_into_hf_model
    cfg, buckets = _model_and_buckets()
    flat = dict(kv for b in buckets for kv in b)
    recv = _receiver(buckets, cfg)
    assert load_into_hf_model(recv, buckets, cfg) == len(flat)
    params = dict(recv.named_parameters())
    fused = params["model.layers.0.mlp.experts.gate_up_proj"]
    F = cfg.moe_ffn_size
    for e in range(cfg.num_experts):
        k = f"model.layers.0.mlp.experts.{e}."
        assert torch.equal(fused[e, :F], flat[k + "gate_proj.weight"])
        assert torch.equal(fused[e, F:], flat[k + "up_proj.weight"])
        assert torch.equal(params["model.layers.0.mlp.experts.down_proj"][e],
                           flat[k + "down_proj.weight"])
    assert torch.equal(params["lm_head.weight"], flat["lm_head.weight"])

    def without(pred):
        return [[(k, t) for k, t in b if not pred(k)] for b in buckets]

    with pytest.raises(UserError, match=r"no tensor was sent for model\.norm\.weight"):
        load_into_hf_model(_receiver(buckets, cfg), without(lambda k: k == "model.norm.weight"),
                           cfg)
    with pytest.raises(UserError, match=r"gate_up_proj: expert 3 was not sent"):
        load_into_hf_model(_receiver(buckets, cfg),
                           without(lambda k: k == "model.layers.0.mlp.experts.3.up_proj.weight"),
                           cfg)
    bad = [[(k, t[:-1] if k == "lm_head.weight" else t) for k, t in b] for b in buckets]
    V, H = cfg.vocab_size, cfg.hidden_size
    with pytest.raises(UserError, match=rf"lm_head\.weight has shape \({V - 1}, {H}\), the "
                                        rf"model needs \({V}, {H}\)"):
        load_into_hf_model(_receiver(buckets, cfg), bad, cfg)
    extra = buckets + [[("model.layers.9.mlp.gate.weight", torch.zeros(2))]]
    with pytest.raises(UserError, match=r"has no parameter model\.layers\.9\.mlp\.gate\.weight"):
        load_into_hf_model(_receiver(buckets, cfg), extra, cfg)
    with pytest.raises(UserError, match="sent twice"):
        load_into_hf_model(_receiver(buckets, cfg), buckets + buckets[:1], cfg)


def test_bad_arguments():
    from longmoe.rl.weights import named_weights_for_rollout
    cfg, _ = _model_and_buckets()
    from longmoe.model.transformer import MoETransformer
    from longmoe.parallel.mesh import Layout
    m = MoETransformer(cfg)
    lay = Layout(1, 0, 1, None, None, None)
    with pytest.raises(UserError, match="bucket_bytes must be a positive int"):
        named_weights_for_rollout(m, cfg, lay, 0)
    with pytest.raises(UserError, match="senders must be one of owners, rank0"):
        named_weights_for_rollout(m, cfg, lay, BUCKET, senders="all")


def test_weight_sync_bench_smoke(tmp_path):
    from longmoe.bench.weight_sync import markdown_table, run_bench
    r = run_bench(None, ["model.preset=tiny-hybrid"], 0.01, "bfloat16", 1, str(tmp_path / "x"))
    exported = _exported(tmp_path / "x")
    assert r["tensors"] == len(exported)
    assert r["bytes_per_rank"] == r["receive_buffer_bytes"] == sum(
        t.numel() * t.element_size() for t in exported.values())
    assert r["buckets"] > 1 and r["handoff_s"] > 0 and r["export_hf_s"] > 0
    assert "tiny-hybrid" in markdown_table(r)


def test_weight_sync_bench_on_two_ranks_sends_each_tensor_once():
    """`--nproc 2` at EP 2 on gloo: each rank sends what it owns (rank 1 only its experts), and
    the two ranks together send exactly the one-rank hand-off's tensors and bytes."""
    from longmoe.bench.weight_sync import markdown_table, run_bench
    from longmoe.errors import UserError
    sets = ["model.preset=tiny-hybrid", "parallel.ep=2"]
    one = run_bench(None, sets[:1], 0.01, "bfloat16", 1, None, export=False)
    two = run_bench(None, sets, 0.01, "bfloat16", 1, None, export=False, nproc=2)
    assert len(two["bytes_per_rank"]) == 2 and min(two["bytes_per_rank"]) > 0
    assert two["bytes_per_rank"][0] > two["bytes_per_rank"][1]      # rank 0 also sends dense
    assert two["bytes_total"] == one["bytes_total"] == one["bytes_per_rank"]
    assert two["tensors"] == one["tensors"]
    assert "export_hf_s" not in two and "| 2 |" in markdown_table(two)
    assert "| 1 | 0.000 |" in markdown_table(two)   # the per-rank rows
    with pytest.raises(UserError, match="--nproc: 3 ranks cannot hold"):
        run_bench(None, sets, 0.01, "bfloat16", 1, None, export=False, nproc=3)
