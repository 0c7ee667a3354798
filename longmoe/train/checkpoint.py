"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically, verified on read.

Layout: DIR/step-00000012/ holds the DCP shards and their `.metadata`, rng-rank{r}.pt (each rank's
generator states as uint8 tensors), meta.json (the model and run config, for compatibility checks)
and manifest.json (size and sha256 of every other file, and the run identity: config hash, global
batch, world, EP, CP, step; ckpt_manifest.py). Each save goes to DIR/step-N.tmp-<nonce>/, gets
its manifest there, and becomes visible only through os.replace after every rank finished;
DIR/latest (also replaced atomically) names the newest published step. Nothing in a checkpoint is
unpickled by anything that can run code (ckpt_safe.py); the directory belongs to the one run that
holds DIR/.lock (ckpt_dir.py), which also removes the leftovers of saves that died.

Resharding: dense parameters are FSDP2 DTensors, which DCP reshards to any world size by itself.
Expert stacks are EP-local (rank r holds experts [r*L, (r+1)*L), further sharded by FSDP), so the
state dict stores them one expert per key (`...experts.w_in/expert00042`, the same for their AdamW
moments) as views into the local shard: each expert is written once, wherever it lives, and a run
with another EP size or world size loads exactly the experts it owns. Together with data keyed by
global sequence index, a checkpoint saved on 4 ranks (EP2 x FSDP2) resumes on 2 ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from longmoe.errors import UserError
from longmoe.train.ckpt_dir import (fsync_dir, named_step, published_steps, remove_except,
                                    step_name, write_pointer)
from longmoe.train.ckpt_manifest import (META, config_view, read_meta, run_identity,
                                         sha256_file, verify_step, write_manifest)
from longmoe.train.ckpt_safe import (VerifiedReader, WeightsOnlyPlanner, check_contents,
                                     load_rng, read_dcp_metadata, rng_name, save_rng)

__all__ = ["save", "load", "latest", "resume_point", "remove_earlier", "run_identity",
           "ResumePoint"]

_EXPERT = "/expert"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _expert_rows(model) -> dict[str, list[int]]:
    """FQN of each expert stack -> the global expert index of each of its local rows."""
    from longmoe.model.moe import GroupedExperts
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, GroupedExperts):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            rows = torch.arange(mod.num_local)
            if isinstance(p, DTensor):  # FSDP2 shards dim 0 over the expert mesh, torch.chunk-wise
                mesh = p.device_mesh
                chunks = rows.chunk(mesh.size())
                coord = mesh.get_local_rank()
                rows = chunks[coord] if coord < len(chunks) else rows[:0]
            out[f"{name}.{pname}"] = (mod.first_expert + rows).tolist()
    return out


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _canonical(fqn: str) -> str:
    """A parameter's name without the recompute wrapper's `block.` level (ops/recompute.Recompute),
    so a checkpoint saved under one recompute policy resumes under another: the saved names are
    the model's, not the wrapping's (model/hf.py drops the same level)."""
    return fqn.replace(".block.", ".")


def _per_expert(sd: dict, rows: dict[str, list[int]]) -> dict:
    """Replace each expert stack (or its optimizer-state dict) by per-expert views; keys by their
    canonical names."""
    out = {}
    for k, v in sd.items():
        if k not in rows:
            k = _canonical(k)
            out[k] = v
            continue
        for i, e in enumerate(rows[k]):
            key = f"{_canonical(k)}{_EXPERT}{e:05d}"
            if isinstance(v, dict):  # AdamW state: moments per row, the shared step as is
                out[key] = {sk: (_local(sv)[i] if torch.is_tensor(sv) and sv.dim() > 0 else sv)
                            for sk, sv in v.items()}
            else:
                out[key] = _local(v)[i]
    return out


