"""Checkpoint retention where users set it: `longmoe train` with train.keep_checkpoints (a one-rank
gloo run of the tiny model in this process, then a --resume from what `latest` names), and
PolicyTrainer.save(keep=). The pruning rules themselves: test_checkpoint_retention.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from longmoe.errors import ConfigError, UserError

# The tiny model, one layer, on one rank without EP, FSDP or recompute: the property is which
# step directories remain, which needs no size.
TINY = ["--config", "cpu_demo", "--nproc", "1", "--set", "parallel.ep=1", "--set",
        "parallel.fsdp=false", "--set", "parallel.recompute=none", "--set", "parallel.chunks=1",
        "--set", "model.num_layers=1", "--set", "data.batch_size=2", "--set", "data.seq_len=32",
        "--set", "data.prompt_len=8", "--set", "data.group_size=2",
        "--set", "train.device=cpu", "--set", "train.checkpoint_every=1"]


def steps_in(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))


def train(ck: Path, steps: int, *extra: str) -> int:
    from longmoe.cli import main
    return main(["train", *TINY, "--steps", str(steps), "--checkpoint-dir", str(ck), *extra])


def test_train_keeps_the_newest_checkpoints_and_resumes_from_latest(tmp_path, capsys):
    ck = tmp_path / "ck"
    keep = ["--set", "train.keep_checkpoints=2"]
    assert train(ck, 4, *keep, "--metrics-out", str(tmp_path / "m.jsonl")) == 0
    out = capsys.readouterr().out
    assert steps_in(ck) == ["step-00000003", "step-00000004"]
    assert (ck / "latest").read_text().strip() == "step-00000004"
    assert "train.keep_checkpoints=2: removed step-00000001" in out, out
    assert "train.keep_checkpoints=2: removed step-00000002" in out, out
    assert list(ck.glob("*.tmp-*")) == []
    # The resume continues from step 4; its step-5 save drops the earlier run's step 3.
    assert train(ck, 5, *keep, "--resume", "--metrics-out", str(tmp_path / "m.jsonl")) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ck / 'step-00000004'} at step 4" in out, out
    assert "removed step-00000003" in out, out
    assert steps_in(ck) == ["step-00000004", "step-00000005"]
    logged = [json.loads(ln)["step"] for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5]
    # Without the setting (0, the default) every step stays.
    assert train(ck, 6, "--resume") == 0
    assert steps_in(ck) == ["step-00000004", "step-00000005", "step-00000006"]
    # --overwrite: its first publish replaces the earlier run's steps (all newer than step 1),
    # then retention counts this run's.
    capsys.readouterr()
    assert train(ck, 3, *keep, "--overwrite") == 0
    out = capsys.readouterr().out
    assert "--overwrite: removed the earlier step-00000004, step-00000005, step-00000006" in out
    assert steps_in(ck) == ["step-00000002", "step-00000003"]


@pytest.mark.parametrize("value, says", [("-1", "must be an integer >= 0"),
                                         ("1.5", "expected an integer"),
                                         ("true", "expected a number")])
def test_bad_keep_checkpoints_is_refused_naming_the_field(value, says):
    from longmoe.train.config import TrainConfig, load_run_config
    with pytest.raises(ConfigError, match="train.keep_checkpoints") as e:
        load_run_config("cpu_demo", [f"train.keep_checkpoints={value}"])
    assert says in str(e.value)
    with pytest.raises(ConfigError, match="train.keep_checkpoints"):
        TrainConfig(keep_checkpoints="2")
    assert load_run_config("cpu_demo", []).train.keep_checkpoints == 0


def test_policy_trainer_save_keep(tmp_path):
    """Retention looks at step numbers only, so the trainer's step is set rather than trained
    to (a forward_backward costs about a second of CPU here)."""
    from _api_samples import run_dict

    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    pt = PolicyTrainer(from_dict(run_dict(random.randrange(1000))))
    ck = tmp_path / "ck"
    try:
        for bad in (0, -2, True, 2.0, "2"):
            with pytest.raises(UserError, match=r"^save: keep must be an int >= 1 or None"):
                pt.save(ck, keep=bad)
        assert not ck.exists()                      # refused before anything is written
        pt.save(ck)
        for step in (1, 2, 3):
            pt.step = step
            assert pt.save(ck, keep=2) == str(ck / f"step-{step:08d}")
        assert steps_in(ck) == ["step-00000002", "step-00000003"]
        assert pt.save(ck, keep=2) == str(ck / "step-00000003")   # the same step again
        assert steps_in(ck) == ["step-00000002", "step-00000003"]
        assert list(ck.glob("*.tmp-*")) == []
        pt.step = 4
        pt.save(ck)                                 # keep=None keeps all
        assert steps_in(ck) == ["step-00000002", "step-00000003", "step-00000004"]
        pt.step = 5
        assert pt.save(ck, keep=1) == str(ck / "step-00000005")
        assert steps_in(ck) == ["step-00000005"]
        pt.step = 0
        assert Path(pt.load(ck)).name == "step-00000005" and pt.step == 5
    finally:
        pt.close()
