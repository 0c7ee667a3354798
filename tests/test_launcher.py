"""The launcher's supervision of its ranks, on real spawned processes.

With stand-in rank functions (fast): a UserError in one rank is its one line (exit 2), any other
error names the rank (exit 1), a rank that kills itself with SIGKILL is named with the signal, a
run that stops on non-finite steps exits 3; the surviving ranks are stopped at once.
Through `longmoe train` on the cpu_demo layout: SIGKILL to one rank, SIGINT to the launcher alone
and SIGKILL to the launcher each end every rank within 5 s and leave nothing in TMPDIR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from longmoe.errors import UserError

# ---- stand-in ranks ----------------------------------------------------------------------------


def _user_error(rank, world, rendezvous):
    if rank == 1:
        raise UserError("data.path: only rank 1 could see this")
    time.sleep(60)  # stopped by the launcher, long before this ends


def _crash(rank, world, rendezvous):
    if rank == 1:
        raise RuntimeError("boom\nsecond line")
    time.sleep(60)


def _sigkill(rank, world, rendezvous):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def _stopped(rank, world, rendezvous):
    from longmoe.train.supervise import TrainingStopped
    raise TrainingStopped("training stopped after step 3: the test says so")


def _fine(rank, world, rendezvous):
    assert os.path.basename(rendezvous) == "rendezvous"


@pytest.mark.parametrize("target,code,line", [
    (_user_error, 2, "error: data.path: only rank 1 could see this"),
    (_crash, 1, "error: rank 1 failed: RuntimeError: boom"),
    (_sigkill, 1, "error: rank 1 was killed by SIGKILL"),
    (_stopped, 3, "error: training stopped after step 3: the test says so"),
    (_fine, 0, None),
], ids=["user-error", "crash", "sigkill", "stopped", "fine"])
def test_rank_failure_is_one_line(tmp_path, capfd, target, code, line):
    from longmoe.train.supervise import supervise
    t0 = time.monotonic()
    assert supervise(target, 2, (), str(tmp_path)) == code
    assert time.monotonic() - t0 < 30  # rank 0's 60 s sleep was cut short
    err = capfd.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    if line is None:
        assert errors == [], err
        return
    assert len(errors) == 1 and errors[0].startswith(line), err
    assert err.rstrip().endswith(errors[0])  # the line ends the output
    if target is _crash:  # an internal error keeps its traceback, once, before the line
        assert err.count("Traceback") == 1 and 'raise RuntimeError("boom' in err
    else:
        assert "Traceback" not in err, err


# ---- through `longmoe train` -------------------------------------------------------------------

LONG_RUN = ["train", "--config", "cpu_demo", "--steps", "500", "--set", "data.batch_size=8",
            "--set", "data.seq_len=64", "--set", "data.prompt_len=16"]


def _children(pid: int) -> list[int]:
    """The launcher's rank processes (spawned interpreters; not multiprocessing's resource
    tracker), oldest first: rank 0 is started first."""
    kids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and "spawn_main" in cmd:
            kids.append((int(fields[19]), int(d.name)))  # start time, pid
    return [p for _, p in sorted(kids)]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _launch_and(kill, tmp: Path) -> dict:
    """Start a long run with a private TMPDIR, wait for its first step, call kill(launcher pid,
    rank pids), and report how it ended."""
    tmpdir, cache = tmp / "tmp", tmp / "compile-cache"
    tmpdir.mkdir()
    # torch's compile cache is meant to outlive a run: kept out of TMPDIR, so it must be empty
    env = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmpdir),
           "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    p = subprocess.Popen([sys.executable, "-m", "longmoe", *LONG_RUN], cwd=tmp, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    try:
        for line in p.stdout:
            if line.startswith("step    1/"):
                break
        else:
            raise AssertionError("no first step: " + "".join(err)[-3000:])
        ranks = _children(p.pid)
        assert len(ranks) == 2, ranks
        t0 = time.monotonic()
        kill(p.pid, ranks)
        threading.Thread(target=p.stdout.read, daemon=True).start()  # keep the pipe drained
        while any(_alive(r) for r in ranks) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        gone = time.monotonic() - t0
        try:
            code = p.wait(timeout=60)  # the launcher's own exit: interpreter teardown after torch
        except subprocess.TimeoutExpired:
            code = None
        reader.join(5)
        return {"code": code, "ranks_alive": [r for r in ranks if _alive(r)], "ranks_gone_s": gone,
                "stderr": "".join(err), "tmp": sorted(x.name for x in tmpdir.iterdir())}
    finally:
        if p.poll() is None:
            p.kill()


def _kill_rank1(launcher, ranks):
    os.kill(ranks[1], signal.SIGKILL)


def _sigint_launcher(launcher, ranks):
    os.kill(launcher, signal.SIGINT)


def _sigkill_launcher(launcher, ranks):
    os.kill(launcher, signal.SIGKILL)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    cases = {"rank1": _kill_rank1, "sigint": _sigint_launcher, "launcher": _sigkill_launcher}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futs = {k: pool.submit(_launch_and, fn, tmp_path_factory.mktemp(k))
                for k, fn in cases.items()}
        return {k: f.result() for k, f in futs.items()}


def test_rank_killed_by_sigkill_is_named(killed):
    r = killed["rank1"]
    errors = [ln for ln in r["stderr"].splitlines() if ln.startswith("error:")]
    assert r["code"] == 1, r["stderr"][-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 was killed by SIGKILL"), \
        r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"], r["stderr"][-3000:]
    assert r["ranks_gone_s"] < 5 and r["ranks_alive"] == [] and r["tmp"] == [], r


def test_sigint_to_the_launcher_stops_every_rank(killed):
    r = killed["sigint"]
    assert r["code"] == 128 + signal.SIGINT, r["stderr"][-3000:]
    assert r["ranks_gone_s"] < 5 and r["ranks_alive"] == [], r
    errors = [ln for ln in r["stderr"].splitlines() if ln.startswith("error:")]
    assert errors == ["error: stopped by SIGINT: every rank ended"], r["stderr"][-3000:]
    assert "Traceback" not in r["stderr"]
    assert r["tmp"] == [], r["tmp"]


def test_ranks_of_a_killed_launcher_exit_and_clean_up(killed):
    r = killed["launcher"]
    assert r["code"] == -signal.SIGKILL
    assert r["ranks_alive"] == [] and r["ranks_gone_s"] < 5, r
    assert r["tmp"] == [], r["tmp"]