def _state(model, optim):
    """(what DCP saves/loads, the torch state dicts it is a view of)."""
    rows = _expert_rows(model)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim)
    groups = [{**g, "params": [_canonical(n) for n in g["params"]]} for g in osd["param_groups"]]
    flat = {"model": _per_expert(msd, rows),
            "optim": {**osd, "state": _per_expert(osd["state"], rows), "param_groups": groups}}
    return flat, msd, osd


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
    """Write step `step` and publish it; every rank calls this. `identity`: run_identity()."""
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
    dcp.save(_state(model, optim)[0], checkpoint_id=str(tmp))
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
    removed = [remove_except(Path(ckpt_dir), keep) if _rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(removed, src=0)
    return removed[0]


def latest(ckpt_dir: str | Path, full: bool = False) -> Path | None:
    """The step directory `latest` names, complete by its manifest (sizes; `full`: digests)."""
    path = named_step(ckpt_dir)
    if path is not None:
        verify_step(path, full)
    return path


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    step: int
    manifest: dict
    notes: tuple[str, ...]  # what differs from the saving run and is allowed to


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def resume_point(ckpt_dir: str | Path, run, identity: dict, allow_batch_change: bool,
                 full: bool) -> ResumePoint | None:
    """The checkpoint --resume continues from, or None in a directory without any. Checks, each
    a UserError naming the file or field: complete by the manifest (`full`: every sha256, and
    every pickled piece parsed by an unpickler that cannot run code; the launcher does this
    before ranks start, ranks repeat the cheap part), same model, same global batch."""
    path = named_step(ckpt_dir)
    if path is None:
        return None
    manifest = verify_step(path, full)
    meta = read_meta(path, manifest)
    if full:
        check_contents(path, manifest, read_dcp_metadata(path, manifest))
    view = config_view(run)
    diff = _diff(meta["model"], view["model"])
    if diff:
        raise UserError(f"checkpoint {path}: model differs from the config in {', '.join(diff)}")
    saved, now = manifest["identity"], identity
    notes = []
    if saved["global_batch"] != now["global_batch"]:
        if not allow_batch_change:
            raise UserError(f"checkpoint {path}: trained {saved['global_batch']} sequences per "
                            f"step (global batch), this run would train {now['global_batch']}; "
                            f"keep the global batch (data.batch_size) or pass "
                            f"--allow-batch-change")
        notes.append(f"global batch {saved['global_batch']} -> {now['global_batch']} sequences "
                     f"per step (--allow-batch-change)")
    if any(saved[k] != now[k] for k in ("world", "ep", "cp")):
        notes.append(f"resharded: saved on {saved['world']} rank(s) with ep={saved['ep']}, "
                     f"cp={saved['cp']}; now {now['world']} with ep={now['ep']}, cp={now['cp']}")
    if saved["config_sha256"] != now["config_sha256"]:
        fields = _diff(meta.get("config") or {}, view) or ["fields meta.json does not record"]
        notes.append(f"config differs from the checkpoint's in {', '.join(fields)}; this run's "
                     f"values apply")
    newer = [s for s in published_steps(path.parent) if s > manifest["step"]]
    if newer:
        notes.append(f"{step_name(newer[-1])} is newer than {path.name}, which `latest` names; "
                     f"resuming from {path.name}")
    return ResumePoint(path, manifest["step"], manifest, tuple(notes))


def load(point: ResumePoint, model, optim, backend):
    """Load weights, AdamW state and this rank's generator states in place."""
    md = read_dcp_metadata(point.path, point.manifest)  # verified bytes, parsed without code
    flat, msd, osd = _state(model, optim)
    # in place: the per-expert views write into msd/osd
    dcp.load(flat, storage_reader=VerifiedReader(point.path, md),
             planner=WeightsOnlyPlanner(point.path))
    # Param groups were loaded into copies named canonically (see _state): hyperparameters back.
    for group, loaded in zip(osd["param_groups"], flat["optim"]["param_groups"]):
        group.update({k: v for k, v in loaded.items() if k != "params"})
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optim, osd)
    rng = load_rng(point.path, _rank(), point.manifest)
    if rng is not None:  # a rank the saving run did not have starts from its seed
        torch.set_rng_state(rng["cpu"])
        backend.set_rng_state(rng.get("device"))
