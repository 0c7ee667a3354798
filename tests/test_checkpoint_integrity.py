"""Checkpoints that cannot run code, are verified by content, and belong to one run; through the
CLI on 2 gloo ranks (cpu_demo scaled down, as in test_checkpoint.py).

One base run saves steps 2 and 4. While it holds the directory, a second run is refused and a
temporary directory it does not own is planted (its saves must leave that alone). Copies of the
finished directory then get one defect each (a pickle that writes a marker file when unpickled,
in each place a checkpoint holds pickles; random bytes; truncation; garbled JSON) and each
`--resume` must be refused in one line naming the file, before any rank starts, with no marker.
Those runs (about twenty CLI launches) are the slow tier; the checks that need no run are fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_checkpoint import ENV, SMALL, TIMEOUT_S, longmoe, one_error_line, train

STEP2, STEP4 = "step-00000002", "step-00000004"
PEER_TMP = "step-00000099.tmp-peer"


class Bomb:
    """Unpickling calls open(marker, "w"): the marker file exists iff the pickle ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def bomb_bytes(marker: Path) -> bytes:
    return pickle.dumps(Bomb(marker), protocol=2)


def rehash(step_dir: Path, name: str):
    """What an attacker who also edits the manifest does: the listed size and sha256 match."""
    mpath = step_dir / "manifest.json"
    m = json.loads(mpath.read_text())
    data = (step_dir / name).read_bytes()
    m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    mpath.write_text(json.dumps(m))


def shard_with_bytes_entry(step_dir: Path) -> tuple[str, int, int]:
    """(shard, offset, length) of a pickled non-tensor entry (an optimizer hyper-parameter)."""
    from longmoe.checkpoint.manifest import read_manifest
    from longmoe.checkpoint.safe import read_dcp_metadata
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    md = read_dcp_metadata(step_dir, read_manifest(step_dir))
    for idx, info in md.storage_data.items():
        if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata):
            return info.relative_path, info.offset, info.length
    raise AssertionError("no non-tensor entry in the checkpoint")


# id -> (how to damage step-4 of a copy, substrings the error line must name)
def _rng_bomb(s: Path, marker: Path):
    """Same size as the file it replaces: only the digest can tell."""
    p = s / "rng-rank0.pt"
    blob = bomb_bytes(marker)
    p.write_bytes(blob + b"\0" * (p.stat().st_size - len(blob)))


def _rng_bomb_rehashed(s: Path, marker: Path):
    _rng_bomb(s, marker)
    rehash(s, "rng-rank0.pt")


def _metadata_bomb_rehashed(s: Path, marker: Path):
    (s / ".metadata").write_bytes(bomb_bytes(marker))
    rehash(s, ".metadata")


def _shard_entry_bomb_rehashed(s: Path, marker: Path):
    shard, offset, length = shard_with_bytes_entry(s)
    blob = bomb_bytes(marker)
    assert len(blob) <= length
    with open(s / shard, "r+b") as f:  # pickle stops at its STOP opcode: the padding is unread
        f.seek(offset)
        f.write(blob + b"\0" * (length - len(blob)))
    rehash(s, shard)


def _unlisted_bomb(s: Path, marker: Path):
    (s / "extra.pt").write_bytes(bomb_bytes(marker))


