"""Weights handed to transformers compute what longmoe computes, or are refused by field: for every
shipped preset and recipe (the big ones cut to tiny widths with the same flags), the log-probs of a
transformers model after the hand-off (named_weights_for_rollout -> load_into_hf_model) and after
export_hf -> from_pretrained equal PolicyTrainer.compute_logprobs (fp32, 1e-4), at a non-default
init_std and after optimizer steps that move every weight, the norms included. Dropping the RMSNorm
conversion makes them differ; a config no architecture computes is refused in one line naming the
field; float fields stay floats through --set and config.json."""

import dataclasses
import json
import warnings

import pytest
import torch

from longmoe.errors import ConfigError, UserError

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*flash-linear-attention.*")
warnings.filterwarnings("ignore", message=".*fast path is not available.*")

TOL = 1e-4
P, R, N = 4, 12, 3  # prompt and response tokens of each of N samples


def _hf_classes():
    """(config class, model class) per model type."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
    return {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
            "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)}


def _cut(cfg):
    """`cfg` at tiny widths, its flags kept (norm offset, q/k norm, output gate, shared expert or
    none, partial rotary, rope theta, eps, the first layers' kinds), init_std 0.2."""
    n = 4 if "linear_attention" in cfg.layer_types else 2
    return cfg.replace(vocab_size=96, hidden_size=32, num_layers=n,
                       layer_types=cfg.layer_types[:n], num_heads=4, num_kv_heads=2, head_dim=16,
                       num_experts=8, top_k=2, moe_ffn_size=16,
                       shared_expert_ffn_size=24 if cfg.shared_expert_ffn_size else 0,
                       max_seq_len=64, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=8, init_std=0.2)


def _case(name):
    from longmoe.config import get_preset
    from longmoe.train.config import load_run_config
    kind, _, what = name.partition(":")
    if kind == "preset":
        return _cut(get_preset(what))
    if kind == "recipe":
        return _cut(load_run_config(what).model)
    # qwen3_moe written from a zero-centred (1 + w) model: the other conversion direction
    return _cut(get_preset("qwen3-30b-a3b")).replace(norm_unit_offset=True)


NAMES = ["preset:tiny", "preset:tiny-hybrid", "preset:qwen3-30b-a3b", "preset:qwen3.5-35b-a3b",
         "recipe:cpu_demo", "recipe:gpu_smoke", "recipe:h100_qwen35_128k",
         "recipe:mi300x_qwen35_128k", "offset:qwen3"]


def _unique_cases():
    """One case per distinct model config (cpu_demo is tiny's; the 128K recipes are the
    Qwen3.5 preset's), named after everything it covers."""
    by_cfg: dict = {}
    for name in NAMES:
        by_cfg.setdefault(_case(name), []).append(name)
    return [pytest.param(cfg, id="+".join(names)) for cfg, names in by_cfg.items()]


def _trainer(model_cfg, seed=0):
    from longmoe.api.policy import PolicyTrainer
    from longmoe.train.config import RunConfig, from_dict
    run = from_dict({"parallel": {"ep": 1, "fsdp": False, "chunks": 1},
                     "impl": {"linear_ce": "chunked", "gated_delta": "chunked"},
                     "data": {"max_tokens_per_micro_batch": 64},
                     "optim": {"lr": 0.05, "grad_clip": 0.0},
                     "train": {"seed": seed, "device": "cpu"}})
    return PolicyTrainer(RunConfig(**{**{f.name: getattr(run, f.name)
                                         for f in dataclasses.fields(run)}, "model": model_cfg}))


def _samples(vocab, seed, old=None):
    from longmoe.data.sample import Sample
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, vocab, (P,), generator=g),
                   torch.randint(0, vocab, (R,), generator=g), float(torch.randn(1, generator=g)),
                   old_logprobs=None if old is None else old[i], index=i) for i in range(N)]


@torch.no_grad()
def _hf_logprobs(hf, samples):
    ids = torch.stack([torch.cat([s.prompt, s.response]) for s in samples])
    logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, P - 1:-1]
    return logp.gather(-1, ids[:, P:, None])[..., 0]


def _receiver(cfg):
    from longmoe.model.hf import hf_config
    conf = hf_config(cfg, "float32")
    Conf, Model = _hf_classes()[conf["model_type"]]
    return Model(Conf(**{k: v for k, v in conf.items()
                         if k not in ("model_type", "architectures")})).eval()


def _diffs(pt, samples, tmp, tag):
    """max |transformers - ours| after the hand-off and after export + from_pretrained."""
    from longmoe.rl.weights import load_into_hf_model
    ours = torch.stack(pt.compute_logprobs(samples))
    hf = _receiver(pt.run.model)
    load_into_hf_model(hf, pt.named_weights_for_rollout(4096), pt.run)
    handed = (_hf_logprobs(hf, samples) - ours).abs().max().item()
    pt.export_hf(tmp / tag)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp / tag).eval()
    assert next(back.parameters()).dtype == torch.float32
    exported = (_hf_logprobs(back, samples) - ours).abs().max().item()
    return handed, exported, ours


