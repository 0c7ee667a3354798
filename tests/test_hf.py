"""Gated DeltaNet and Hugging Face checkpoints: the chunked gated delta rule against its token
recurrence, logits against transformers for both model types, export back into transformers,
a sharded (EP + FSDP2, 2 gloo ranks) load and export, and bad checkpoints."""

import json
import random
import warnings

import pytest
import torch

from longmoe.errors import ConfigError, UserError
from longmoe.ops.gated_delta import gated_delta_rule

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*flash-linear-attention.*")


def _gdn_inputs(seed, B, T, Hk, Hv, dk, dv, dtype, decay=2.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return (r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv),
            -torch.rand(B, T, Hv, generator=g, dtype=dtype) * decay,
            torch.rand(B, T, Hv, generator=g, dtype=dtype), r(B, Hv, dk, dv))


@pytest.mark.parametrize("T,Hk,Hv,with_state,decay", [
    (37, 2, 4, True, 2.0), (64, 1, 1, False, 2.0), (5, 2, 2, True, 2.0), (130, 2, 6, False, 2.0),
    # strong decay (g down to -40 per token, as exp(A_log) up to 16 gives): the regime where an
    # fp32 cumulative sum lost the gradient of g
    (48, 2, 4, True, 40.0)])
def test_chunked_gated_delta_matches_recurrence(T, Hk, Hv, with_state, decay):
    seed = random.randrange(2**31)
    q, k, v, g, beta, S0 = _gdn_inputs(seed, 2, T, Hk, Hv, 8, 6, torch.float32, decay)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, S0)]
    S0 = S0 if with_state else None
    outs = {}
    for impl in ("reference", "chunked"):
        o, S = gated_delta_rule(q, k, v, g, beta, S0, impl=impl)
        co = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed))
        cs = torch.randn(S.shape, generator=torch.Generator().manual_seed(seed + 1))
        grads = torch.autograd.grad((o * co).sum() + (S * cs).sum(), leaves, allow_unused=True)
        outs[impl] = (o, S, grads)
    (o1, s1, g1), (o2, s2, g2) = outs["reference"], outs["chunked"]
    torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
    torch.testing.assert_close(s2, s1, rtol=1e-4, atol=1e-4)
    for a, b, n in zip(g2, g1, "q k v g beta S0".split()):
        if b is not None:  # relative to the gradient's own size: strong decay makes it tiny
            err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            assert err < 1e-4, (n, err, seed)


def _tiny_hf(kind, seed=0):
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    if kind == "qwen3_5_moe":
        m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
            num_hidden_layers=4, shared_expert_intermediate_size=24, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, **common))
    else:
        m = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=2, norm_topk_prob=True, **common))
    with torch.no_grad():  # random everything (the default init leaves norms and router flat)
        for n, p in m.named_parameters():
            if "A_log" not in n and "dt_bias" not in n:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
            if kind == "qwen3_moe" and "norm" in n:
                p.add_(1.0)
    return m.eval()


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_moe"])
def test_logits_match_transformers_and_export_reloads(kind, tmp_path):
    from longmoe.config import from_hf_config
    from longmoe.model.hf import export_hf, load_hf
    from longmoe.model.transformer import MoETransformer
    hf = _tiny_hf(kind, random.randrange(1000))
    hf.save_pretrained(tmp_path / "in")
    cfg = from_hf_config(tmp_path / "in" / "config.json")
    assert ("linear_attention" in cfg.layer_types) == (kind == "qwen3_5_moe")
    ours = MoETransformer(cfg)
    load_hf(ours, tmp_path / "in")
    ids = torch.randint(0, cfg.vocab_size, (2, 41))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(ours.logits(ids), ref, rtol=1e-4, atol=1e-4)
    export_hf(ours, cfg, tmp_path / "out", dtype=torch.float32)
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_fused_expert_layout_loads(tmp_path):
    from safetensors.torch import load_file, save_file
    from longmoe.config import from_hf_config
    from longmoe.model.hf import load_hf
    from longmoe.model.transformer import MoETransformer
    hf = _tiny_hf("qwen3_moe")
    hf.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    cfg = from_hf_config(tmp_path / "config.json")
    a = MoETransformer(cfg)
    load_hf(a, tmp_path)
    fused = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        E = cfg.num_experts
        fused[p + "gate_up_proj"] = torch.stack([torch.cat([sd[p + f"{e}.gate_proj.weight"],
                                                            sd[p + f"{e}.up_proj.weight"]])
                                                 for e in range(E)])
        fused[p + "down_proj"] = torch.stack([sd[p + f"{e}.down_proj.weight"] for e in range(E)])
    save_file(fused, tmp_path / "model.safetensors")
    b = MoETransformer(cfg)
    load_hf(b, tmp_path)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n


