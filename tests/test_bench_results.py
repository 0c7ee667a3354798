"""Bench results say where they came from and carry their table: date, commit, device and
versions in the JSON, FILE.md beside FILE.json, and the same table regenerated from the JSON."""

import json
import os
import subprocess
import sys

from longmoe.bench import provenance_lines, stamp
from longmoe.bench.tables import plain_table, render


def test_bench_writes_provenance_and_table_beside_the_json(tmp_path):
    out = tmp_path / "moe_rows.json"
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "moe-rows", "--tokens", "8",
                        "--top-k", "2", "--hidden", "24", "--ffn", "8", "--iters", "1",
                        "--device", "cpu", "--out", str(out)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "LONGMOE_COMMIT": "abc1234"})
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["commit"] == "abc1234" and rep["date"].endswith("+00:00")
    assert isinstance(rep["device"], str) and rep["device"]
    assert rep["versions"]["torch"] and "cut-cross-entropy" in rep["versions"]
    assert "megatron-core" in rep["versions"]
    assert rep["command"].startswith("longmoe bench moe-rows --tokens 8")
    md = out.with_suffix(".md").read_text()
    assert "- commit: abc1234" in md and f"- date: {rep['date']}" in md
    assert "| T | op | impl |" in md and "| combine |" in md
    out.with_suffix(".md").unlink()
    assert render(out) == out.with_suffix(".md") and out.with_suffix(".md").read_text() == md


def test_missing_fields_are_said_to_be_missing():
    lines = "\n".join(provenance_lines({"bench": "probe", "rows": []}))
    assert "- date: not recorded" in lines and "- commit: not recorded" in lines
    assert "- device: not recorded" in lines and "- versions: not recorded" in lines


def test_probe_dict_device_becomes_its_name(monkeypatch):
    from longmoe.backends import get_backend
    monkeypatch.delenv("LONGMOE_COMMIT", raising=False)
    rep = stamp({"benchmark": "linear-ce", "date": "2026-01-01T00:00:00+00:00",
                 "device": {"device_name": "Some GPU", "arch": "x"}, "results": []},
                get_backend("cpu"))
    assert rep["device"] == "Some GPU" and rep["probe"]["arch"] == "x"
    assert rep["date"] == "2026-01-01T00:00:00+00:00" and "commit" in rep


def test_plain_table_lists_scalar_columns():
    # a tile config (dict of scalars) prints as k=v; lists and nested objects are left out
    text = plain_table({"rows": [{"T": 8, "ms": 1.23456, "cfg": {"a": 1, "b": "x"}, "l": [1]},
                                 {"T": 16, "x": "b|c", "deep": {"d": {"e": 1}}}]})
    head, _, first, second = text.splitlines()
    assert head == "| T | ms | cfg | x |" and first == "| 8 | 1.235 | a=1,b=x |  |"
    assert second == "| 16 |  |  | b\\|c |"
