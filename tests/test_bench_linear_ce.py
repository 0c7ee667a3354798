"""`longmoe bench linear-ce` on CPU: every variant is timed once per round, in an order that
rotates, and the rows carry what the table reads (the floor only on GPUs)."""

import torch

from longmoe.bench import linear_ce


def test_rounds_time_every_variant_in_rotating_order(monkeypatch):
    calls = []
    timed = linear_ce._timed

    def spy(fn, h, w, y, backend):
        calls.append(fn)
        return timed(fn, h, w, y, backend)
    monkeypatch.setattr(linear_ce, "_timed", spy)
    rep = linear_ce.run_bench([37], 16, 101, torch.float32, impls=["ours", "ours_rl", "naive"],
                              warmup=1, iters=3)
    rows = rep["results"]
    assert [r["impl"] for r in rows] == ["ours", "ours_rl", "naive"]
    assert all(r["status"] == "ok" and len(r["ms_all"]) == 3 and "x_floor" not in r for r in rows)
    assert abs(rows[0]["loss"] - rows[2]["loss"]) < 1e-5  # ours against torch
    assert len(calls) == 3 * 2 + 9  # each variant's warm-up and peak pass, then 3 rounds of 3
    a, b, c = calls[6:9]
    assert len({a, b, c}) == 3 and calls[9:] == [b, c, a, c, a, b]
    assert rep["timing"] == "interleaved" and rep["gemm_tflops"] == [{"T": 37, "gemm_tflops": None}]
    assert "| 37 | ours_rl |" in linear_ce.markdown_table(rep)