def test_sharded_load_and_export_on_two_ranks(tmp_path):
    from safetensors import safe_open
    from longmoe.paired.hf_cases import load_export_case
    hf = _tiny_hf("qwen3_5_moe", 3)
    hf.save_pretrained(tmp_path / "in")
    ids = torch.randint(0, 96, (2, 24))
    labels = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    ranks = load_export_case(2, str(tmp_path / "in"), str(tmp_path / "out"), ids, labels)
    for r in ranks:  # EP=2 experts, FSDP2 over both ranks, full recompute, chunked EP
        torch.testing.assert_close(r["logprobs"].double(), ref, rtol=1e-4, atol=1e-4)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-dense.safetensors", "model-experts-00001-of-00002.safetensors",
                     "model-experts-00002-of-00002.safetensors"]
    with safe_open(str(tmp_path / "in" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(index["weight_map"])
        for key, fname in index["weight_map"].items():
            with safe_open(str(tmp_path / "out" / fname), "pt") as g:
                torch.testing.assert_close(g.get_tensor(key), f.get_tensor(key), msg=key)


def test_bad_checkpoints_name_file_and_tensor(tmp_path):
    from longmoe.config import from_hf_config, get_preset
    from longmoe.model.hf import export_hf, load_hf
    from longmoe.model.transformer import MoETransformer
    cfg = get_preset("tiny-hybrid")
    m = MoETransformer(cfg)
    m.init_weights(0)
    export_hf(m, cfg, tmp_path / "ok", dtype=torch.float32)
    index = json.loads((tmp_path / "ok" / "model.safetensors.index.json").read_text())
    # a shard listed in the index is missing
    shard = tmp_path / "ok" / "model-experts-00001-of-00001.safetensors"
    shard.rename(tmp_path / "moved")
    with pytest.raises(UserError, match="model-experts-00001-of-00001.safetensors listed in the "
                                        "index is missing"):
        load_hf(MoETransformer(cfg), tmp_path / "ok")
    (tmp_path / "moved").rename(shard)
    # a tensor whose shape does not match the config: nothing is copied
    other = MoETransformer(cfg.replace(moe_ffn_size=48))
    other.init_weights(1)
    before = {n: p.clone() for n, p in other.named_parameters()}
    with pytest.raises(UserError, match=r"layers\.0\.moe\.experts\.w_in has shape"):
        load_hf(other, tmp_path / "ok")
    assert all(torch.equal(before[n], p) for n, p in other.named_parameters())
    # unsupported model_type, unknown layer type
    conf = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**conf, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        from_hf_config(tmp_path / "ok" / "config.json")
    bad = {**conf, "layer_types": ["linear_attention", "mamba", "linear_attention",
                                   "full_attention"]}
    (tmp_path / "ok" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"model.layer_types\[1\].*'mamba'"):
        from_hf_config(tmp_path / "ok" / "config.json")
    assert len(index["weight_map"]) > 0
    with pytest.raises(UserError, match="is not a directory"):
        load_hf(MoETransformer(cfg), tmp_path / "nope")


@pytest.mark.needs_cuda
@pytest.mark.parametrize("decay", [2.0, 40.0])
def test_fla_gated_delta_on_gpu_matches_recurrence(decay):
    # The fast path where it exists (flash-linear-attention on a GPU): outputs, state, gradients.
    pytest.importorskip("fla.ops.gated_delta_rule")
    seed = random.randrange(2**31)
    q, k, v, g, beta, S0 = (t.cuda() for t in _gdn_inputs(seed, 2, 200, 2, 4, 64, 64,
                                                           torch.float32, decay))
    from longmoe.ops.gated_delta import _fla_check
    if (why := _fla_check(q, k, v, g, beta)) is not None:
        pytest.skip(why)  # the registry falls back to the chunked core here (tested on CPU)
    outs = {}
    for impl in ("reference", "fla"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        o, S = gated_delta_rule(*leaves, S0, impl=impl)
        grads = torch.autograd.grad(o.float().sum() + S.float().sum(), leaves)
        outs[impl] = (o.float(), S.float()) + grads
    for a, b, n in zip(outs["fla"], outs["reference"], "o S dq dk dv dg dbeta".split()):
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 2e-3, (n, err, seed)
