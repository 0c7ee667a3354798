"""The recipe planner and memory estimator: planner decisions per (model, hardware,
GPUs, sequence), estimator properties under hypothesis, bad input, the `recipe` command through
`longmoe.plan.cli.main`, the shipped recipes, the hardware data and the calibration table.
No torch and no process group: everything here is arithmetic and runs in a few seconds."""

from __future__ import annotations

import json
import re
import time
from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from longmoe.config import PRESETS, get_preset
from longmoe.errors import UserError
from longmoe.plan import calibration
from longmoe.plan.cli import main, run_config
from longmoe.plan.hardware import aliases, get_hardware, names, profiles
from longmoe.plan.memory import GiB, Layout, Workload, estimate, param_split
from longmoe.plan.planner import budget_bytes, grid, invalid_reason, plan
from longmoe.train.config import RECIPE_DIR, from_dict, load_run_config

Q35 = "qwen3.5-35b-a3b"
HYP = settings(max_examples=60, deadline=None)

# (model, hardware, gpus, seq_len) -> (tp, pp, ep, cp)
DECISIONS = {
    (Q35, "h100", 32, 131072): (1, 1, 8, 1),      # the seeds ran CP4 (32K local); 66.1 GiB fits
    (Q35, "h100", 16, 131072): (1, 1, 8, 4),      # CP1 would need 78.3 GiB: the 16K-32K window
    (Q35, "h100", 64, 131072): (1, 1, 8, 1),
    (Q35, "h100", 32, 262144): (1, 1, 8, 8),      # 32K local again
    (Q35, "mi300x", 8, 131072): (1, 1, 8, 1),     # the seeds' MI300X advice: no CP
    (Q35, "mi325x", 8, 131072): (1, 1, 8, 1),
    (Q35, "h200", 8, 131072): (1, 1, 8, 1),
    (Q35, "mi355x", 8, 262144): (1, 1, 8, 1),
    (Q35, "mi300x", 8, 262144): (1, 1, 8, 1),     # CP only once it truly overflows
    (Q35, "h200", 16, 262144): (1, 1, 8, 8),
    ("qwen3-30b-a3b", "h100", 16, 131072): (1, 1, 8, 4),
    ("qwen3-30b-a3b", "mi300x", 8, 131072): (1, 1, 8, 1),
    ("tiny", "h100", 1, 4096): (1, 1, 1, 1),       # EP bounded by the GPU count
    ("tiny", "mi300x", 2, 1024): (1, 1, 2, 1),
}


def _plan(model, hw, gpus, seq, **kw):
    return plan(get_preset(model), get_hardware(hw), gpus, Workload(seq, **kw), model_name=model)


@pytest.mark.parametrize("case", list(DECISIONS), ids=lambda c: "-".join(map(str, c)))
def test_planner_decisions(case):
    t0 = time.perf_counter()
    p = _plan(*case)
    # Only a pathological slowdown fails here (the planner takes ~0.2 s; CI shares 2 cores).
    assert time.perf_counter() - t0 < 20.0
    lay = p.layout
    assert (lay.tp, lay.pp, lay.ep, lay.cp) == DECISIONS[case]
    assert p.memory.peak <= p.budget_bytes
    assert set(p.reasons) >= {"tp", "pp", "ep", "cp", "recompute", "ep_chunks"}
    for k in ("tp", "pp", "ep", "cp"):
        assert p.reasons[k].startswith(f"{k.upper()}={getattr(lay, k)}")
    d = p.to_dict()
    assert {"tp", "pp", "ep", "cp", "recompute", "local_seq", "peak_bytes"} <= set(d)
    assert d["local_seq"] == case[3] // (lay.cp * lay.tp)


