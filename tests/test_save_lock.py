"""PolicyTrainer.save takes the checkpoint directory's lock that `longmoe train --checkpoint-dir`
takes, from its first save into the directory on: a second run (another process) saving into
it is refused with one line and the first run's checkpoints stay intact; the process that holds
the lock (the CLI's one-process launch) claims it again freely."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from longmoe.errors import UserError

TESTS = Path(__file__).resolve().parent

# One trainer in its own process. "first": saves steps 0 and 1, says so, holds the directory
# until a line arrives on stdin, then saves step 2. "second": one save, refused or not.
SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from _api_samples import make_samples, run_dict
from longmoe.api import PolicyTrainer
from longmoe.errors import UserError
from longmoe.train.config import from_dict
d, role = sys.argv[1], sys.argv[2]
pt = PolicyTrainer(from_dict(run_dict(1)))
def step():
    pt.forward_backward(make_samples(pt.step, 3))
    pt.optim_step()
if role == "first":
    pt.save(d)
    step()
    pt.save(d)
    print("SAVED", flush=True)
    sys.stdin.readline()
    step()
    print("DONE", pt.save(d), flush=True)
else:
    try:
        pt.save(d)
    except UserError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    print("SAVED", flush=True)
"""


def _python(*args, **kw):
    return subprocess.Popen([sys.executable, "-c", SCRIPT, *map(str, args), str(TESTS)],
                            text=True, env={**os.environ, "LONGMOE_BACKEND": "cpu"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _files(root: Path) -> dict[str, str]:
    """Every file but the lock, with its sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_a_second_process_saving_into_a_held_directory_is_refused(tmp_path):
    from longmoe.checkpoint.directory import claim
    from longmoe.checkpoint.verify import check_step
    d = tmp_path / "ck"
    first = _python(d, "first", stdin=subprocess.PIPE)
    try:
        assert first.stdout.readline().strip() == "SAVED", first.stderr.read()
        before = _files(d)
        assert {"step-00000000/manifest.json", "step-00000001/manifest.json",
                "latest"} <= set(before)
        # The second trainer is at step 0: its save would replace the first's step-00000000.
        second = _python(d, "second")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 2, (out, err)
        line = err.strip()
        assert "\n" not in line and line.startswith(f"save: {d} is in use by another run (pid "
                                                    f"{first.pid} on "), line
        assert line.endswith("a checkpoint directory belongs to one run at a time"), line
        assert _files(d) == before          # nothing written, nothing removed
        first.stdin.write("go\n")
        first.stdin.flush()
        done = first.stdout.readline().split()
        assert done == ["DONE", str(d / "step-00000002")], (done, first.stderr.read())
    finally:
        first.stdin.close()
        first.wait(timeout=300)
    assert first.returncode == 0
    for n in range(3):
        verdict = check_step(d / f"step-{n:08d}")
        assert verdict["ok"] and verdict["step"] == n, verdict
    assert (d / "latest").read_text().strip() == "step-00000002"
    assert {k: v for k, v in _files(d).items() if k.startswith(("step-00000000/",
                                                                 "step-00000001/"))} == \
        {k: v for k, v in before.items() if k != "latest"}
    claim(d).release()                      # the first's lock ended with its process


def test_the_holding_process_claims_again_and_close_gives_it_up(tmp_path):
    """The CLI's one-process launch holds DIR's lock while its trainer saves there; another
    process is refused until every claim of this one is given up."""
    import random

    from longmoe.api import PolicyTrainer
    from longmoe.checkpoint import directory
    from longmoe.train.config import from_dict
    from _api_samples import run_dict
    d = tmp_path / "ck"
    other = [sys.executable, "-c", "import sys; from longmoe.checkpoint.directory import claim; "
                                   "claim(sys.argv[1])", str(d)]
    launcher = directory.claim(d)
    assert not launcher.shared
    pt = PolicyTrainer(from_dict(run_dict(random.randrange(1000))))
    assert Path(pt.save(d)).name == "step-00000000"
    assert pt._dirs[os.path.realpath(d)].shared
    (d / "step-00000009.tmp-dead").mkdir()   # a save that died: not ours to remove while shared
    launcher.release()
    refused = subprocess.run(other, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "is in use by another run" in refused.stderr
    pt.save(d)                               # still held by the trainer
    pt.close()
    assert subprocess.run(other, capture_output=True, text=True, timeout=120).returncode == 0
    # A fresh claim is the only writer: it removes the dead save's leftovers.
    again = PolicyTrainer(from_dict(run_dict(1)))
    again.save(tmp_path / "ck")
    assert not (d / "step-00000009.tmp-dead").exists()
    again.close()
    with pytest.raises(UserError, match=r"^save: .* exists and is not a directory"):
        again.save(d / "latest")
