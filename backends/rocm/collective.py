"""RCCL settings for AMD GPUs. torch's "nccl" backend is RCCL on a ROCm build and reads the same
TORCH_NCCL_* variables."""

from __future__ import annotations

import torch

from longmoe.backends.collective import CollectiveAdapter


class RcclCollective(CollectiveAdapter):
    dist_backend = "nccl"
    env_defaults = {
        # 1 = tear down: a failed or timed-out collective aborts the communicator and the
        # process exits, so the launcher sees a failure instead of ranks hanging forever.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # RCCL channel counts (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS) are left unset on
        # purpose: RCCL sizes them from the XGMI topology it detects, and a fixed override only
        # belongs here once a measurement on that topology shows it helps.
    }
    # -1 is the highest priority torch offers: communication kernels get scheduled ahead of the
    # expert GEMMs they are meant to overlap with.
    comm_stream_priority = -1
    # RCCL only: torch's symmetric memory on ROCm has never run on an AMD GPU here, so asking
    # for it fails with that reason and "auto" uses RCCL.
    a2a_transports = ("process_group",)
    a2a_missing = {"symmetric_memory": "symmetric_memory is not validated on ROCm yet (it has "
                                       "never run on an AMD GPU); use process_group (RCCL)"}
    reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64}
    )
