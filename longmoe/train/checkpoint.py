"""Checkpoints through torch.distributed.checkpoint (DCP), written atomically.

Layout: DIR/step-00000012/ holds the DCP shards, meta.json (step, config) and rng-rank{r}.pt.
Each save goes to DIR/step-N.tmp-<nonce>/ and becomes visible only through os.replace after every
rank finished; DIR/latest (also replaced atomically) names the newest complete step. A crash
mid-save leaves a .tmp directory that is never loaded and is cleaned by the next save.

Expert parameters are EP-local slices that share one name on every EP rank; their state-dict keys
carry the EP coordinate (`...@ep1of2`) so DCP keeps them apart. A checkpoint therefore resumes at
the same EP size; resharding to another layout comes with issue D.
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

from longmoe.errors import UserError

_EXPERT_KEYS = (".experts.w_in", ".experts.w_out")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _tag(key: str, ep_rank: int, ep: int) -> str:
    return f"{key}@ep{ep_rank}of{ep}" if key.endswith(_EXPERT_KEYS) and ep > 1 else key


def _untag(key: str) -> str:
    return key.split("@ep", 1)[0]


def _state(model, optim, ep_rank: int, ep: int) -> dict:
    msd = {_tag(k, ep_rank, ep): v for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, optim)
    osd = {**osd, "state": {_tag(k, ep_rank, ep): v for k, v in osd["state"].items()}}
    return {"model": msd, "optim": osd}


def save(ckpt_dir: str | Path, step: int, model, optim, ep_rank: int, ep: int, meta: dict,
         backend):
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
    dcp.save(_state(model, optim, ep_rank, ep), checkpoint_id=str(tmp))
    torch.save({"cpu": torch.get_rng_state(), "device": backend.get_rng_state()},
               tmp / f"rng-rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "ep": ep}, indent=1))
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


def check_compatible(path: Path, model_cfg: dict, ep: int):
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("model") != model_cfg:
        saved = meta.get("model") or {}
        diff = sorted(k for k in set(model_cfg) | set(saved) if saved.get(k) != model_cfg.get(k))
        raise UserError(f"checkpoint {path}: model differs from the config in {', '.join(diff)}")
    if meta.get("ep") != ep:
        raise UserError(f"checkpoint {path}: saved with ep={meta.get('ep')}, run has ep={ep} "
                        "(resharding experts across EP sizes is not supported yet)")
    return meta


def load(path: Path, model, optim, ep_rank: int, ep: int, backend) -> dict:
    state = _state(model, optim, ep_rank, ep)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, {_untag(k): v for k, v in state["model"].items()})
    osd = state["optim"]
    osd = {**osd, "state": {_untag(k): v for k, v in osd["state"].items()}}
    set_optimizer_state_dict(model, optim, osd)
    rng = torch.load(path / f"rng-rank{_rank()}.pt", weights_only=False)
    torch.set_rng_state(rng["cpu"])
    backend.set_rng_state(rng["device"])
    return json.loads((path / "meta.json").read_text())
