"""verl's max_ckpt_to_keep for the longmoe engine's save_checkpoint.

verl's trainer saves each global step into a directory of its own (DIR/global_step_N/actor) and
asks the engine to keep the newest max_ckpt_to_keep of them, so retention here counts the
directories this engine saved into in this process, in save order (longmoe.checkpoint.save.
keep_newest counts the step-N directories inside one). An old one goes whole, as verl's own
FSDP checkpoint manager removes it, only if it did not exist before this engine's first save
into it; otherwise only what the engine wrote there goes: its step directories, the files it
writes beside them, and `latest` when it names one of those (it would name nothing).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from longmoe.checkpoint.directory import POINTER, pointer_name, remove_step_dir
from longmoe.errors import UserError


def keep_count(max_ckpt_to_keep) -> int:
    """0 for None or 0 (keep all), else the positive int; anything else is a UserError."""
    k = max_ckpt_to_keep
    if k is None:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise UserError(f"longmoe engine: save_checkpoint: max_ckpt_to_keep must be an int >= 0 "
                        f"or None (0 and None keep all), got {k!r}")
    return k


class SavedPaths:
    """The directories saved into, oldest first: path -> (created by this engine, the step
    directories it wrote there)."""

    def __init__(self):
        self._paths: dict[str, tuple[bool, set[str]]] = {}

    def key(self, local_path) -> str:
        return os.path.realpath(local_path)

    def new(self, local_path) -> bool:
        """Call before a save: whether the engine's first save into local_path creates it."""
        key = self.key(local_path)
        return self._paths[key][0] if key in self._paths else not os.path.exists(key)

    def saved(self, local_path, created: bool, step_dir) -> None:
        key = self.key(local_path)
        steps = self._paths.pop(key, (created, set()))[1]   # a save again: now the newest
        self._paths[key] = (created, steps | {Path(step_dir).name})

    def beyond(self, keep: int) -> list[tuple[str, bool, set[str]]]:
        """The entries older than the newest `keep`, forgotten here; the caller removes them."""
        old = list(self._paths)[:-keep] if keep else []
        return [(key, *self._paths.pop(key)) for key in old]


def remove_written(path: Path, steps: set[str], files: tuple[str, ...]) -> None:
    """In a directory that existed before: `latest` first when it names one of ours (a kill then
    leaves step directories without a pointer, which a load names, never a pointer to a
    half-removed one), then each step directory (renamed first), then `files`."""
    if pointer_name(path) in steps:
        (path / POINTER).unlink(missing_ok=True)
    for name in sorted(steps):
        if (path / name).is_dir():
            remove_step_dir(path, name)
    for name in files:
        (path / name).unlink(missing_ok=True)


def remove_old(entries, release, files: tuple[str, ...], rank0: bool) -> None:
    """Each of SavedPaths.beyond's entries, removed by rank 0; `release(path)` gives up the
    trainer's lock on it (every rank calls it): before a whole directory goes (its lock file
    goes with it, and NFS keeps a file that is still open as a `.nfs*` file, which would stop
    the directory's removal), after the removal otherwise (until then the engine is the
    directory's only writer). A failure is a warning, as verl's own removal ignores errors:
    the other ranks are already past this call."""
    for key, created, steps in entries:
        path = Path(key)
        if created:
            release(path)
        if rank0:
            try:
                if created:  # renamed aside first: a kill leaves NAME.tmp-removed-* beside it
                    remove_step_dir(path.parent, path.name)
                else:
                    remove_written(path, steps, files)
            except OSError as e:
                warnings.warn(f"longmoe engine: max_ckpt_to_keep: could not remove {path} ({e})")
        if not created:
            release(path)
