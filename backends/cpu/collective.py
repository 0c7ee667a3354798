"""gloo settings for CPU runs (tests, CI, and the reference path)."""

from __future__ import annotations

import torch

from longmoe.backends.collective import CollectiveAdapter


class GlooCollective(CollectiveAdapter):
    dist_backend = "gloo"
    # GLOO_SOCKET_IFNAME is not forced: gloo resolves the hostname itself, which is right on one
    # host, and the right interface on a cluster is a site setting the user exports.
    env_defaults = {}
    comm_stream_priority = 0  # no streams on the host
    # gloo's bf16/fp16 sum support differs across torch releases; saying False makes callers
    # reduce in fp32, which is always right and only slower on a path that is not about speed.
    reduce_dtypes = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
