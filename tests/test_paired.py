"""The paired-test record itself: a comparison that compared nothing, or only empty tensors, or
that produced a NaN, fails; the CLI says why in its last line."""

from __future__ import annotations

import pytest
import torch

from longmoe.paired.harness import PairedResult, rel_err


def _res():
    return PairedResult("demo", "cand", "reference", tolerance=1e-6)


def test_nothing_compared_fails():
    res = _res()
    assert not res.ok and res.failures() == ["nothing was compared"]
    assert res.to_dict()["ok"] is False


def test_only_empty_tensors_compared_fails():
    res = _res()
    res.add("out", torch.empty(0, 3), torch.empty(0, 3))
    res.add("grad", torch.empty(0), torch.empty(0))
    assert res.errors == {"out": 0.0, "grad": 0.0}
    assert not res.ok and "every compared tensor is empty" in res.failures()[0]
    res.add("loss", torch.tensor(1.0), torch.tensor(1.0))  # one real quantity: now it compares
    assert res.ok, res.failures()


def test_nan_error_fails_even_beside_small_ones():
    res = _res()
    res.add("a", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    res.add("b", torch.tensor([float("nan")]), torch.tensor([1.0]))
    res.add("c", torch.tensor([3.0]), torch.tensor([3.0]))
    assert res.max_error != res.max_error and not res.ok
    assert [f.split(":")[0] for f in res.failures()] == ["b"]


def test_out_of_tolerance_fails_and_shape_mismatch_raises():
    res = _res()
    res.add("x", torch.tensor([1.0, 2.0 + 1e-3]), torch.tensor([1.0, 2.0]))
    assert not res.ok and res.failures()[0].startswith("x: ")
    with pytest.raises(ValueError, match="shape mismatch"):
        rel_err(torch.zeros(2), torch.zeros(3))


def test_cli_summary_names_what_failed(monkeypatch, capsys):
    from longmoe.paired import cli
    monkeypatch.setattr(cli, "run_paired", lambda *a, **k: _res())
    assert cli.run_paired_cli("linear_ce", seed=7) == 1
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == ("paired demo: cand vs reference, FAIL: nothing was "
                                           "compared")
    assert "seed 7" in err
