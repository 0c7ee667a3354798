"""Hugging Face checkpoint cases on real process groups: load a checkpoint into an EP + FSDP2
model (each rank reading its own slices), compute logits, export it back."""

from __future__ import annotations

import torch


def _hf_rank(rank, world, backend, run_dict, ids, labels, export_dir):
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    from longmoe.train.setup import build_model
    from longmoe.model.hf import export_hf
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    model = build_model(run, layout, backend.device(rank))
    with torch.no_grad():  # through forward, so FSDP2's root hooks gather the embedding
        lp, _, _, _ = model(ids, labels)
    export_hf(model, run.model, export_dir, dtype=torch.float32)
    return {"logprobs": lp.cpu()}


def load_export_case(nproc: int, hf_dir: str, export_dir: str, ids, labels, ep: int = 2,
                     recompute: str = "full", chunks: int = 2):
    """Per-rank log-probs of `labels` after `ids` from a model loaded from `hf_dir` (every rank sees the same ids)
    and the export written to `export_dir`."""
    from longmoe.paired.spawn import run_ranks
    run = {"model": {"hf_config": f"{hf_dir}/config.json"},
           "parallel": {"ep": ep, "chunks": chunks, "recompute": recompute, "fsdp": True},
           "impl": {"gated_delta": "chunked"},
           # every rank holds the same ids: the global batch is one copy per rank
           "data": {"batch_size": ids.shape[0] * nproc, "seq_len": ids.shape[1], "prompt_len": 4,
                    "group_size": 1},
           "train": {"init_hf": hf_dir}}
    return run_ranks(_hf_rank, nproc, run, ids, labels, export_dir)