def test_h100_recipe_reasons_follow_the_seeds():
    # where the whole sequence does not fit (16 GPUs: 4 of the 256 experts' shards a rank more
    # than on 32), CP takes the seeds' 32K local window
    p = _plan(Q35, "h100", 16, 131072)
    assert "16K-32K window" in p.reasons["cp"] and "CP=1 needs" in p.reasons["cp"]
    assert p.local_seq == 32768 and p.workload.recompute == "full"
    # the seeds' final run (calibration.json), on 32 GPUs: the estimate for their layout with
    # the recipe's settings needs no more than it took, give or take the estimator's 10% (the
    # recipe may chunk EP finer, which needs less)
    final = calibration.point("+ chunked EP (final)")
    assert (final.layout.tp, final.layout.pp, final.layout.ep, final.layout.cp) == (1, 1, 8, 4)
    assert estimate(get_preset(Q35), final.layout, Workload(131072)).peak \
        <= 1.10 * final.measured_bytes


def test_forced_tp():
    p = plan(get_preset(Q35), get_hardware("h100"), 32, Workload(131072), tp=2)
    assert p.layout.tp == 2 and "forced" in p.reasons["tp"]
    assert p.local_seq == 131072 // (2 * p.layout.cp)


@HYP
@given(model=st.sampled_from(list(PRESETS)), hw=st.sampled_from(names()),
       nodes=st.sampled_from([1, 2, 4]), gpn=st.sampled_from([1, 2, 4, 8]),
       seq=st.sampled_from([1024, 4096, 32768, 65536, 131072, 262144, 131072 + 96]))
def test_never_returns_a_plan_predicted_to_oom(model, hw, nodes, gpn, seq):
    h = get_hardware(hw)
    gpus = nodes * h.gpus_per_node if nodes > 1 else gpn
    cfg = get_preset(model)
    try:
        p = plan(cfg, h, gpus, Workload(seq), model_name=model)
    except UserError as e:
        assert "does not fit" in str(e) and "\n" not in str(e)
        return
    assert p.memory.peak <= budget_bytes(h)
    assert invalid_reason(cfg, h, p.workload, p.layout) is None
    assert p.memory.peak == estimate(cfg, p.layout, p.workload).peak


# ---- estimator properties -----------------------------------------------------------------

