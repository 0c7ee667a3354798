"""The objective's settings and data: the loss section's new fields, the reference and rollout
log-probs of JSONL rows (checked like old_logprobs; required when the loss uses them, before any
rank starts), their place in the batch, and the whole-sample token counts the per-sample
aggregation modes need, kept through context-parallel splits."""

import json
import math
import subprocess
import sys

import pytest
import torch

from _rows import feed_rows, rows_of
from longmoe.data.packing import IGNORE
from longmoe.data.rows import FittedFile
from longmoe.errors import ConfigError, UserError
from longmoe.parallel.context_parallel import cp_share
from longmoe.parallel.mesh import Layout
from longmoe.rl.objective import local_counts
from longmoe.train.config import LossConfig, load_run_config
from longmoe.train.launch import validate
from longmoe.train.step import global_counts


def test_loss_section_fields():
    rc = load_run_config(None, ["loss.kl_coef=0.05", "loss.kl_estimator=k2", "loss.tis_cap=2",
                                "loss.dual_clip_c=3", "loss.loss_agg_mode=seq-mean-token-sum"])
    obj = rc.loss.objective()
    assert (obj.kl_coef, obj.kl_estimator, obj.tis_cap, obj.dual_clip_c, obj.loss_agg_mode) == \
        (0.05, "k2", 2.0, 3.0, "seq-mean-token-sum")
    assert set(rc.loss.required_logprobs()) == {"ref_logprobs", "rollout_logprobs"}
    assert "loss.kl_coef=0.05" in rc.loss.required_logprobs()["ref_logprobs"]
    d = LossConfig()  # every new term is off by default and needs no extra data
    assert (d.kl_coef, d.tis_cap, d.dual_clip_c, d.loss_agg_mode) == (0, 0, 0, "token-mean")
    assert d.required_logprobs() == {}


