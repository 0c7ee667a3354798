"""Checkpoint retention (longmoe.checkpoint.save.keep_newest / directory.remove_oldest): after a
publish, the step directories beyond the newest K go, oldest first, except the one just written,
the one `latest` names and any newer than the one just written; each is renamed to a
`*.tmp-removed-*` name before anything in it is deleted. On 2 gloo ranks rank 0 removes and
every rank gets the names. The CLI's train.keep_checkpoints and PolicyTrainer.save(keep=) on a
real model are in test_checkpoint_keep.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from longmoe.checkpoint import directory
from longmoe.checkpoint.directory import published_steps, remove_oldest, remove_stale_tmp
from longmoe.paired.spawn import run_ranks


def step_dir(root: Path, step: int) -> Path:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(f'{{"step": {step}}}')
    (path / "__0_0.distcp").write_bytes(bytes(64))
    return path


def checkpoints(root: Path, steps, latest: int) -> dict[int, Path]:
    paths = {s: step_dir(root, s) for s in steps}
    (root / "latest").write_text(f"step-{latest:08d}")
    return paths


def test_keeps_the_newest_k(tmp_path):
    p = checkpoints(tmp_path, [1, 2, 3, 4, 5], latest=5)
    assert remove_oldest(tmp_path, 2, p[5]) == ["step-00000001", "step-00000002", "step-00000003"]
    assert published_steps(tmp_path) == [4, 5]
    assert list(tmp_path.glob("*.tmp-*")) == []
    assert remove_oldest(tmp_path, 2, p[5]) == []
    assert remove_oldest(tmp_path, 9, p[5]) == []
    assert (p[4] / "manifest.json").is_file() and (p[5] / "manifest.json").is_file()


def test_spares_what_latest_names_and_what_was_just_written(tmp_path):
    p = checkpoints(tmp_path, [1, 2, 3, 4], latest=1)
    # keep=1: the newest is step 4, the one written; `latest` (left on step 1) is spared too.
    assert remove_oldest(tmp_path, 1, p[4]) == ["step-00000002", "step-00000003"]
    assert published_steps(tmp_path) == [1, 4]


def test_resave_of_an_earlier_step_spares_it_and_newer_steps(tmp_path):
    """A trainer that went back (loaded an earlier checkpoint, or started at step 0) re-saves
    step 2 while steps 3 and 4 exist: those are another run's; only older ones may go."""
    p = checkpoints(tmp_path, [1, 2, 3, 4], latest=2)
    assert remove_oldest(tmp_path, 1, p[2]) == ["step-00000001"]
    assert published_steps(tmp_path) == [2, 3, 4]
    # The same step re-saved as the newest: the step count does not change.
    q = checkpoints(tmp_path / "b", [1, 2, 3], latest=3)
    assert remove_oldest(tmp_path / "b", 2, q[3]) == ["step-00000001"]
    assert remove_oldest(tmp_path / "b", 2, q[3]) == []
    assert published_steps(tmp_path / "b") == [2, 3]


def test_a_kill_mid_removal_leaves_debris_the_next_holder_removes(tmp_path, monkeypatch):
    """The rename comes first: a kill after it leaves step-N.tmp-removed-<nonce>, which is not a
    published step, and the lock holder's cleanup of dead saves removes it."""
    p = checkpoints(tmp_path, [1, 2, 3], latest=3)
    monkeypatch.setattr(directory.shutil, "rmtree", lambda *a, **k: None)  # killed here
    assert remove_oldest(tmp_path, 1, p[3]) == ["step-00000001", "step-00000002"]
    debris = sorted(q.name for q in tmp_path.glob("*.tmp-*"))
    assert [re.fullmatch(r"step-0000000([12])\.tmp-removed-[0-9a-f]{8}", n) is not None
            for n in debris] == [True, True], debris
    assert published_steps(tmp_path) == [3]
    assert (tmp_path / debris[0] / "manifest.json").is_file()   # whole until deleted
    monkeypatch.undo()
    assert remove_stale_tmp(tmp_path) == debris
    assert sorted(q.name for q in tmp_path.iterdir()) == ["latest", "step-00000003"]


def test_bad_arguments_are_refused(tmp_path):
    p = checkpoints(tmp_path, [1, 2], latest=2)
    for keep in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="keep must be an int >= 1"):
            remove_oldest(tmp_path, keep, p[2])
    with pytest.raises(ValueError, match="not a published step directory"):
        remove_oldest(tmp_path, 1, tmp_path / "step-00000002.tmp-0badc0de")
    assert published_steps(tmp_path) == [1, 2]


def _ranks(rank, world, backend, root):
    from longmoe.checkpoint.save import keep_newest
    root = Path(root)
    out = {"removed": keep_newest(root, 2, root / "step-00000004")}
    try:
        keep_newest(root, 2, root / "not-a-step")  # rank 0 fails: every rank hears of it
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def test_rank0_removes_and_every_rank_gets_the_names(tmp_path):
    checkpoints(tmp_path, [1, 2, 3, 4], latest=4)
    r0, r1 = run_ranks(_ranks, 2, str(tmp_path))
    assert r0["removed"] == r1["removed"] == ["step-00000001", "step-00000002"]
    assert published_steps(tmp_path) == [3, 4]
    assert r0["error"].startswith("ValueError:") and "not a published step" in r0["error"]
    assert r1["error"].startswith("RuntimeError: removing checkpoints on rank 0 failed: "
                                  "ValueError:"), r1["error"]
