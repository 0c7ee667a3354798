"""A checkpoint directory and who owns it.

DIR/.lock is held (fcntl.flock, exclusive) by the launching process for the whole run (by
PolicyTrainer from its first save into DIR on), so two runs never write one directory; the
kernel drops the lock when its holder dies, even by SIGKILL, and the file then only records who
held it last. Holding the lock makes a run the directory's only writer, which is what lets it
remove the temporary leftovers of runs that died mid-save. A process that already holds a
directory's lock claims it again without waiting (a PolicyTrainer saving inside a one-process
`longmoe train`): a flock belongs to an open file, so a second open by the same process would
otherwise be refused by its own lock.

DIR/latest names the newest published step directory; names of the form `*.tmp-*` are never
published (a save in progress, or one that died). One exception: while a save replaces a step
directory of the same step, the old copy waits under step-N.tmp-old-<nonce> and `latest` names
it, so a kill between the two renames leaves `latest` on a complete copy.

Removing a published step directory (--overwrite's first save, retention) renames it to
step-N.tmp-removed-<nonce> before deleting anything in it: a kill leaves that debris, which the
next lock holder removes, and never a published directory with files missing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

from longmoe.errors import UserError

LOCK = ".lock"
POINTER = "latest"
_STEP = re.compile(r"step-(\d{8})")
_ASIDE = re.compile(r"step-\d{8}\.tmp-old-[0-9a-f]{8}")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# This process's locks: (pid, resolved DIR) -> [descriptor, claims]. The pid keeps a forked
# child from taking its parent's entry for its own.
_HELD: dict[tuple[int, str], list[int]] = {}


class DirLock:
    """A claim of the exclusive lock on DIR/.lock, given up by release() or when the process
    ends; the lock is dropped when this process's last claim on DIR is given up. `shared`: the
    process held it already (not the directory's only writer right now: leave its files)."""

    def __init__(self, root: Path, what: str = "--checkpoint-dir"):
        self.root, self._key, self.shared = root, None, False
        key = (os.getpid(), os.path.realpath(root))
        if key in _HELD:
            _HELD[key][1] += 1
            self._key, self.shared = key, True
            return
        path = root / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"{what}: {root} is not writable ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise UserError(f"{what}: {root} is in use by another run ({holder}); "
                            f"a checkpoint directory belongs to one run at a time") from None
        _HELD[key] = [fd, 1]
        self._key = key
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())

    def release(self):
        key, self._key = self._key, None
        if key is None or key not in _HELD:
            return
        held = _HELD[key]
        held[1] -= 1
        if held[1] == 0:
            del _HELD[key]
            os.close(held[0])  # closing the last descriptor drops the flock

    def __del__(self):
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {info['pid']} on {info['host']}, since {info['started']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "holder not recorded yet"


def claim(ckpt_dir: str | Path, what: str = "--checkpoint-dir") -> DirLock:
    """The directory exists (created if need be), is a writable directory, and is ours. `what`
    names the setting or call in errors."""
    root = Path(ckpt_dir)
    if root.exists() and not root.is_dir():
        raise UserError(f"{what}: {root} exists and is not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{what}: cannot create {root} ({e.strerror})") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {root} is not writable")
    return DirLock(root, what)


def is_step_dir_name(name: str) -> bool:
    return bool(_STEP.fullmatch(name) or _ASIDE.fullmatch(name))


def published_steps(root: Path) -> list[int]:
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if p.is_dir() and (m := _STEP.fullmatch(p.name)))


def pointer(root: Path) -> Path | None:
    """The step directory `latest` names (None without a pointer); UserError if it names none."""
    path = root / POINTER
    if not path.is_file():
        return None
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"checkpoint {path}: unreadable ({e})") from None
    if not is_step_dir_name(name):
        raise UserError(f"checkpoint {path}: names {name[:40]!r}, not a step directory")
    if not (root / name).is_dir():
        raise UserError(f"checkpoint {path}: names {name}, which does not exist")
    return root / name


def named_step(ckpt_dir: str | Path) -> Path | None:
    """The step directory `latest` names (None in a directory without checkpoints). Step
    directories without a pointer are an error: resuming would start over beside them."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    path = pointer(root)
    if path is None:
        steps = published_steps(root)
        if steps:
            raise UserError(f"checkpoint {root / POINTER}: missing, but {root} holds "
                            f"{step_name(steps[-1])}; write its name into {POINTER} to resume "
                            f"from it, or pass --overwrite")
        return None
    return path


def write_pointer(root: Path, name: str):
    tmp = root / f"{POINTER}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(name)
    os.replace(tmp, root / POINTER)


def holds_checkpoints(root: Path) -> str | None:
    """What a fresh run would replace: `latest`'s target or the newest step, else None."""
    if not root.is_dir():
        return None
    if (root / POINTER).exists():
        try:
            return (root / POINTER).read_text().strip()[:40] or POINTER
        except (OSError, UnicodeDecodeError):
            return POINTER
    steps = published_steps(root)
    return step_name(steps[-1]) if steps else None


def remove_stale_tmp(root: Path) -> list[str]:
    """Leftovers of saves that died (`*.tmp-*`). Only for the lock holder: nobody else writes."""
    removed = []
    named = pointer_name(root)
    for stale in sorted(root.glob("*.tmp-*")):
        if stale.name == named:  # a step's old copy that a killed re-save left named
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        removed.append(stale.name)
    return removed


def pointer_name(root: Path) -> str | None:
    """What `latest` holds, unchecked (None when it cannot be read)."""
    try:
        return (root / POINTER).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def remove_step_dir(root: Path, name: str):
    """root/name (a step directory, or a whole checkpoint directory) renamed to a tmp name first
    (made durable before anything inside goes), so a kill mid-removal leaves debris, never a
    published directory with files missing."""
    doomed = root / f"{name}.tmp-removed-{uuid.uuid4().hex[:8]}"
    os.replace(root / name, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_except(root: Path, keep: Path) -> list[str]:
    """Every published step directory but `keep` (an --overwrite run's first checkpoint), each
    by remove_step_dir."""
    removed = []
    for step in published_steps(root):
        path = root / step_name(step)
        if path.name == keep.name:
            continue
        remove_step_dir(root, path.name)
        removed.append(path.name)
    return removed


def remove_oldest(root: Path, keep: int, written: Path) -> list[str]:
    """Retention, by the lock holder right after `written` was published: the published step
    directories beyond the newest `keep` by step number go (oldest first, each by
    remove_step_dir), except `written`, the one `latest` names, and any newer than `written`:
    a run's own saves only go forward, so a newer one was left by another run (a resume reports
    it), and is not this run's to drop. Returns the names removed."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    m = _STEP.fullmatch(written.name)
    if m is None:
        raise ValueError(f"{written} is not a published step directory")
    spared, newest = {written.name, pointer_name(root)}, int(m.group(1))
    removed = []
    for step in published_steps(root)[:-keep]:
        name = step_name(step)
        if step >= newest or name in spared:
            continue
        remove_step_dir(root, name)
        removed.append(name)
    return removed


def fsync_dir(path: Path):
    """Make renames inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