def _flip_shard(s: Path, marker: Path):
    p = s / "__1_0.distcp"
    with open(p, "r+b") as f:
        f.seek(p.stat().st_size // 2)
        f.write(os.urandom(256))


def _truncate_shard(s: Path, marker: Path):
    p = s / "__0_0.distcp"
    os.truncate(p, p.stat().st_size // 3)


def _garble_meta_rehashed(s: Path, marker: Path):
    (s / "meta.json").write_text('{"model": {"num_layers": 2,')
    rehash(s, "meta.json")


def _garble_manifest(s: Path, marker: Path):
    (s / "manifest.json").write_text('{"format": "longmoe-checkpoint-1", "files": [')


def _no_manifest(s: Path, marker: Path):
    (s / "manifest.json").unlink()


def _bad_pointer(s: Path, marker: Path):
    (s.parent / "latest").write_text("../../somewhere-else\n")


DAMAGE = {
    "rng_pickle": (_rng_bomb, ["rng-rank0.pt", "sha256"]),
    "rng_pickle_rehashed": (_rng_bomb_rehashed, ["rng-rank0.pt", "refused", "io.open"]),
    "metadata_pickle_rehashed": (_metadata_bomb_rehashed, [".metadata", "refused",
                                                           "io.open"]),
    "shard_entry_pickle_rehashed": (_shard_entry_bomb_rehashed, [".distcp", "refused"]),
    "unlisted_pickle": (_unlisted_bomb, ["extra.pt", "not listed"]),
    "shard_random_bytes": (_flip_shard, ["__1_0.distcp", "sha256", "damaged"]),
    "shard_truncated": (_truncate_shard, ["__0_0.distcp", "truncated"]),
    "meta_garbled_rehashed": (_garble_meta_rehashed, ["meta.json", "not valid JSON"]),
    "manifest_garbled": (_garble_manifest, ["manifest.json", "not valid JSON"]),
    "no_manifest": (_no_manifest, [STEP4, "older longmoe without a manifest"]),
    "bad_pointer": (_bad_pointer, ["latest", "not a step directory"]),
}


def wait_for_first_step(metrics: Path, proc: subprocess.Popen):
    """Step 1 is logged: the launcher holds the lock, has cleaned up, and the ranks train."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.05)
    raise AssertionError("the base run never logged a step")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckint")
    r = {"dir": d}
    base = subprocess.Popen(
        [sys.executable, "-m", "longmoe", "train", *SMALL, "--steps", "4", "--set",
         "train.checkpoint_every=2", "--checkpoint-dir", "ckS", "--metrics-out", "mS.jsonl"],
        cwd=d, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        wait_for_first_step(d / "mS.jsonl", base)
        # The whole run stopped (launcher and ranks) still holds the lock: the second run meets
        # a live owner, and the tmp directory planted now is there for the step-4 save at least.
        os.killpg(base.pid, signal.SIGSTOP)
        assert not (d / "ckS" / STEP4).exists(), "the base run finished before it was stopped"
        (d / "ckS" / PEER_TMP).mkdir()
        r["second"] = train(d, 2, "ckS", "--overwrite")
        r["base_alive_during_second"] = base.poll() is None
        os.killpg(base.pid, signal.SIGCONT)
        out, err = base.communicate(timeout=TIMEOUT_S)
    finally:
        if base.poll() is None:
            os.killpg(base.pid, signal.SIGKILL)
    assert base.returncode == 0, err[-3000:]
    r["base_out"], r["base_pid"] = out, base.pid
    ck = d / "ckS"
    r["peer_tmp_survived"] = (ck / PEER_TMP).is_dir()
    shutil.rmtree(ck / PEER_TMP)

    copies = {}
    for name, (damage, _) in DAMAGE.items():
        copies[name] = d / f"ck_{name}"
        shutil.copytree(ck, copies[name])
        damage(copies[name] / STEP4, d / f"marker_{name}")
    for name in ("allow", "overwrite", "fresh", "batch"):
        shutil.copytree(ck, d / f"ck_{name}")
    # A pointer one step behind the newest step directory (as a kill between the two renames
    # of a save leaves it): the resume continues from what `latest` names, and says so.
    (d / "ck_allow" / "latest").write_text(STEP2)
    (d / "a_file").write_text("not a directory\n")

    jobs = {name: (4 + 2, str(path), "--resume") for name, path in copies.items()}
    jobs["batch_changed"] = (6, "ck_batch", "--resume", "--set", "data.batch_size=2")
    jobs["fresh_into_full"] = (6, "ck_fresh")
    jobs["dir_is_file"] = (2, "a_file")
    jobs["parent_is_file"] = (2, "a_file/sub")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(train, d, *job) for name, job in jobs.items()}
        futures["allow"] = pool.submit(train, d, 3, "ck_allow", "--resume",
                                       "--allow-batch-change", "--set", "data.batch_size=2")
        futures["overwrite"] = pool.submit(train, d, 2, "ck_overwrite", "--overwrite",
                                           "--set", "optim.lr=0.002")
        verify = {"good": ["checkpoint", "verify", "ckS"],
                  "good_all_json": ["checkpoint", "verify", "ckS", "--all", "--json"],
                  "good_step_dir": ["checkpoint", "verify", f"ckS/{STEP2}"],
                  "flipped": ["checkpoint", "verify", "ck_shard_random_bytes"],
                  "flipped_all": ["checkpoint", "verify", "ck_shard_random_bytes", "--all"],
                  "empty": ["checkpoint", "verify", "."]}
        for name, argv in verify.items():
            futures[f"verify_{name}"] = pool.submit(longmoe, *argv, cwd=d)
        r.update({name: f.result() for name, f in futures.items()})
    return r


@pytest.mark.slow
def test_second_run_on_a_held_directory_is_refused(runs):
    assert runs["base_alive_during_second"]
    line = one_error_line(runs["second"])
    assert "ckS" in line and "in use by another run" in line, line
    holder = json.loads((runs["dir"] / "ckS" / ".lock").read_text())
    assert holder["pid"] == runs["base_pid"]  # the launching process, not a rank
    assert f"pid {holder['pid']} on {holder['host']}" in line, line


@pytest.mark.slow
def test_saves_leave_other_temporary_directories_alone(runs):
    assert runs["peer_tmp_survived"]
    ck = runs["dir"] / "ckS"
    assert (ck / "latest").read_text().strip() == STEP4
    for step in (STEP2, STEP4):
        names = {p.name for p in (ck / step).iterdir()}
        assert {"manifest.json", "meta.json", ".metadata", "rng-rank0.pt",
                "rng-rank1.pt"} <= names, names


@pytest.mark.slow
def test_manifest_lists_every_file_with_its_digest_and_the_run_identity(runs):
    step = runs["dir"] / "ckS" / STEP4
    m = json.loads((step / "manifest.json").read_text())
    listed = set(m["files"])
    assert listed == {p.name for p in step.iterdir()} - {"manifest.json"}
    for name, entry in m["files"].items():
        data = (step / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert m["step"] == 4
    ident = m["identity"]
    assert (ident["global_batch"], ident["world"], ident["ep"], ident["cp"]) == (8, 2, 2, 1)
    assert len(ident["config_sha256"]) == 64


def test_the_bombs_would_go_off_if_unpickled(tmp_path):
    """The damage cases are real: plain unpickling of the planted bytes writes the marker."""
    marker = tmp_path / "marker"
    pickle.loads(bomb_bytes(marker))
    assert marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(runs, case):
    _, must_name = DAMAGE[case]
    line = one_error_line(runs[case])
    for s in must_name:
        assert s in line, f"{s!r} not in {line!r}"
    assert not (runs["dir"] / f"marker_{case}").exists(), "a pickle from the checkpoint ran"
    # Refused before anything was written: the damaged copy keeps its latest and its steps.
    ck = runs["dir"] / f"ck_{case}"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == [STEP2, STEP4]


@pytest.mark.slow
def test_resume_at_another_global_batch_is_refused(runs):
    line = one_error_line(runs["batch_changed"])
    assert "8" in line and "2" in line and "--allow-batch-change" in line, line


@pytest.mark.slow
def test_allowed_batch_change_says_what_differs(runs):
    p = runs["allow"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from ck_allow/{STEP2} at step 2" in p.stdout, p.stdout
    assert "global batch 8 -> 2" in p.stdout, p.stdout
    assert f"{STEP4} is newer than {STEP2}" in p.stdout, p.stdout
    m = json.loads((runs["dir"] / "ck_allow" / "step-00000003" / "manifest.json").read_text())
    assert m["identity"]["global_batch"] == 2


@pytest.mark.slow
def test_fresh_run_into_a_directory_with_checkpoints_is_refused(runs):
    line = one_error_line(runs["fresh_into_full"])
    assert "ck_fresh" in line and "--resume" in line and "--overwrite" in line, line
    assert (runs["dir"] / "ck_fresh" / "latest").read_text().strip() == STEP4


@pytest.mark.slow
def test_checkpoint_dir_that_is_a_file_is_refused(runs):
    assert "a_file" in one_error_line(runs["dir_is_file"])
    line = one_error_line(runs["parent_is_file"])
    assert "a_file/sub" in line and "cannot create" in line, line


@pytest.mark.slow
def test_overwrite_replaces_the_earlier_checkpoints_once_its_own_is_published(runs):
    p = runs["overwrite"]
    assert p.returncode == 0, p.stderr[-3000:]
    ck = runs["dir"] / "ck_overwrite"
    assert (ck / "latest").read_text().strip() == STEP2
    assert sorted(q.name for q in ck.iterdir() if q.name.startswith("step-")) == [STEP2]
    assert f"removed the earlier {STEP4}" in p.stdout, p.stdout
    new = json.loads((ck / STEP2 / "manifest.json").read_text())
    old = json.loads((runs["dir"] / "ckS" / STEP2 / "manifest.json").read_text())
    assert new["identity"]["config_sha256"] != old["identity"]["config_sha256"]  # optim.lr


@pytest.mark.slow
def test_verify_good_checkpoints(runs):
    p = runs["verify_good"]
    assert p.returncode == 0, p.stderr
    assert STEP4 in p.stdout and "1 of 1" in p.stdout, p.stdout
    report = json.loads(runs["verify_good_all_json"].stdout)
    assert runs["verify_good_all_json"].returncode == 0
    assert report["ok"] and report["latest"] == STEP4
    assert [c["step"] for c in report["checkpoints"]] == [2, 4]
    assert runs["verify_good_step_dir"].returncode == 0
    assert STEP2 in runs["verify_good_step_dir"].stdout


@pytest.mark.slow
def test_verify_names_the_damaged_file(runs):
    for name in ("verify_flipped", "verify_flipped_all"):
        p = runs[name]
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert p.returncode == 1, (p.returncode, p.stderr)
        assert len(errors) == 1 and "__1_0.distcp" in errors[0], p.stderr
        assert "Traceback" not in p.stderr
    assert "1 of 2" in runs["verify_flipped_all"].stdout
    one_error_line(runs["verify_empty"])


@pytest.mark.slow
def test_old_copy_named_by_latest_mid_resave_counts_and_is_kept(runs, tmp_path):
    """A kill between the renames of a re-save leaves `latest` on the step's old copy, under a
    tmp name: it verifies, and the lock holder's cleanup of dead saves' leftovers keeps it."""
    from longmoe.checkpoint.directory import remove_stale_tmp
    from longmoe.checkpoint.verify import verify
    ck = tmp_path / "ck"
    shutil.copytree(runs["dir"] / "ckS", ck)
    aside = f"{STEP4}.tmp-old-0badc0de"
    os.replace(ck / STEP4, ck / aside)
    (ck / "latest").write_text(aside)
    (ck / "step-00000007.tmp-dead").mkdir()
    report = verify(ck)
    assert report["latest"] == aside and [c["ok"] for c in report["checkpoints"]] == [True]
    assert remove_stale_tmp(ck) == ["step-00000007.tmp-dead"]
    assert (ck / aside / "manifest.json").is_file()


# ---- in-process pieces -------------------------------------------------------------------------

def test_lock_is_exclusive_and_released(tmp_path):
    """Exclusive between processes; the holding process claims it again (a PolicyTrainer saving
    inside a one-process run), and the lock drops with this process's last claim."""
    import subprocess
    import sys

    from longmoe.checkpoint.directory import claim
    other = [sys.executable, "-c", "import sys; from longmoe.checkpoint.directory import claim; "
                                   "claim(sys.argv[1])", str(tmp_path / "ck")]
    first = claim(tmp_path / "ck")
    again = claim(tmp_path / "ck")
    assert not first.shared and again.shared
    first.release()
    refused = subprocess.run(other, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert f"in use by another run (pid {os.getpid()} on" in refused.stderr, refused.stderr
    again.release()
    assert subprocess.run(other, capture_output=True, text=True, timeout=120).returncode == 0
    claim(tmp_path / "ck").release()


def test_config_hash_covers_what_is_trained(tmp_path):
    from longmoe.checkpoint.manifest import config_hash, run_identity
    from longmoe.train.config import load_run_config
    base = load_run_config("cpu_demo")
    same = load_run_config("cpu_demo", ["train.steps=99", "train.nproc=4", "data.batch_size=2",
                                        "parallel.ep=1", "train.checkpoint_every=3",
                                        "train.keep_checkpoints=2"])
    other = load_run_config("cpu_demo", ["optim.lr=0.5"])
    assert config_hash(base) == config_hash(same) != config_hash(other)
    # data.batch_size is the global batch: the same at any world size or CP.
    assert run_identity(same, 4, 1, 1)["global_batch"] == 2
    assert run_identity(same, 4, 1, 2)["global_batch"] == 2
    assert run_identity(same, 4, 1, 2)["cp"] == 2


def test_digest_is_streamed_over_chunks(tmp_path):
    from longmoe.checkpoint import manifest
    data = os.urandom(3 * 4096 + 17)
    (tmp_path / "f").write_bytes(data)
    old, manifest._CHUNK = manifest._CHUNK, 4096
    try:
        got = manifest.sha256_file(tmp_path / "f")
    finally:
        manifest._CHUNK = old
    assert got == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs a directory nobody may create files in")
def test_unwritable_checkpoint_dir_is_refused():
    from longmoe.errors import UserError
    from longmoe.checkpoint.directory import claim
    with pytest.raises(UserError, match="--checkpoint-dir: /sys is not writable"):
        claim("/sys")


def test_rank_side_loaders_refuse_pickles(tmp_path):
    """What the ranks use inside dcp.load, should a file change after the launcher's check."""
    import io

    from longmoe.errors import UserError
    from longmoe.checkpoint.safe import WeightsOnlyPlanner, read_dcp_metadata
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    marker = tmp_path / "marker"
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("optim.lr"),
                    dest_offsets=(), storage_index=MetadataIndex("optim.lr"),
                    storage_offsets=(), lengths=())
    with pytest.raises(UserError, match="entry 'optim.lr': refused to load it"):
        WeightsOnlyPlanner(tmp_path).load_bytes(item, io.BytesIO(bomb_bytes(marker)))
    data = bomb_bytes(marker)
    (tmp_path / ".metadata").write_bytes(data)
    manifest = {"files": {".metadata": {"size": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}}}
    with pytest.raises(UserError, match="metadata: refused to read it: it names io.open"):
        read_dcp_metadata(tmp_path, manifest)
    assert not marker.exists()


@pytest.mark.parametrize("argv, flag", [
    (["--overwrite"], "--overwrite"),
    (["--overwrite", "--resume", "--checkpoint-dir", "ck"], "--overwrite"),
    (["--allow-batch-change", "--checkpoint-dir", "ck"], "--allow-batch-change"),
])
def test_flag_combinations_are_checked(capsys, argv, flag):
    from longmoe.cli import main
    assert main(["train", "--config", "cpu_demo", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}:"), err