def _train(pt, steps, seed):
    for k in range(steps):
        lp = pt.compute_logprobs(_samples(pt.run.model.vocab_size, seed + k))
        pt.forward_backward(_samples(pt.run.model.vocab_size, seed + k, old=lp))
        info = pt.optim_step()
        assert info["skipped"] is None


@pytest.mark.parametrize("cfg", _unique_cases())
def test_handoff_and_export_match_compute_logprobs(cfg, tmp_path):
    from longmoe.model.hf_compat import is_offset_norm
    case = cfg.source
    pt = _trainer(cfg)
    samples = _samples(cfg.vocab_size, 100)
    handed, exported, _ = _diffs(pt, samples, tmp_path, "init")
    assert handed <= TOL and exported <= TOL, (case, "init", handed, exported)
    before = {n: p.detach().clone() for n, p in pt.model.named_parameters()}
    _train(pt, 3, 7)
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in pt.model.named_parameters()}
    norms = [v for n, v in moved.items() if is_offset_norm(n)]
    assert len(norms) >= 2 * cfg.num_layers + 1 and min(norms) > 0.05, (case, moved)
    assert min(moved.values()) > 0.01, moved  # every weight moved, the router and experts too
    handed, exported, ours = _diffs(pt, samples, tmp_path, "trained")
    assert ours.isfinite().all() and (ours < 0).all()
    assert handed <= TOL and exported <= TOL, (case, "trained", handed, exported)


def test_offset_norm_names_are_our_rmsnorms():
    """hf_compat's list of norm_unit_offset norms is exactly the model's RMSNorm weights (the
    Gated DeltaNet's gated norm is plain w on both sides and stays out)."""
    from longmoe.model.hf_compat import is_offset_norm
    from longmoe.model.layers import RMSNorm
    from longmoe.model.transformer import MoETransformer
    m = MoETransformer(_case("preset:tiny-hybrid"))
    norms = {f"{n}.weight" for n, mod in m.named_modules() if isinstance(mod, RMSNorm)}
    assert {n for n, _ in m.named_parameters() if is_offset_norm(n)} == norms
    assert any(n.endswith("attn.norm.weight") for n, _ in m.named_parameters())


@pytest.mark.parametrize("case", ["preset:tiny", "offset:qwen3"])
def test_dropping_the_norm_conversion_is_caught(case, tmp_path, monkeypatch):
    """The mutant: hand weights over unconverted (the old behaviour). The same comparison the
    parity test makes then differs by far more than its tolerance."""
    from longmoe.model import hf_compat
    pt = _trainer(_case(case))
    real = hf_compat._target
    monkeypatch.setattr(hf_compat, "_target",
                        lambda cfg: dataclasses.replace(real(cfg), norm_shift=0.0))
    handed, exported, _ = _diffs(pt, _samples(pt.run.model.vocab_size, 100), tmp_path, "m")
    assert handed > 1e-2 and exported > 1e-2, (handed, exported)


# ---- refused -------------------------------------------------------------------------------

REFUSED = [("preset:tiny", dict(qk_norm=False), "model.qk_norm"),
           ("preset:qwen3-30b-a3b", dict(shared_expert_ffn_size=24), "model.attn_output_gate"),
           ("preset:tiny-hybrid", dict(shared_expert_ffn_size=0), "model.shared_expert_ffn_size"),
           ("preset:tiny", dict(norm_topk_prob=False), "model.norm_topk_prob"),
           ("preset:qwen3-30b-a3b", dict(partial_rotary_factor=0.5),
            "model.partial_rotary_factor")]


@pytest.mark.parametrize("case,change,field", REFUSED)
def test_inexpressible_config_is_refused_naming_the_field(case, change, field, tmp_path):
    from longmoe.model.hf import hf_config
    from longmoe.train.config import load_run_config
    from longmoe.train.launch import validate
    cfg = _case(case).replace(**change)
    pt = _trainer(cfg)
    for call in (lambda: hf_config(cfg), lambda: pt.export_hf(tmp_path / "x"),
                 lambda: pt.named_weights_for_rollout(4096)):
        with pytest.raises(ConfigError) as ei:
            call()
        assert ei.value.field == field and "\n" not in str(ei.value), str(ei.value)
        assert str(ei.value).startswith(field + ":")
    assert not (tmp_path / "x").exists()
    # the CLI's train.export_hf: refused by the checks that run before any process starts
    sets = [f"model.{k}={json.dumps(v)}" for k, v in change.items()]
    base = "cpu_demo" if case == "preset:tiny" else None
    run = load_run_config(base, sets + ["train.export_hf=out", "train.device=cpu"] +
                          ([] if base else [f"model.preset={case.split(':')[1]}",
                                            "model.num_layers=4"]))
    with pytest.raises(ConfigError, match=f"^{field}:"):
        validate(run, 2 if base else 1)


