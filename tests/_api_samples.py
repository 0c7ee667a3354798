"""Run configs and RL samples shared by the PolicyTrainer tests."""

from __future__ import annotations

import math

import torch


def run_dict(seed, ep=1, fsdp=False, budget=32, preset="tiny", loss=None, cp=1):
    return {"model": {"preset": preset, "num_layers": 2 if preset == "tiny" else 4,
                      "router_aux_loss_coef": 0.0, "init_std": 0.1},
            "parallel": {"ep": ep, "cp": cp, "fsdp": fsdp, "chunks": 1},
            "impl": {"linear_ce": "chunked", "ce_chunk_tokens": 40, "gated_delta": "chunked"},
            "data": {"max_tokens_per_micro_batch": budget},
            "loss": loss if loss is not None else {"kl_coef": 0.1, "tis_cap": 1.5,
                                                   "dual_clip_c": 3.0, "entropy_coef": 0.01},
            "optim": {"lr": 0.05, "eps": 1.0, "grad_clip": 0.0},
            "train": {"seed": seed, "device": "cpu"}}


def make_samples(seed, n, vocab=512, first=0):
    """Samples of varied lengths (an empty prompt, a loss mask, per-token advantages) with
    log-probs near those of the tiny models' near-uniform start (-log V)."""
    from longmoe.data.sample import Sample
    g = torch.Generator().manual_seed(seed)
    base = -math.log(vocab)
    out = []
    for i in range(n):
        P = 0 if i == 1 else int(torch.randint(1, 8, (1,), generator=g))
        R = int(torch.randint(1, 24, (1,), generator=g))
        near = lambda s: (base + s * torch.randn(R, generator=g)).clamp(max=0.0)  # noqa: E731
        adv = (torch.randn(R, generator=g) if i % 3 == 2
               else float(torch.randn(1, generator=g)))
        mask = (torch.rand(R, generator=g) > 0.3) if i == 3 else None
        old = near(0.2)
        out.append(Sample(torch.randint(0, vocab, (P,), generator=g),
                          torch.randint(0, vocab, (R,), generator=g), adv,
                          old_logprobs=old, ref_logprobs=near(0.3),
                          rollout_logprobs=(old + 0.1 * torch.randn(R, generator=g)).clamp(max=0),
                          loss_mask=mask, index=first + i, where=f"draw {first + i}"))
    return out