@pytest.mark.parametrize("override,field", [
    ("loss.kl_estimator=k5", "loss.kl_estimator"), ("loss.kl_coef=-1", "loss.kl_coef"),
    ("loss.kl_coef=.nan", "loss.kl_coef"), ("loss.tis_cap=-0.5", "loss.tis_cap"),
    ("loss.tis_cap=abc", "loss.tis_cap"), ("loss.dual_clip_c=1", "loss.dual_clip_c"),
    ("loss.loss_agg_mode=sum", "loss.loss_agg_mode"), ("loss.loss_agg_mode=3", "loss.loss_agg_mode"),
])
def test_bad_loss_fields_name_the_field(override, field):
    with pytest.raises(ConfigError, match=f"^{field}: ") as e:
        load_run_config(None, [override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("f", ["kl_coef", "tis_cap", "dual_clip_c"])
def test_sft_rejects_policy_terms(f):
    with pytest.raises(ConfigError, match=f"^loss.{f}: applies to loss.type=grpo only"):
        LossConfig(type="sft", **{f: 3.0})


# ---- JSONL ----------------------------------------------------------------------------------

ROW = {"prompt": [1, 2], "response": [3, 4, 5], "advantage": 0.5}


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


@pytest.mark.parametrize("field", ["ref_logprobs", "rollout_logprobs"])
@pytest.mark.parametrize("value,msg", [
    ([-1.0, -2.0], "must be a list of 3 values"),
    ([-1.0, 0.5, -2.0], r"\[1\]: 0.5 is positive"),
    ([-1.0, "x", -2.0], r"\[1\]: 'x' is not a number"),
    ("[-1.0, -2.0, -Infinity]", r"\[2\]: -inf is not a finite"),
    ([-1.0, -2.0, -1e39], r"\[2\]: -1e\+39 is not a finite float32"),
])
def test_logprob_fields_checked_like_old_logprobs(tmp_path, field, value, msg):
    if isinstance(value, str):
        bad = json.dumps(ROW)[:-1] + f', "{field}": {value}}}'
    else:
        bad = {**ROW, field: value}
    p = _write(tmp_path, [ROW, bad])
    with pytest.raises(UserError, match=f"^{p}:2: {field}.*{msg}" if "list" not in msg
                       else f"^{p}:2: {field} {msg}"):
        FittedFile(p, 40, 8)


def test_required_logprobs_missing_is_an_error_at_load(tmp_path):
    full = {**ROW, "ref_logprobs": [-1.0, -2.0, -3.0], "rollout_logprobs": [-0.5] * 3}
    p = _write(tmp_path, [full, {**ROW, "ref_logprobs": [-1.0] * 3}])
    need = LossConfig(kl_coef=0.1, tis_cap=2.0).required_logprobs()
    with pytest.raises(UserError, match=rf"^{p}:2: missing field 'rollout_logprobs' "
                                        rf"\(loss.tis_cap=2 needs the rollout engine's"):
        FittedFile(p, 40, 8, require=need)
    with pytest.raises(UserError, match="missing field 'rollout_logprobs'"):
        feed_rows(dict(source="jsonl", path=str(p), batch_size=2, seq_len=8), 0, vocab=40,
                  loss=dict(kl_coef=0.1, tis_cap=2.0))
    # Without the TIS term the same file loads: the field is optional.
    assert len(FittedFile(p, 40, 8, require=LossConfig(kl_coef=0.1).required_logprobs()).kept) == 2


def test_launch_rejects_missing_ref_logprobs_before_any_rank(tmp_path):
    p = _write(tmp_path, [ROW, ROW])
    run = load_run_config(None, ["data.source=jsonl", f"data.path={p}", "data.batch_size=2",
                                 "data.seq_len=8", "loss.kl_coef=0.02", "train.device=cpu"])
    with pytest.raises(UserError, match=f"^{p}:1: missing field 'ref_logprobs' "
                                        r"\(loss.kl_coef=0.02 needs the reference"):
        validate(run, 1)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {{preset: tiny}}\ndata: {{source: jsonl, path: '{p}', batch_size: 2, "
                   f"seq_len: 8}}\nloss: {{kl_coef: 0.02}}\ntrain: {{device: cpu}}\n")
    out = subprocess.run([sys.executable, "-m", "longmoe", "train", "--config", str(cfg),
                          "--nproc", "1"],
                         capture_output=True, text=True, timeout=300)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "ref_logprobs" in errors[0] and f"{p}:1" in errors[0]


def test_truncation_cuts_every_logprob_field(tmp_path):
    long = {"prompt": [1, 2], "response": [3, 4, 5, 6, 7, 8], "advantage": 1.0,
            "old_logprobs": [-0.1] * 6, "ref_logprobs": [-0.2, -0.3, -0.4, -0.5, -0.6, -0.7],
            "rollout_logprobs": [-0.9] * 6}
    bt, _ = feed_rows(dict(source="jsonl", path=str(_write(tmp_path, [long])), batch_size=1,
                           seq_len=4, overlong="truncate"), 0, vocab=40)
    trained = bt.labels[0] != IGNORE   # 4 positions: the prompt's last and 3 response tokens
    assert bt.labels[0][trained].tolist() == [3, 4, 5]
    assert torch.equal(bt.ref_logprobs[0][trained], torch.tensor([-0.2, -0.3, -0.4]))
    assert torch.equal(bt.rollout_logprobs[0][trained], torch.tensor([-0.9] * 3))
    assert torch.equal(bt.old_logprobs[0][trained], torch.tensor([-0.1] * 3))


# ---- batches ----------------------------------------------------------------------------------

def test_pack_places_ref_and_rollout_logprobs():
    s1 = {"prompt": [7, 8], "response": [11, 12, 13], "advantage": 1.0, "loss_mask": [1, 0, 1],
          "ref_logprobs": [-0.1, -0.2, -0.3], "rollout_logprobs": [-1.1, -1.2, -1.3]}
    s2 = {"prompt": [3], "response": [21, 22], "advantage": -0.5}
    bt = rows_of([s1, s2], 6)
    trained = bt.labels[0] != IGNORE
    assert trained.tolist() == [False, True, False, True, False, False]
    torch.testing.assert_close(bt.ref_logprobs[0][trained], torch.tensor([-0.1, -0.3]))
    torch.testing.assert_close(bt.rollout_logprobs[0][trained], torch.tensor([-1.1, -1.3]))
    assert torch.isnan(bt.ref_logprobs[0][~trained]).all()
    assert torch.isnan(bt.ref_logprobs[1]).all() and torch.isnan(bt.rollout_logprobs[1]).all()
    # One sample per row: each of its tokens carries its trained-token count, padding 0.
    assert bt.sample_tokens.tolist() == [[2] * 5 + [0], [2] * 3 + [0] * 3]


def test_synthetic_has_every_logprob_field():
    cfg = dict(batch_size=4, seq_len=20, prompt_len=4, group_size=2)
    bt, _ = feed_rows(cfg, 1, vocab=37, seed=3)
    mask = bt.labels != IGNORE
    for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        t = getattr(bt, f)
        torch.testing.assert_close(t[mask], torch.full((int(mask.sum()),), -math.log(37)))
        assert torch.isnan(t[~mask]).all()


def test_sample_tokens_survive_to_and_context_parallel_split():
    s = [{"prompt": [1] * p, "response": [2] * r, "advantage": 1.0} for p, r in ((2, 7), (5, 2))]
    bt = rows_of(s, 8).to("cpu")
    assert bt.sample_tokens[:, 0].tolist() == [7, 2]
    assert global_counts(bt, Layout(1, 0, 1, None, None, None)) == (9, 2)
    # Each CP rank holds part of every sequence; counts stay those of the whole samples and
    # the ranks' sample shares add up to the two samples.
    shares = []
    for r in range(2):
        layout = Layout(2, r, 1, None, None, None, cp=2)
        part, pos = cp_share(bt, layout.cp, layout.cp_rank)
        assert part.input_ids.shape == (2, 4) and part.sample_tokens[:, 0].tolist() == [7, 2]
        assert torch.equal(part.ref_logprobs.isnan(), torch.ones(2, 4, dtype=torch.bool))
        shares.append(local_counts(part.labels != IGNORE, part.sample_tokens))
    assert [round(float(x), 9) for x in sum(shares)] == [9, 2]
