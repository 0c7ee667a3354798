"""`longmoe bench moe-layer` times its arms (unpipelined, each chunk count, the megatron-core
baseline) in the same rounds, the order rotating, so they run under the same clocks."""

from longmoe.backends import get_backend
from longmoe.bench.moe_layer import _timed_rounds


def test_rounds_time_each_arm_once_per_round_in_rotating_order():
    order = []
    fns = [lambda i=i: order.append(i) for i in range(3)]
    out = _timed_rounds(get_backend("cpu"), fns, iters=4, warmup=2)
    assert order[:6] == [0, 0, 1, 1, 2, 2]  # warm-ups
    assert order[6:] == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert len(out) == 3 and all(ms >= 0 and peak >= 0 for ms, peak in out)


def test_every_schedule_is_timed_and_taxed_against_the_unpipelined_layer(tmp_path):
    # One rank, three weight-gradient schedules and an expert count of the caller's: every
    # (schedule, C) arm gets a row and a tax row against the one unpipelined layer of the run;
    # the summary reads the first schedule's arms only.
    import json
    from longmoe.cli import main
    out = tmp_path / "tax.json"
    assert main(["bench", "moe-layer", "--smoke", "--device", "cpu", "--nproc", "1",
                 "--wgrad", "delayed,auto,in_chunks", "--experts", "4", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["layer"]["experts"] == 4 and rep["wgrad"] == "delayed"
    assert rep["wgrads"] == ["delayed", "auto", "in_chunks"]
    layer = [r for r in rep["rows"] if r["kind"] == "layer"]
    assert sorted((r["wgrad"], r["chunks"]) for r in layer) == sorted(
        (w, c) for w in rep["wgrads"] for c in (1, 2))
    direct = next(r for r in rep["rows"] if r["kind"] == "direct")
    assert len(rep["tax"]) == len(layer)
    for t, r in zip(rep["tax"], layer):
        assert (t["wgrad"], t["chunks"], t["ms"]) == (r["wgrad"], r["chunks"], r["ms"])
        assert abs(t["over_unpipelined"] - (r["ms"] / direct["ms"] - 1)) < 1e-12
    first = {r["chunks"]: r["ms"] for r in layer if r["wgrad"] == "delayed"}
    assert rep["summary"][0]["nochunk_ms"] == first[1]
    # one rank issues no all-to-all: no hidden fraction is claimed for it
    assert "hidden_fraction" not in rep["summary"][0] and "comm_ms" in rep["summary"][0]
    assert "Pipeline tax" in (tmp_path / "tax.md").read_text()
