"""Writing a checkpoint through torch.distributed.checkpoint (DCP), atomically.

Layout: DIR/step-00000012/ holds the DCP shards and their `.metadata`, rng-rank{r}.pt (each rank's
generator states as uint8 tensors), meta.json (the model and run config, for compatibility checks)
and manifest.json (size and sha256 of every other file, and the run identity: config hash, global
batch, world, EP, CP, step; manifest.py). Each save goes to DIR/step-N.tmp-<nonce>/, gets its
manifest there, and becomes visible only through os.replace after every rank finished; DIR/latest
(also replaced atomically) names the newest published step. The directory belongs to the one run
that holds DIR/.lock (directory.py), which also removes the leftovers of saves that died. What the
state dict holds (one key per expert, so a checkpoint reshards): state.py.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from longmoe.checkpoint.directory import (fsync_dir, remove_except, remove_oldest, step_name,
                                          write_pointer)
from longmoe.checkpoint.manifest import META, config_view, sha256_file, write_manifest
from longmoe.checkpoint.safe import rng_name, save_rng
from longmoe.checkpoint.state import checkpoint_state

__all__ = ["save", "remove_earlier", "keep_newest"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _digest_all(tmp: Path) -> dict[str, dict]:
    """sha256 of every file of the unpublished step directory, each rank a share of the files
    (the directory is on a filesystem all ranks see: rank 0 renames it)."""
    rank, world = _rank(), dist.get_world_size() if dist.is_initialized() else 1
    names = [sorted(p.name for p in tmp.iterdir()) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    mine = {n: sha256_file(tmp / n, durable=True) for n in names[0][rank::world]}
    if world == 1:
        return mine
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def save(ckpt_dir: str | Path, step: int, model, optim, backend, run, identity: dict) -> Path:
    """Write step `step` and publish it; every rank calls this. `identity`:
    manifest.run_identity()."""
    root = Path(ckpt_dir)
    final = root / step_name(step)
    nonce = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(nonce, src=0)
    tmp = root / f"{final.name}.tmp-{nonce[0]}"  # ours alone: other tmp names are left alone
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    _barrier()
    dcp.save(checkpoint_state(model, optim)[0], checkpoint_id=str(tmp))
    save_rng(tmp / rng_name(_rank()), backend.get_rng_state())
    if _rank() == 0:
        view = config_view(run)
        layout = {k: identity[k] for k in ("world", "ep", "cp")}  # informational
        (tmp / META).write_text(json.dumps({"model": view["model"], "layout": layout,
                                            "config": view, "step": step}, indent=1))
    _barrier()
    files = _digest_all(tmp)
    if _rank() == 0:
        write_manifest(tmp, step, files, identity)
        fsync_dir(tmp)
        # Re-saving a step: move the old copy aside first, so some complete copy is always named
        # by `latest` (the old one until the rename, the new one after).
        old = root / f"{final.name}.tmp-old-{nonce[0]}"
        if final.exists():
            os.replace(final, old)
            write_pointer(root, old.name)
        os.replace(tmp, final)
        write_pointer(root, final.name)
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def remove_earlier(ckpt_dir: str | Path, keep: Path) -> list[str]:
    """--overwrite, after the run's first checkpoint is published and named by `latest`: the
    step directories of earlier runs go (rank 0 removes, every rank returns the names)."""
    return _on_rank0(remove_except, Path(ckpt_dir), keep)


def keep_newest(ckpt_dir: str | Path, keep: int, written: Path) -> list[str]:
    """Retention (train.keep_checkpoints, PolicyTrainer.save(keep=)), after `written` is
    published and named by `latest`: the step directories beyond the newest `keep` go
    (directory.remove_oldest says which are spared; rank 0 removes, every rank returns the
    names)."""
    return _on_rank0(remove_oldest, Path(ckpt_dir), keep, written)


def _on_rank0(remove, *args) -> list[str]:
    """remove(*args) on rank 0, its result (or its failure: no rank waits on one that raised)
    on every rank."""
    out, error = [None], None
    if _rank() == 0:
        try:
            out = [remove(*args)]
        except Exception as e:
            error, out = e, [f"{type(e).__name__}: {e}"]
    if dist.is_initialized():
        dist.broadcast_object_list(out, src=0)
    if error is not None:
        raise error
    if isinstance(out[0], str):
        raise RuntimeError(f"removing checkpoints on rank 0 failed: {out[0]}")
    return out[0]
