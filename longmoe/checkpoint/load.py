"""Reading a checkpoint back: which step directory `latest` names, whether it fits the run
(ResumePoint: same model, same global batch, what else differs), and loading it in place.

Everything read is checked against the step's manifest first (manifest.py), and nothing in it is
unpickled by anything that can run code (safe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from longmoe.checkpoint.directory import named_step, published_steps, step_name
from longmoe.checkpoint.manifest import config_view, read_meta, verify_step
from longmoe.checkpoint.safe import (VerifiedReader, WeightsOnlyPlanner, check_contents, load_rng,
                                     read_dcp_metadata)
from longmoe.checkpoint.state import checkpoint_state
from longmoe.errors import UserError

__all__ = ["latest", "resume_point", "load", "ResumePoint"]


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
    flat, msd, osd = checkpoint_state(model, optim)
    # in place: the per-expert views write into msd/osd
    dcp.load(flat, storage_reader=VerifiedReader(point.path, md),
             planner=WeightsOnlyPlanner(point.path))
    # Param groups were loaded into copies named canonically (see state.py): hyperparameters back.
    for group, loaded in zip(osd["param_groups"], flat["optim"]["param_groups"]):
        group.update({k: v for k, v in loaded.items() if k != "params"})
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optim, osd)
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = load_rng(point.path, rank, point.manifest)
    if rng is not None:  # a rank the saving run did not have starts from its seed
        torch.set_rng_state(rng["cpu"])
        backend.set_rng_state(rng.get("device"))
