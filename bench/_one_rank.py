"""Shared setup of the one-GPU MoE-layer probes in bench/ (host_overhead, pipeline_memory,
sync_cost): the Qwen3.5-35B-A3B MoE layer in bf16 on the active backend's first device, with
fp32 GEMMs at the trainer's precision, and its dispatcher per case."""

import torch


def layer(fp32_matmul: str = "high"):
    """(backend, device, config, MoE layer)."""
    torch.set_float32_matmul_precision(fp32_matmul)  # as the trainer's impl.fp32_matmul
    from longmoe.backends import active_backend
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    be = active_backend()
    dev = be.device(0)
    cfg = get_preset("qwen3.5-35b-a3b")
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    moe.to(device=dev, dtype=torch.bfloat16)
    return be, dev, cfg, moe


def dispatcher(be, dev, cfg, chunks: int, wgrad: str = "auto"):
    """chunks = 0: the unpipelined layer (what EP=1 trains with); else the chunk pipeline on one
    rank, its all-to-alls local copies."""
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    if chunks == 0:
        return ExpertDispatcher(cfg.num_experts)
    d = ExpertDispatcher(cfg.num_experts, None, chunks, transport=be.a2a("auto", dev),
                         streams=be.streams(), pipeline=True)
    d.wgrad = wgrad
    return d
