"""longmoe's MoE layer against megatron-core's MoE utilities (the seeds' baseline): routing,
permutation, combine, shared expert and balance loss, with every gradient."""

import random
import warnings

import pytest

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("T,E,k", [(53, 8, 2), (17, 8, 1), (40, 16, 4)])
def test_moe_layer_matches_megatron_utilities(T, E, k):
    from longmoe.paired.cases import megatron_moe_case
    seed = random.randrange(2**31)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that Transformer Engine/Apex are absent
        res = megatron_moe_case(seed, T=T, num_experts=E, top_k=k)
    assert res.ok, (seed, res.failures())
    assert {"y", "aux", "dX", "router.weight", "experts.w_in", "experts.w_out"} <= set(res.errors)
