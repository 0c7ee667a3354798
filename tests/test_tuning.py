"""The chunk-count tuner: formula, cache (keys, round trip, bad files), runtime resolution, the
tuner end to end on 2 gloo ranks, and the cost model's predictions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longmoe.backends import get_backend
from longmoe.config import get_preset
from longmoe.errors import UserError
from longmoe.tuning import FORMULA, default_chunks, resolve_chunks, resolve_transport
from longmoe.tuning import cache

ROOT = Path(__file__).resolve().parents[1]


def test_default_chunks_formula():
    assert default_chunks(1000) == 1
    assert default_chunks(16384) == 2
    assert default_chunks(65536) == 8
    assert default_chunks(1 << 20) == 8


def test_buckets_and_keys():
    assert [cache.seq_bucket(t) for t in (1, 4096, 4097, 65536)] == [1, 4096, 8192, 65536]
    k = cache.make_key("cuda", "sm_90", "nvlink-8", 2, 2048, 8, "bfloat16", 30000)
    assert k == "cuda|sm_90|nvlink-8|ep2|h2048|k8|bfloat16|t32768"
    probe = {"name": "cuda", "interconnect": {"link": "nvlink", "gpus_per_node": 8}}
    assert cache.interconnect_signature(probe) == "nvlink-8"
    assert cache.interconnect_signature({"name": "cpu"}) == "cpu"


def test_cache_round_trip_and_merge(tmp_path):
    cache.save(tmp_path, {"a": {"chunks": 4}})
    cache.save(tmp_path, {"b": {"chunks": 2}})
    assert cache.load(tmp_path / cache.FILE_NAME) == {"a": {"chunks": 4}, "b": {"chunks": 2}}
    assert cache.lookup("b", [tmp_path])[0] == {"chunks": 2}
    assert cache.lookup("c", [tmp_path]) == (None, None)
    assert not list(tmp_path.glob(".chunks-*"))  # the temporary file was renamed into place


@pytest.mark.parametrize("text,why", [("{not json", "not valid JSON"),
                                      ('{"schema": 99, "entries": {}}', "schema 99"),
                                      ("[1, 2]", "schema 'list'")])
def test_bad_cache_file_is_ignored_with_a_warning(tmp_path, text, why):
    (tmp_path / cache.FILE_NAME).write_text(text)
    with pytest.warns(UserWarning, match=why):
        assert cache.load(tmp_path / cache.FILE_NAME) == {}


def test_runtime_prefers_a_matching_cache_entry(tmp_path, monkeypatch):
    cpu = get_backend("cpu")
    assert resolve_chunks(3, cpu, 2, 64, 2, "float32", 2048) == (3, "config")
    n, src = resolve_chunks("auto", cpu, 2, 64, 2, "float32", 20000)
    assert (n, src) == (2, f"formula {FORMULA}")
    key = cache.make_key("cpu", cpu.arch, "cpu", 2, 64, 2, "float32", 2048)
    cache.save(tmp_path, {key: {"chunks": 4, "chunk_by": "experts"}})
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    n, src = resolve_chunks("auto", cpu, 2, 64, 2, "float32", 2048)
    assert n == 4 and "tuning cache" in src and key in src
    # an entry measured with the other kind of chunk (or before chunk_by existed: tokens) is not
    # used, and the source says why
    n, src = resolve_chunks("auto", cpu, 2, 64, 2, "float32", 2048, chunk_by="tokens")
    assert src.startswith("formula") and "measured with experts chunks" in src
    cache.save(tmp_path, {key: {"chunks": 4}})
    assert resolve_chunks("auto", cpu, 2, 64, 2, "float32", 2048, chunk_by="tokens")[0] == 4
    assert "measured with tokens chunks" in resolve_chunks("auto", cpu, 2, 64, 2, "float32", 2048)[1]
    cache.save(tmp_path, {key: {"chunks": 4, "chunk_by": "experts"}})
    # another bucket, hidden size or EP size does not match
    assert resolve_chunks("auto", cpu, 2, 64, 2, "float32", 4097)[1].startswith("formula")
    assert resolve_chunks("auto", cpu, 4, 64, 2, "float32", 2048)[1].startswith("formula")
    (tmp_path / cache.FILE_NAME).write_text("garbage")
    with pytest.warns(UserWarning):
        assert resolve_chunks("auto", cpu, 2, 64, 2, "float32", 2048)[1].startswith("formula")


def test_auto_transport_follows_the_cache_when_it_can_run_here(tmp_path, monkeypatch):
    cpu, dev = get_backend("cpu"), torch.device("cpu")
    args = (cpu, dev, 2, 64, 2, "float32", 2048)
    assert resolve_transport("process_group", *args) == ("process_group", "config")
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path))
    assert resolve_transport("auto", *args) == ("auto", "first available")
    key = cache.make_key("cpu", cpu.arch, "cpu", 2, 64, 2, "float32", 2048)
    cache.save(tmp_path, {key: {"chunks": 2, "chunk_by": "experts", "transport": "process_group"}})
    name, src = resolve_transport("auto", *args)
    assert name == "process_group" and key in src
    # measured best, but this machine cannot run it (no symmetric memory on CPU): first available
    cache.save(tmp_path, {key: {"chunks": 2, "chunk_by": "experts",
                                "transport": "symmetric_memory"}})
    assert resolve_transport("auto", *args) == ("auto", "first available")
    # an entry of the other chunk kind says nothing about the transport either
    cache.save(tmp_path, {key: {"chunks": 2, "chunk_by": "tokens", "transport": "process_group"}})
    assert resolve_transport("auto", *args) == ("auto", "first available")
    assert cpu.a2a("auto", dev).name == "process_group"


def test_input_errors_name_the_flag():
    from longmoe.tuning.tuner import check_inputs
    with pytest.raises(UserError, match="--chunks: 3 does not divide --seq-lens value 4096"):
        check_inputs([4096], [1, 3], 2, 256)
    with pytest.raises(UserError, match="--ep: 1"):
        check_inputs([4096], [1], 1, 256)
    with pytest.raises(UserError, match="--ep: 3 does not divide"):
        check_inputs([4096], [1], 3, 256)


def test_tuner_end_to_end_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "tune"
    # --smoke with its own defaults (two tiny lengths, chunks 1 and 2, two iterations), --ep left
    # to its default: the run says which EP and which devices it measured
    p = subprocess.run([sys.executable, "-m", "longmoe", "tune", "chunks", "--smoke", "--device",
                        "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    progress = [ln for ln in p.stderr.splitlines() if ln.startswith("tune chunks: ")]
    assert progress and "2 lengths x 2 chunk counts" in progress[-1], p.stderr[-2000:]
    assert "EP 2 (the --ep default): 2 cpu rank(s)" in progress[0]
    # nothing but our own lines: no profiler chatter (kineto's USDT/STAGE/INFO lines), no
    # matplotlib notice
    ours = ("tune chunks: ", "longmoe backend: ")
    assert [ln for ln in p.stderr.splitlines() if not ln.startswith(ours)] == [], p.stderr
    assert "measured on: 2 x cpu" in p.stdout and "EP 2 (the --ep default)" in p.stdout
    # CPU ranks write no cache entry, and the table never shows a fraction above 100%
    assert not (out / cache.FILE_NAME).exists()
    assert "cache: not written: CPU ranks" in p.stdout
    assert p.stdout.splitlines()[-1].endswith("no cache written (CPU ranks)")
    hidden = [ln.split("|")[7].strip() for ln in p.stdout.splitlines() if ln.startswith("| 64 ")
              or ln.startswith("| 128 ")]
    assert len(hidden) == 2 and all(h == "noise" or 0 <= int(h.rstrip("%")) <= 100 for h in hidden)
    # one start of the ranks measured every length and took the traces
    sweep = json.loads(next(out.glob("sweep_*.json")).read_text())
    summary = sweep["summary"]
    assert len(sweep["reports"]) == 1 and summary["cache"] is None
    assert summary["hardware"] == {"device": "cpu", "backend": "cpu", "arch": "cpu",
                                   "interconnect": "cpu", "ranks": 2}
    for T, r in summary["results"].items():
        sweep_ms = r["sweep_ms"]["process_group"]
        assert set(sweep_ms) == {"1", "2"} and r["chunks"] in (1, 2)
        assert r["ms"] == pytest.approx(min(sweep_ms.values()), abs=1e-3)  # the pick is the fastest
        assert 0 <= r["hidden_fraction"] <= 1
    assert summary["plot"] and (out / summary["plot"].split("/")[-1]).stat().st_size > 1000
    assert summary["traces"] and all(t.endswith(".json.gz") for t in summary["traces"])


def test_hidden_fraction_outside_0_1_is_noise():
    # 2 chunks "saved" 8.38x the smaller of the all-to-all and the GEMMs alone: no schedule
    # hides more than that, so it is timing noise, clamped and said so.
    from longmoe.bench.moe_layer import hidden_fraction, markdown_table, summarize
    from longmoe.tuning.tuner import choose, hidden_cell
    assert hidden_fraction(10.0, 6.0, 8.0, 5.0) == (0.8, False)
    assert hidden_fraction(10.0, 1.62, 1.0, 5.0) == (1.0, True)
    rows = [{"kind": "layer", "transport": "pg", "priority": 0, "T": 64, "chunks": c, "ms": ms,
             "peak_bytes": 1} for c, ms in ((1, 10.0), (2, 1.62))]
    rows += [{"kind": "comm", "transport": "pg", "T": 64, "ms": 1.0, "bytes": 1},
             {"kind": "gemm", "transport": "pg", "T": 64, "ms": 5.0}]
    r = choose(rows, 64)
    assert r["hidden_fraction"] == 1.0 and r["hidden_noise"] and hidden_cell(r) == "noise"
    s = summarize(rows, default_chunks)
    assert s[0]["hidden_fraction"] == 1.0 and s[0]["hidden_noise"]
    table = markdown_table({"summary": s})
    assert "noise" in table and "838%" not in table
    rows[1]["ms"] = 9.5          # saved 0.5 ms of a 1 ms all-to-all: half of it hidden
    assert hidden_cell(choose(rows, 64)) == "50%"


def test_predict_needs_the_hardware_and_says_the_ep(capsys):
    from longmoe.cli import main
    assert main(["tune", "chunks", "--predict", "--seq-lens", "16384"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hardware: --predict")
    assert main(["tune", "chunks", "--predict", "--hardware", "h200", "--seq-lens", "16384"]) == 0
    out = capsys.readouterr().out
    assert "EP=2 (the --ep default)" in out.splitlines()[0]
    assert "for NVIDIA H200" in out.splitlines()[-1] and "at EP 2 (the --ep default)" in out
    assert main(["tune", "chunks", "--predict", "--hardware", "h200", "--ep", "8",
                 "--seq-lens", "16384"]) == 0
    assert "EP=8," in capsys.readouterr().out


def test_cost_model_predictions_are_labelled_and_sane():
    from longmoe.tuning.cost_model import calibration, predict
    cfg = get_preset("qwen3.5-35b-a3b")
    res = predict("mi300x", cfg, 8, [4096, 65536], [1, 2, 4, 8, 16])
    assert res["label"].startswith("PREDICTION")
    r4k, r64k = res["results"]["4096"], res["results"]["65536"]
    assert r64k["best_chunks"] >= r4k["best_chunks"] and r64k["speedup"] >= r4k["speedup"] >= 0
    for name, fig in calibration().items():
        if not name.startswith("_"):
            leaves = fig.values() if "value" not in fig and "fixed_us" not in fig else [fig]
            assert all("source" in v for v in leaves), name
    with pytest.raises(UserError, match="--hardware: unknown hardware 'tpu'"):
        predict("tpu", cfg, 8, [4096], [1])
    with pytest.raises(UserError, match="--ep: 16 exceeds"):
        predict("mi300x", cfg, 16, [4096], [1])


def test_shipped_calibration_reproduces_the_h200_sweep():
    # The shipped fit against the 2xH200 sweep it came from: every layer row within the fit's
    # recorded error, median under 10%, and the chunk count it would pick measured within 3% of
    # the best count (neighbouring counts differ by about the run-to-run noise there).
    from longmoe.plan.hardware import get_hardware
    from longmoe.tuning.cost_model import calibration, layer_time
    cal, cfg, hw = calibration(), get_preset("qwen3.5-35b-a3b"), get_hardware("h200")
    sweep = json.loads((ROOT / "tests/data/moe_layer_h200x2.json").read_text())
    rows = [r for r in sweep["rows"] if r["kind"] == "layer" and r["priority"] == -1]
    errs = [abs(layer_time(hw, cfg, 2, r["T"], r["chunks"], r["transport"])["ms"] - r["ms"]) / r["ms"]
            for r in rows]
    assert max(errs) <= cal["_fit"]["max_rel_error"] + 1e-3
    assert sorted(errs)[len(errs) // 2] < 0.10
    for T in (4096, 16384, 65536):
        for tr in ("process_group", "symmetric_memory"):
            ms = {r["chunks"]: r["ms"] for r in rows if r["T"] == T and r["transport"] == tr}
            model = min((1, 2, 4, 8), key=lambda c: layer_time(hw, cfg, 2, T, c, tr)["ms"])
            assert ms[model] <= 1.03 * min(ms.values()), (T, tr, model, ms)


def test_calibrate_recovers_known_coefficients():
    # A sweep generated by the model from known coefficients is fitted back to them.
    from longmoe.plan.hardware import get_hardware
    from longmoe.tuning import calibrate
    from longmoe.tuning.cost_model import calibration, layer_time, terms
    cfg, hw = get_preset("qwen3.5-35b-a3b"), get_hardware("h200")
    truth = json.loads(json.dumps(calibration()))
    truth["gemm_fraction_of_peak"]["value"] = 0.37
    truth["a2a_fraction_of_link"]["value"] = 0.55
    truth["symmetric_memory_speed"]["value"] = 1.3
    truth["non_gemm"].update(fixed_us=1234.0, passes=21.0)
    truth["chunk_overhead"].update(fixed_us=777.0, passes=3.5)
    truth["hide"]["process_group"]["value"] = 0.33
    truth["hide"]["symmetric_memory"]["value"] = 0.81
    rows = []
    for tr in ("process_group", "symmetric_memory"):
        for T in (4096, 16384, 65536):
            t = terms(hw, cfg, 2, T, 1, tr, truth)
            rows += [{"kind": "gemm", "transport": tr, "T": T, "ms": t["gemm_s"] * 1e3},
                     {"kind": "comm", "transport": tr, "T": T, "ms": t["comm_s"] * 1e3}]
            rows += [{"kind": "layer", "transport": tr, "T": T, "chunks": c,
                      "ms": layer_time(hw, cfg, 2, T, c, tr, cal=truth)["ms"]} for c in (1, 2, 4, 8)]
    layer = {"ep": 2, "hidden": cfg.hidden_size, "top_k": cfg.top_k, "experts": cfg.num_experts,
             "moe_ffn": cfg.moe_ffn_size}
    fit = calibrate.fit({"layer": layer, "rows": rows, "device": "synthetic"}, cfg, hw, calibration())
    for k in ("gemm_fraction_of_peak", "a2a_fraction_of_link", "symmetric_memory_speed"):
        assert fit[k]["value"] == pytest.approx(truth[k]["value"], rel=1e-3), k
    for k in ("non_gemm", "chunk_overhead"):
        assert fit[k]["fixed_us"] == pytest.approx(truth[k]["fixed_us"], rel=1e-2), k
        assert fit[k]["passes"] == pytest.approx(truth[k]["passes"], rel=1e-2), k
    for tr in ("process_group", "symmetric_memory"):
        assert fit["hide"][tr]["value"] == pytest.approx(truth["hide"][tr]["value"], rel=1e-2)
    assert fit["_fit"]["max_rel_error"] < 1e-3
    with pytest.raises(UserError, match="--from: the sweep's layer has hidden"):
        calibrate.fit({"layer": {**layer, "hidden": 7}, "rows": rows}, cfg, hw, calibration())
    with pytest.raises(UserError, match="--from: not a `bench moe-layer` result"):
        calibrate.fit({"rows": rows}, cfg, hw, calibration())


def test_predict_cli_table(tmp_path):
    p = subprocess.run([sys.executable, "-m", "longmoe", "tune", "chunks", "--predict",
                        "--hardware", "mi300x", "--ep", "8", "--seq-lens", "16384,65536"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "PREDICTION" in p.stdout and "| 65536 |" in p.stdout
    # without --out nothing is written, and the last line says so
    assert not list(tmp_path.iterdir()) and "nothing written" in p.stdout.splitlines()[-1]


def test_predict_out_writes_a_marked_cache_and_plot(tmp_path, monkeypatch):
    from longmoe.tuning import _tuned_entry
    from longmoe.cli import main
    out = tmp_path / "pred"
    assert main(["tune", "chunks", "--predict", "--hardware", "mi300x", "--ep", "8",
                      "--seq-lens", "16384,65536", "--out", str(out)]) == 0
    entries = cache.load(out / cache.FILE_NAME)
    cfg = get_preset("qwen3.5-35b-a3b")
    keys = {cache.make_key("rocm", "gfx942", "xgmi-8", 8, cfg.hidden_size, cfg.top_k, "bfloat16",
                           t) for t in (16384, 65536)}
    assert set(entries) == keys
    assert all(e["predicted"].startswith("PREDICTION") and e["chunk_by"] == "experts"
               for e in entries.values())
    assert (out / "chunks_predicted_rocm_gfx942_xgmi-8_ep8.png").stat().st_size > 1000
    pred = json.loads((out / "prediction_rocm_gfx942_xgmi-8_ep8.json").read_text())
    assert {e["chunks"] for e in entries.values()} == {r["best_chunks"]
                                                      for r in pred["results"].values()}

    # the runtime says the number it read was predicted
    class Part:  # what a backend reports on that machine
        name, arch = "rocm", "gfx942"

        def probe(self):
            return {"name": "rocm", "interconnect": {"link": "xgmi", "gpus_per_node": 8}}
    monkeypatch.setenv(cache.ENV_DIR, str(out))
    entry, source, _ = _tuned_entry(Part(), 8, cfg.hidden_size, cfg.top_k, "bfloat16", 65536,
                                    "experts")
    assert entry is not None and "predicted by the cost model" in source


def test_smoke_defaults_fit_the_smoke_layer():
    from longmoe.tuning.cli import SMOKE
    from longmoe.tuning.tuner import check_inputs, smoke_model
    cfg = smoke_model()
    check_inputs([int(t) for t in SMOKE["seq_lens"].split(",")],
                 [int(c) for c in SMOKE["chunks"].split(",")], 2, cfg.num_experts)
