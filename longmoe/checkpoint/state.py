"""The state dict a checkpoint holds: what DCP saves and loads, as views of the model's and the
optimizer's own state.

Dense parameters are FSDP2 DTensors, which DCP reshards to any world size by itself. Expert stacks
are EP-local (rank r holds experts [r*L, (r+1)*L), further sharded by FSDP), so the state dict
stores them one expert per key (`...experts.w_in/expert00042`, the same for their AdamW moments) as
views into the local shard: each expert is written once, wherever it lives, and a run with another
EP size or world size loads exactly the experts it owns. Together with data keyed by global
sequence index, a checkpoint saved on 4 ranks (EP2 x FSDP2) resumes on 2 ranks.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

EXPERT = "/expert"


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
            key = f"{_canonical(k)}{EXPERT}{e:05d}"
            if isinstance(v, dict):  # AdamW state: moments per row, the shared step as is
                out[key] = {sk: (_local(sv)[i] if torch.is_tensor(sv) and sv.dim() > 0 else sv)
                            for sk, sv in v.items()}
            else:
                out[key] = _local(v)[i]
    return out


def checkpoint_state(model, optim):
    """(what DCP saves/loads, the torch state dicts it is a view of)."""
    rows = _expert_rows(model)
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optim)
    groups = [{**g, "params": [_canonical(n) for n in g["params"]]} for g in osd["param_groups"]]
    flat = {"model": _per_expert(msd, rows),
            "optim": {**osd, "state": _per_expert(osd["state"], rows), "param_groups": groups}}
    return flat, msd, osd