def test_trained_expert_bias_is_refused(tmp_path):
    from longmoe.model.moe import Router
    pt = _trainer(_case("preset:tiny").replace(expert_bias_rate=0.01))
    pt.export_hf(tmp_path / "zero")  # a bias equal for every expert routes the same
    routers = [m for m in pt.model.modules() if isinstance(m, Router)]
    routers[0].expert_bias[0] = 0.01
    for call in (lambda: pt.export_hf(tmp_path / "x"), lambda: pt.named_weights_for_rollout(64)):
        with pytest.raises(UserError, match=r"model\.expert_bias_rate") as ei:
            call()
        assert "\n" not in str(ei.value)


def test_receiver_with_another_config_is_refused_before_copying():
    from longmoe.rl.weights import load_into_hf_model
    cfg = _case("preset:tiny")
    pt = _trainer(cfg)
    hf = _receiver(cfg.replace(rms_norm_eps=1e-5))
    before = {n: p.clone() for n, p in hf.named_parameters()}
    with pytest.raises(UserError, match=r"^load_into_hf_model: the receiver's config has "
                                        r"rms_norm_eps=1e-05; model\.rms_norm_eps is 1e-06$"):
        load_into_hf_model(hf, pt.named_weights_for_rollout(4096), pt.run)
    assert all(torch.equal(p, before[n]) for n, p in hf.named_parameters())
    hf.config.rope_parameters["partial_rotary_factor"] = 0.25
    hf.config.rms_norm_eps = 1e-6
    with pytest.raises(UserError, match=r"rope_parameters\.partial_rotary_factor=0\.25; "
                                        r"model\.partial_rotary_factor is 0\.5$"):
        load_into_hf_model(hf, pt.named_weights_for_rollout(4096), pt.run)
    other = _receiver(_case("preset:qwen3-30b-a3b"))
    with pytest.raises(UserError, match=r"receiver is 'qwen3_moe'; this policy computes "
                                        r"qwen3_5_moe_text \(chosen by "
                                        r"model\.shared_expert_ffn_size\)"):
        load_into_hf_model(other, pt.named_weights_for_rollout(4096), pt.run)
    with pytest.raises(UserError, match="receiver has no config"):
        load_into_hf_model(torch.nn.Linear(2, 2), [], pt.run)


# ---- import --------------------------------------------------------------------------------

def test_load_hf_inverts_the_export(tmp_path):
    """An export read back gives the same weights (the RMSNorm conversion undone); a checkpoint
    of the other architecture is refused naming the field that chose ours."""
    from longmoe.model.hf import export_hf, load_hf
    from longmoe.model.transformer import MoETransformer
    for case in ("preset:tiny", "offset:qwen3"):
        cfg = _case(case)
        a = MoETransformer(cfg)
        a.init_weights(1)
        with torch.no_grad():
            for n, p in a.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn(p.shape) * 0.1)
        export_hf(a, cfg, tmp_path / case, dtype=torch.float32)
        b = MoETransformer(cfg)
        load_hf(b, tmp_path / case)
        for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            torch.testing.assert_close(pb, pa, rtol=0, atol=1e-6, msg=n)
    with pytest.raises(UserError, match=r"model_type 'qwen3_moe'; the model config computes "
                                        r"qwen3_5_moe_text \(chosen by "
                                        r"model\.shared_expert_ffn_size\)"):
        load_hf(MoETransformer(_case("preset:tiny")), tmp_path / "offset:qwen3")
    # train.init_hf: the same check before any rank starts
    from longmoe.train.config import load_run_config
    from longmoe.train.launch import check_hf_init
    run = load_run_config(None, [f"train.init_hf={tmp_path / 'offset:qwen3'}"])
    with pytest.raises(UserError, match=r"model_type 'qwen3_moe'; the model config computes"):
        check_hf_init(dataclasses.replace(run, model=_case("preset:tiny")))
    check_hf_init(dataclasses.replace(run, model=_case("offset:qwen3")))
    # same sizes, another function: refused by the field, not trained silently
    for field, value in (("rope_theta", 12345.0), ("rms_norm_eps", 1e-3),
                         ("norm_topk_prob", False)):
        other = _case("offset:qwen3").replace(**{field: value})
        with pytest.raises(UserError, match=rf"train\.init_hf: .* has {field}=.*, the run's model "
                                            rf"has {value!r}"):
            check_hf_init(dataclasses.replace(run, model=other))


# ---- declared types ------------------------------------------------------------------------

def test_whole_number_overrides_stay_floats_and_export_loads(tmp_path):
    from longmoe.train.config import load_run_config
    run = load_run_config("cpu_demo", ["model.router_aux_loss_coef=0", "model.rms_norm_eps=1",
                                       "model.rope_theta=10000"])
    m = run.model
    assert [type(v) for v in (m.router_aux_loss_coef, m.rms_norm_eps, m.rope_theta)] == [float] * 3
    pt = _trainer(_cut(m).replace(init_std=0.02))
    pt.export_hf(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert isinstance(conf["router_aux_loss_coef"], float) and conf["rms_norm_eps"] == 1.0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config.router_aux_loss_coef == 0.0 and back.config.rms_norm_eps == 1.0
    samples = _samples(pt.run.model.vocab_size, 3)
    ours = torch.stack(pt.compute_logprobs(samples))
    assert (_hf_logprobs(back, samples) - ours).abs().max().item() <= TOL
