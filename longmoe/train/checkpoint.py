"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically.

Layout: DIR/step-00000012/ holds the DCP shards, meta.json (step, config) and rng-rank{r}.pt.
Each save goes to DIR/step-N.tmp-<nonce>/ and becomes visible only through os.replace after every
rank finished; DIR/latest (also replaced atomically) names the newest complete step. A crash
mid-save leaves a .tmp directory that is never loaded and is cleaned by the next save.

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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from torch.distributed.tensor import DTensor

from longmoe.errors import UserError

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


def _per_expert(sd: dict, rows: dict[str, list[int]]) -> dict:
    """Replace each expert stack (or its optimizer-state dict) by per-expert views."""
    out = {}
    for k, v in sd.items():
        if k not in rows:
            out[k] = v
            continue
        for i, e in enumerate(rows[k]):
            key = f"{k}{_EXPERT}{e:05d}"
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
    flat = {"model": _per_expert(msd, rows),
            "optim": {**osd, "state": _per_expert(osd["state"], rows)}}
    return flat, msd, osd


def save(ckpt_dir: str | Path, step: int, model, optim, meta: dict, backend):
    root = Path(ckpt_dir)
    final = root / f"step-{step:08d}"
    nonce = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(nonce, src=0)
    tmp = root / f"step-{step:08d}.tmp-{nonce[0]}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp-*"):  # step dirs, and latest.tmp-* files
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        tmp.mkdir()
    _barrier()
    dcp.save(_state(model, optim)[0], checkpoint_id=str(tmp))
    torch.save({"cpu": torch.get_rng_state(), "device": backend.get_rng_state()},
               tmp / f"rng-rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
        # Re-saving a step: move the old copy aside first, so some complete copy is always named
        # by `latest` (the old one until the rename, the new one after).
        old = root / f"step-{step:08d}.tmp-old-{nonce[0]}"
        if final.exists():
            os.replace(final, old)
            latest_tmp = root / f"latest.tmp-{nonce[0]}"
            latest_tmp.write_text(old.name)
            os.replace(latest_tmp, root / "latest")
        os.replace(tmp, final)
        latest_tmp = root / f"latest.tmp-{nonce[0]}"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest(ckpt_dir: str | Path) -> Path | None:
    root = Path(ckpt_dir)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "meta.json").is_file():
        raise UserError(f"checkpoint: {path} is incomplete (no meta.json)")
    return path


def check_compatible(path: Path, model_cfg: dict):
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("model") != model_cfg:
        saved = meta.get("model") or {}
        diff = sorted(k for k in set(model_cfg) | set(saved) if saved.get(k) != model_cfg.get(k))
        raise UserError(f"checkpoint {path}: model differs from the config in {', '.join(diff)}")
    return meta


def load(path: Path, model, optim, backend) -> dict:
    flat, msd, osd = _state(model, optim)
    dcp.load(flat, checkpoint_id=str(path))  # in place: the per-expert views write into msd/osd
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optim, osd)
    rng_file = path / f"rng-rank{_rank()}.pt"
    if rng_file.exists():  # a rank the saving run did not have starts from its seed
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        backend.set_rng_state(rng["device"])
    return json.loads((path / "meta.json").read_text())
