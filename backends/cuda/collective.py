"""NCCL settings for NVIDIA GPUs."""

from __future__ import annotations

import torch

from longmoe.backends.collective import CollectiveAdapter


class NcclCollective(CollectiveAdapter):
    dist_backend = "nccl"
    env_defaults = {
        # 1 = tear down: a failed or timed-out collective aborts the communicator and the
        # process exits, so the launcher sees a failure instead of ranks hanging forever.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # NVLink multicast stays off in NCCL, torch symmetric memory and NVSHMEM alike: on the
        # shared hosts we run on, a program that uses it can take the host's GPUs out of
        # service for a day or more. Any one of the three left on re-enables it.
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    # -1 is the highest priority torch offers: communication kernels get scheduled ahead of the
    # expert GEMMs they are meant to overlap with.
    comm_stream_priority = -1
    # Both transports run here; "auto" keeps NCCL first unless the tuning cache, written by
    # `longmoe tune chunks` on the machine, picks the other (docs/primitives/chunked_ep.md).
    a2a_transports = ("process_group", "symmetric_memory")
    reduce_dtypes = frozenset(
        {torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64}
    )