def _layout(tp, pp, ep, cp, dp):
    """GPUs = TP·PP·CP·DP, raised until EP divides the GPUs of a pipeline stage."""
    return Layout(tp * pp * cp * dp * max(1, ep // (cp * dp * tp)), tp, pp, ep, cp)


pow2 = st.sampled_from([1, 2, 4, 8])
layouts = st.builds(_layout, st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), pow2, pow2,
                    st.sampled_from([1, 2, 4]))
workloads = st.builds(Workload, seq_len=st.integers(1024, 1 << 19),
                      micro_batch=st.sampled_from([1, 2]),
                      recompute=st.sampled_from(["none", "selective", "full"]),
                      sharding=st.sampled_from(["fsdp2", "dist_opt"]),
                      linear_ce=st.booleans(), ep_chunks=st.sampled_from([1, 2, 4, 8]))
models = st.sampled_from([get_preset(Q35), get_preset("qwen3-30b-a3b"), get_preset("tiny")])


@HYP
@given(cfg=models, lay=layouts, w=workloads, more=st.integers(1, 1 << 18))
def test_estimate_monotone_in_sequence_length(cfg, lay, w, more):
    longer = replace(w, seq_len=w.seq_len + more)
    assert estimate(cfg, lay, longer).peak >= estimate(cfg, lay, w).peak


@HYP
@given(cfg=models, lay=layouts, w=workloads)
def test_estimate_falls_with_more_shards(cfg, lay, w):
    base = estimate(cfg, lay, w).peak
    assert estimate(cfg, replace(lay, gpus=2 * lay.gpus), w).peak <= base       # more DP ranks
    assert estimate(cfg, replace(lay, gpus=2 * lay.gpus, cp=2 * lay.cp), w).peak <= base


@HYP
@given(cfg=models, lay=layouts, w=workloads)
def test_linear_ce_never_above_naive(cfg, lay, w):
    lin = estimate(cfg, lay, replace(w, linear_ce=True))
    naive = estimate(cfg, lay, replace(w, linear_ce=False))
    assert lin.peak <= naive.peak


def test_estimate_terms_and_table():
    m = estimate(get_preset(Q35), Layout(32, 1, 1, 8, 4), Workload(131072))
    assert m.peak == m.static + m.dynamic + m.margin > 0
    assert m.local_tokens == 32768
    text = m.table()
    for name in ("params", "optimizer", "activations", "MoE dispatch", "logits", "communication",
                 "allocator margin", "peak"):
        assert name in text
    assert json.loads(json.dumps(m.to_dict()))["peak_bytes"] == m.peak


def test_recompute_ordering_and_naive_logits_size():
    cfg, lay = get_preset(Q35), Layout(32, 1, 1, 8, 4)
    peaks = [estimate(cfg, lay, Workload(131072, recompute=r)).peak
             for r in ("full", "selective", "none")]
    assert peaks == sorted(peaks) and peaks[0] < peaks[2]
    naive = estimate(cfg, lay, Workload(131072, linear_ce=False))
    assert naive.logits >= 32768 * 248320 * 4       # at least the seeds' one fp32 copy


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_split_matches_num_params(name):
    cfg = get_preset(name)
    ps = param_split(cfg)
    total = cfg.num_layers * (ps["layer_dense"] + ps["layer_experts"]) + ps["embed"] + ps["head"]
    assert total == pytest.approx(cfg.num_params()["total"], rel=1e-12)


# ---- grid ---------------------------------------------------------------------------------

def test_grid_reproduces_the_seeds_oom_finding():
    cfg, h100 = get_preset(Q35), get_hardware("h100")
    baseline = Workload(131072, sharding="dist_opt", linear_ce=False, ep_chunks=1)
    cells = grid(cfg, h100, 32, baseline)
    verdicts = [c.verdict for c in cells]
    assert verdicts.count("OOM") > 3 * verdicts.count("fits") > 0
    assert all(c.why for c in cells)
    assert any("KV heads" in c.why for c in cells if c.verdict == "invalid")
    recipe = grid(cfg, h100, 32, Workload(131072))
    assert sum(c.verdict == "fits" for c in recipe) > sum(c.verdict == "fits" for c in cells)


# ---- bad input ----------------------------------------------------------------------------

BAD = {
    "unknown_hardware": (["--hardware", "b200"], ["--hardware", "h100", "mi300x"]),
    "unknown_model": (["--model", "llama"], ["--model", Q35, "tiny"]),
    "gpus_not_per_node": (["--gpus", "12"], ["--gpus", "8 GPUs per", "8 or 16"]),
    "gpus_zero": (["--gpus", "0"], ["--gpus"]),
    "seq_zero": (["--seq-len", "0"], ["--seq-len"]),
    "seq_not_divisible": (["--seq-len", "131073", "--gpus", "16"], ["not divisible", "e.g. 131072"]),
    "cannot_fit": (["--gpus", "8"], ["does not fit on 8 x h100", "16 GPUs fit"]),
    "out_selective": (["--recompute", "selective", "--seq-len", "8192", "--out", "/dev/null"],
                      ["--out", "selective"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line(case, capsys):
    extra, needles = BAD[case]
    argv = ["--model", Q35, "--hardware", "h100", "--gpus", "32", "--seq-len", "131072", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    for n in needles:
        assert n in err


# ---- the command --------------------------------------------------------------------------

def test_cli_json_and_out(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    assert main(["--model", Q35, "--hardware", "h100", "--gpus", "16", "--seq-len", "131072",
                 "--format", "json", "--out", str(out), "--explain"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["tp"], d["pp"], d["ep"], d["cp"]) == (1, 1, 8, 4)
    assert d["recompute"] == "full" and d["local_seq"] == 32768 and d["peak_bytes"] > 0
    assert {c["verdict"] for c in d["grid"]} <= {"fits", "OOM", "invalid"}
    run = load_run_config(str(out))
    assert (run.parallel.ep, run.parallel.cp, run.parallel.tp, run.parallel.pp) == (8, 4, 1, 1)
    assert run.data.seq_len == 131072 and run.parallel.recompute == "full"


def test_cli_table_and_yaml(capsys):
    argv = ["--model", Q35, "--hardware", "mi300x", "--gpus", "8", "--seq-len", "131072"]
    assert main(argv + ["--explain"]) == 0
    text = capsys.readouterr().out
    assert "TP1·PP1·EP8·CP1" in text and "why:" in text and "grid:" in text and "peak" in text
    # --explain: every rejected cell with its reason, then the fitting ones, the plan marked
    lines = text.splitlines()
    grid_cells = grid(get_preset(Q35), get_hardware("mi300x"), 8, Workload(131072))
    rejected = [c for c in grid_cells if c.verdict != "fits"]
    start = lines.index(f"rejected ({len(rejected)}):")
    for c in rejected:
        assert any(ln.split()[:2] == [c.layout.label, c.verdict] and c.why in ln
                   for ln in lines[start:]), c
    assert [ln for ln in lines if ln.endswith("<- the plan")] == \
        [ln for ln in lines if ln.startswith("  TP1·PP1·EP8·CP1 ") and "the plan" in ln]
    assert "NOT RUNNABLE" not in text
    assert main(argv + ["--format", "yaml"]) == 0
    d = yaml.safe_load(capsys.readouterr().out)
    assert d["cp"] == 1 and d["hardware"] == "mi300x"


def test_a_plan_the_trainer_cannot_run_says_so(tmp_path, capsys):
    argv = ["--model", Q35, "--hardware", "h100", "--gpus", "32", "--seq-len", "131072",
            "--tp", "2"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "NOT RUNNABLE YET: longmoe train runs TP = PP = 1 and rejects TP2·PP1" in text
    out = tmp_path / "tp2.yaml"
    assert main(argv + ["--format", "json", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["trainer_runs_it"] is False
    assert "note: longmoe train runs TP = PP = 1" in cap.err and "rejects it at launch" in cap.err
    assert "# NOT RUNNABLE YET" in out.read_text()


def test_add_parser_registers_recipe():
    import argparse
    from longmoe.plan.cli import add_parser
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["recipe", "--model", Q35, "--hardware", "h100", "--gpus", "32",
                      "--seq-len", "131072"])
    assert callable(a.fn) and a.format == "table"


# ---- shipped recipes, hardware data, calibration -------------------------------------------

@pytest.mark.parametrize("name,hw,gpus", [("h100_qwen35_128k", "h100", 32),
                                          ("mi300x_qwen35_128k", "mi300x", 8)])
def test_shipped_recipes_are_what_the_planner_writes(name, hw, gpus, tmp_path, capsys):
    # Each file names the command that wrote it; that command (the required flags only, so every
    # other setting is the CLI's default of today) writes the same bytes. A planner or default
    # change that the shipped files do not follow fails here.
    text = (RECIPE_DIR / f"{name}.yaml").read_text()
    command = text.splitlines()[0].removeprefix("# Planned by: ").split()
    required = ["longmoe", "recipe", "--model", Q35, "--hardware", hw, "--gpus", str(gpus),
                "--seq-len", "131072"]
    assert command == required
    out = tmp_path / f"{name}.yaml"
    assert main(command[2:] + ["--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert out.read_text() == text
    shipped = yaml.safe_load(text)
    from_dict(shipped)
    assert shipped["parallel"]["cp"] == DECISIONS[(Q35, hw, gpus, 131072)][3]
    # the file's peak is the one the command prints
    peak = re.search(r"estimated peak ([\d.]+) GiB per GPU", table).group(1)
    assert f"estimated peak {peak} GiB per GPU" in text.splitlines()[1]


def test_hardware_profiles_cite_every_figure():
    numeric = ["bf16_dense_tflops", "hbm_gb", "usable_gib", "hbm_tb_s", "gpus_per_node",
               "intra_node_gb_s", "inter_node_gb_s", "simd_width"]
    for key, p in profiles().items():
        for f in numeric:
            assert p[f] > 0 and p["sources"].get(f), (key, f)
        assert set(p["confirmed"]).isdisjoint(p["unconfirmed"])
        assert p["usable_gib"] <= p["hbm_gb"] * 1.0
        assert p["simd_width"] == (32 if p["vendor"] == "nvidia" else 64)
        assert p["backend"] in ("cuda", "rocm") and p["link"] in ("nvlink", "xgmi"), key
    for alias, key in aliases().items():
        assert get_hardware(alias).key == key
    assert get_hardware("H100").key == "h100"


@pytest.mark.parametrize("point", calibration.load_points(), ids=lambda p: p.name)
def test_calibration_points_match_the_docs_claim(point):
    row = calibration.evaluate(point)
    assert (abs(row.error) <= 0.10) == point.within_10, f"{point.name}: {row.error:+.1%}"


def test_calibration_data_names_each_source(tmp_path):
    points = calibration.load_points()
    assert len({p.name for p in points}) == len(points) >= 10
    assert all(p.source and p.measured_bytes > 0 and (p.layout or p.moe_layer) for p in points)
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"points": [{"name": "x", "source": "s", "measured": 1,
                                           "unit": "GB", "within_10": True,
                                           "layout": {"gpus": 1, "tq": 2}}]}))
    with pytest.raises(ValueError, match="point 'x'.*tq"):
        calibration.load_points(bad)


def test_recipe_command_end_to_end(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "plan.yaml"
    p = subprocess.run([sys.executable, "-m", "longmoe", "recipe", "--model", "qwen3.5-35b-a3b",
                        "--hardware", "h100", "--gpus", "32", "--seq-len", "131072",
                        "--format", "json", "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert (plan["tp"], plan["pp"], plan["ep"], plan["cp"]) == DECISIONS[(Q35, "h100", 32, 131072)]
    from longmoe.train.config import load_run_config
    assert load_run_config(str(out)).parallel.ep == 8
    bad = subprocess.run([sys.executable, "-m", "longmoe", "recipe", "--model", "nope",
                          "--hardware", "h100", "--gpus", "8", "--seq-len", "4096"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr


@pytest.mark.parametrize("core", ["chunked", "compiled"])
@pytest.mark.parametrize("dk,dv", [(128, 128), (32, 96)])
def test_linear_attention_bytes_match_the_saved_tensors(dk, dv, core):
    # The estimator's per-token count for our Gated DeltaNet core against the tensors autograd
    # actually keeps (saved_tensors_hooks, unique storages, bf16 layer on CPU): the difference
    # between 1024 and 512 tokens, so per-layer constants (weights) cancel. "compiled" runs the
    # GPU path's graphs through the partitioner inductor uses (longmoe.ops.compiled.forced).
    import contextlib

    import torch
    from longmoe.model.deltanet import GatedDeltaNet
    from longmoe.ops.compiled import forced
    from longmoe.plan.memory import Assumptions, linear_attention_bytes
    cfg = get_preset("qwen3.5-35b-a3b").replace(linear_key_head_dim=dk, linear_value_head_dim=dv,
                                                linear_num_value_heads=16, linear_num_key_heads=8)
    layer = GatedDeltaNet(cfg).to(torch.bfloat16)
    layer.impl = "chunked" if core == "chunked" else "chunked_compiled"
    # A fresh dynamo cache: graphs other tests compiled for the same functions count against
    # its recompile limit, past which dynamo runs them eager (another saved set).
    torch._dynamo.reset()
    kept = {}
    ctx = forced("aot_eager_decomp_partition") if core == "compiled" else contextlib.nullcontext()
    with ctx:
        for T in (512, 1024):
            seen = {}

            def pack(t):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            x = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                layer(x)
            kept[T] = sum(seen.values())
    measured = (kept[1024] - kept[512]) / 512
    est = linear_attention_bytes(cfg, Assumptions(linear_core=core))
    assert abs(est / measured - 1) < 0.06, (est, measured)


def test_recipe_linear_core_chunked_plans_and_runs_our_core(tmp_path, capsys):
    # MI300X, 128K, 8 GPUs: our chunked Gated DeltaNet core keeps more than the attention-sized
    # assumption, so the plan for it needs more memory per token (a larger peak at the same CP,
    # or CP > 1 where the kernel's plan needs none), and the written config runs that core.
    peaks, cps = {}, {}
    for core in ("kernel", "compiled", "chunked"):
        out = tmp_path / f"{core}.yaml"
        assert main(["--model", "qwen3.5-35b-a3b", "--hardware", "mi300x", "--gpus", "8",
                     "--seq-len", "131072", "--linear-core", core, "--format", "json",
                     "--keep-attention", "off", "--out", str(out)]) == 0
        d = json.loads(capsys.readouterr().out)
        peaks[core], cps[core] = d["peak_bytes"], d["cp"]
        text = out.read_text()
        impl = {"kernel": None, "compiled": "chunked_compiled", "chunked": "chunked"}[core]
        assert re.search(r"gated_delta: (\S+)", text) is None if impl is None else \
            re.search(r"gated_delta: (\S+)", text).group(1) == impl
        assert (f"--linear-core {core}" in text) == (core != "kernel")
    assert cps["kernel"] == cps["compiled"] == 1
    assert peaks["kernel"] < peaks["compiled"]
    assert (peaks["chunked"] > peaks["kernel"] * 1.2 if cps["chunked"] == 1 else cps["chunked"] > 1)


# ---- trailing layers without recompute (--keep-last) ------------------------------------------

def test_keep_last_zero_is_full_recompute_and_more_costs_more():
    from longmoe.plan.memory import Assumptions
    cfg = get_preset(Q35).replace(num_layers=6)
    a = Assumptions(linear_core="compiled")
    lay = Layout(8, 1, 1, 8, 1)
    base = estimate(cfg, lay, Workload(32768), a)
    assert estimate(cfg, lay, Workload(32768, keep_last=0), a).peak == base.peak
    peaks = [estimate(cfg, lay, Workload(32768, keep_last=k), a).peak for k in range(7)]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]
    # keeping every layer is the no-recompute estimate
    assert peaks[6] == estimate(cfg, lay, Workload(32768, recompute="none"), a).peak
    with pytest.raises(Exception, match="keep_last"):
        estimate(cfg, Layout(8, 1, 2, 4, 1), Workload(32768, keep_last=1), a)
    with pytest.raises(Exception, match="keep_last"):
        Workload(32768, keep_last=-1)


def test_keep_last_auto_is_the_most_that_fits_and_writes_a_per_layer_list(tmp_path):
    def mk(keep):
        return plan(get_preset(Q35), get_hardware("mi300x"), 8, Workload(65536), model_name=Q35,
                    keep_last=keep)
    p0 = mk(0)
    assert p0.workload.keep_last == 0 and p0.keep_fits > 0
    p = mk("auto")
    k = p.workload.keep_last
    assert k == p0.keep_fits and p.layout == p0.layout
    assert p.memory.peak <= p.budget_bytes
    over = estimate(get_preset(Q35), p.layout, replace(p.workload, keep_last=k + 1))
    assert over.peak > p.budget_bytes
    cfg = run_config(p)
    assert cfg["parallel"]["recompute"] == ["full"] * (40 - k) + ["none"] * k
    from_dict(cfg)
    with pytest.raises(UserError, match=r"--keep-last: 40 layers .* at most"):
        mk(40)


@pytest.mark.parametrize("value,msg", [("x", "expected a number or auto"), ("-1", ">= 0")])
def test_keep_last_cli_errors(capsys, value, msg):
    assert main(["--model", Q35, "--hardware", "h200", "--gpus", "8", "--seq-len", "65536",
                 "--keep-last", value]) == 2
    err = capsys.readouterr().err
    assert "--keep-last" in err and msg in err


def test_ep_chunks_never_exceed_the_local_experts():
    """The trainer chunks by expert range, so a plan for few experts per rank caps its chunks
    (and the written config loads and validates)."""
    cfg = get_preset(Q35).replace(num_experts=16, num_layers=4)
    p = plan(cfg, get_hardware("h200"), 8, Workload(65536), model_name=Q35)
    assert p.layout.ep == 8 and p.ep_chunks == 2 and "capped" in p.reasons["ep_chunks"]


def test_recipe_plans_in_tokens_per_micro_batch(tmp_path, capsys):
    cfg = get_preset(Q35)
    p = _plan(Q35, "h100", 32, 65536, micro_batch=2)
    assert p.to_dict()["max_tokens_per_micro_batch"] == 131072
    run = run_config(p)
    assert run["data"]["max_tokens_per_micro_batch"] == 131072
    assert from_dict(run).data.budget == 131072
    # The estimate is in tokens: two 64K samples in a row cost what one 128K sample does.
    lay = p.layout
    assert estimate(cfg, lay, Workload(65536, 2)).peak == estimate(cfg, lay, Workload(131072)).peak
    # One reduction per step keeps the local model's fp32 gradients whole across micro-batches.
    base = estimate(cfg, lay, Workload(131072))
    step = estimate(cfg, lay, Workload(131072, grad_sync="step"))
    ps = param_split(cfg)
    whole = 4 * (cfg.num_layers * (ps["layer_dense"] + ps["layer_experts"] / lay.ep)
                 + ps["embed"] + ps["head"])
    assert abs((step.peak - base.peak) - whole) <= 2 and step.grads > base.grads
    out = tmp_path / "r.yaml"
    assert main(["--model", Q35, "--hardware", "h100", "--gpus", "32", "--seq-len", "131072",
                 "--grad-sync", "step", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gradients reduced per step" in text and "grad_sync=step" in text
    r = load_run_config(str(out))
    assert r.parallel.grad_sync == "step" and r.data.budget == 131072
    assert "--grad-sync step" in out.read_text().splitlines()[0]


def test_keep_attention_adds_the_kernels_tensors_of_each_recomputed_attention_layer():
    # (3 N D + 2 K D) bf16 + an fp32 lse per head a token on each full-attention layer that is
    # recomputed: q, out and the gate's sigmoid, k and v; none under recompute none.
    from dataclasses import replace

    from longmoe.plan.memory import Assumptions, activation_bytes
    cfg = get_preset(Q35).replace(num_layers=8)
    a = Assumptions(linear_core="compiled")
    lay, T = Layout(8, 1, 1, 8, 1), 32768
    per_tok = activation_bytes(cfg, a)["attn_kernel"]
    nd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert per_tok == 2 * (3 * nd + 2 * kd) + 4 * cfg.num_heads
    assert 0.75 < per_tok * T / 2**30 < 0.85          # ~0.8 GiB a layer at 32K tokens
    w = Workload(T)
    assert estimate(cfg, lay, replace(w, keep_attention=True), a).peak > estimate(cfg, lay, w, a).peak
    # With 4 layers kept the peak is the LM head's, every stored activation alive: a kept
    # trailing attention layer stores everything already, only the recomputed ones add.
    kept = replace(w, keep_last=4)
    with_kernels = estimate(cfg, lay, replace(kept, keep_attention=True), a)
    plain = estimate(cfg, lay, kept, a)
    assert with_kernels.phase == plain.phase == "LM head"
    n_attn = cfg.layer_types[:4].count("full_attention")
    assert with_kernels.activations - plain.activations == T * n_attn * per_tok
    none = replace(w, recompute="none")
    assert estimate(cfg, lay, replace(none, keep_attention=True), a).peak == estimate(cfg, lay, none, a).peak


def test_recipe_keep_attention_is_planned_and_written(tmp_path, capsys):
    """auto (the default) turns it on where the estimate fits, the bare flag forces it, off
    plans without it; each plan's YAML carries what was planned."""
    peaks, kept = {}, {}
    for name, flag in (("auto", []), ("on", ["--keep-attention"]),
                       ("off", ["--keep-attention", "off"])):
        out = tmp_path / f"plan-{name}.yaml"
        assert main(["--model", "qwen3.5-35b-a3b", "--hardware", "mi300x", "--gpus", "8",
                     "--seq-len", "65536", "--format", "json", "--out", str(out)] + flag) == 0
        d = json.loads(capsys.readouterr().out)
        peaks[name], kept[name] = d["peak_bytes"], d["keep_attention"]
        assert ("keep_attention: true" in out.read_text()) == kept[name]
        assert load_run_config(str(out)).parallel.keep_attention == kept[name]
    assert kept == {"auto": True, "on": True, "off": False}
    assert peaks["auto"] == peaks["on"] > peaks["off"]


def test_recipe_keep_attention_auto_declines_what_does_not_fit(capsys):
    # 128K on 32 H100s at 43% of the budget: CP 4's plain plan fits (28.1 GiB of 32.9), the
    # attention kernels' tensors (+9 GiB estimated) do not: auto keeps CP 4 and recomputes
    # attention; on plans for them, so it takes the layout where they fit (CP 8).
    args = ["--model", "qwen3.5-35b-a3b", "--hardware", "h100", "--gpus", "32", "--seq-len",
            "131072", "--headroom", "0.57", "--format", "json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["keep_attention"] is False and "would need" in d["reasons"]["keep_attn"]
    assert d["peak_bytes"] <= d["budget_bytes"] and d["cp"] == 4
    assert main(args + ["--keep-attention", "on"]) == 0
    on = json.loads(capsys.readouterr().out)
    assert on["keep_attention"] is True and on["cp"] == 8 and on["peak_bytes"] <= on["budget_bytes"]
    # where no layout holds them, on is one line naming the flag
    assert main(["--model", "qwen3.5-35b-a3b", "--hardware", "h100", "--gpus", "8",
                 "--seq-len", "131072", "--keep-attention", "on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--keep-attention on" in err[0]
    assert main(["--model", "qwen3.5-35b-a3b", "--hardware", "mi300x", "--gpus", "8",
                 "--seq-len", "16384", "--recompute", "none", "--keep-attention"]) == 2
    assert "needs full recompute" in capsys.readouterr().err


@pytest.mark.parametrize("hw,gpus,extra", [("h100", 32, []), ("h100", 32, ["--keep-last", "auto"]),
                                           ("mi300x", 8, []),
                                           ("h100", 32, ["--headroom", "0.5", "--keep-attention",
                                                         "on"])])
def test_explain_gives_each_cell_one_number(capsys, hw, gpus, extra):
    # The reasons, the plan's peak and the grid all judge a layout with the same settings (the
    # EP chunks it would run, keep_attention as the plan decides it, the plan's own kept layers
    # for the chosen cell): a layout named twice has one number.
    args = ["--model", Q35, "--hardware", hw, "--gpus", str(gpus), "--seq-len", "131072",
            "--explain"] + extra
    assert main(args + ["--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cells = {(c["tp"], c["pp"], c["ep"], c["cp"]): c for c in d["grid"]}
    chosen = cells[(d["tp"], d["pp"], d["ep"], d["cp"])]
    assert chosen["verdict"] == "fits" and chosen["peak_bytes"] == d["peak_bytes"]
    gib = {k: f"{c['peak_bytes'] / GiB:.1f}" for k, c in cells.items() if c["peak_bytes"]}
    said = re.findall(r"CP=(\d+) needs ([\d.]+) GiB", d["reasons"]["cp"])
    said += [(str(d["cp"]), n) for n in re.findall(r"\(([\d.]+) GiB of", d["reasons"]["cp"])]
    assert said
    for cp, n in said:
        assert gib[(d["tp"], 1, d["ep"], int(cp))] == n, (cp, n, d["reasons"]["cp"])
    assert f"{d['peak_bytes'] / GiB:.1f} GiB of" in d["reasons"]["cp"]
    # the table says the same numbers
    assert main(args) == 0
    text = capsys.readouterr().out.split("\ngrid: ")[1]
    for (tp, pp, ep, cp), c in cells.items():
        if c["peak_bytes"]:
            line = next(ln for ln in text.splitlines()
                        if ln.startswith(f"  TP{tp}·PP{pp}·EP{ep}·CP{cp} "))
            assert f"{c['peak_bytes'] / GiB:.1f} GiB" in line, line
