"""One training step on 2 gloo ranks with EP=2, FSDP2, full recompute, linear CE and 2 chunks
gives the loss and every gradient of world size 1 with every primitive off (fp32)."""

import random

import pytest

from longmoe.paired.dist_cases import step_case


@pytest.mark.parametrize("kw", [
    dict(ep=2, chunks=2, recompute="full", fsdp=True, linear_ce="chunked"),   # everything on
    dict(ep=1, chunks=1, recompute="none", fsdp=True, linear_ce="reference"),     # FSDP2 alone
    dict(ep=2, chunks=3, recompute="none", fsdp=False, linear_ce="chunked"),  # EP without FSDP
    dict(ep=2, chunks=2, recompute="full", fsdp=True, linear_ce="chunked", cpu_offload=True),
    # the Qwen3.5 hybrid layout: 3 Gated DeltaNet layers (chunked core) + 1 full attention
    dict(ep=2, chunks=2, recompute="full", fsdp=True, linear_ce="chunked", preset="tiny-hybrid",
         num_layers=4),
], ids=["all-primitives", "fsdp-only", "ep-no-fsdp", "fsdp-cpu-offload", "hybrid-gated-deltanet"])
def test_world2_step_matches_world1(kw):
    seed = random.randrange(2**31)
    res = step_case(2, seed, **kw)
    assert res.ok, (seed, res.failures())
    assert len(res.errors) > 20  # loss, aux and every parameter's gradient were compared


@pytest.mark.slow  # over 10 s on two cores
def test_world4_ep2_fsdp2_matches_world1():
    # EP=2 x FSDP over the 2 ranks left: experts are sharded by FSDP too.
    seed = random.randrange(2**31)
    res = step_case(4, seed, ep=2, chunks=2, recompute="full", fsdp=True, linear_ce="chunked",
                    batch_size=8)
    assert res.ok, (seed, res.failures())


@pytest.mark.needs_multi_gpu
def test_world2_step_matches_world1_on_gpus():
    # The same check over NCCL/RCCL, one rank per GPU, fp32 compute.
    from longmoe.backends import active_backend
    seed = random.randrange(2**31)
    res = step_case(2, seed, device=active_backend().name, ep=2, chunks=2, recompute="full",
                    fsdp=True, linear_ce="chunked")
    assert res.ok, (seed, res.failures())


@pytest.mark.needs_multi_gpu
@pytest.mark.parametrize("gated_delta", ["auto", "chunked"])
def test_hybrid_cp2_ep2_step_matches_world1_on_gpus(gated_delta):
    # CP 2 x EP 2 on the hybrid layout over NCCL/RCCL, one rank per GPU, fp32: the zigzag split,
    # Gated DeltaNet halos and state summaries, the EP group spanning the CP ranks; "auto" is the
    # GPU core (compiled pieces, Triton state scan), "chunked" the eager one.
    from longmoe.backends import active_backend
    seed = random.randrange(2**31)
    res = step_case(2, seed, device=active_backend().name, cp=2, ep=2, chunks=2,
                    recompute="full", fsdp=True, linear_ce="chunked", preset="tiny-hybrid",
                    num_layers=4, batch_size=2, gated_delta=gated_delta)
    assert res.ok, (seed, res.failures())


@pytest.mark.parametrize("nproc,kw", [
    (2, dict(cp=2, ep=1, chunks=1, recompute="none")),              # CP2
    (2, dict(cp=2, ep=2, chunks=2, recompute="full")),              # CP2 x EP2 (EP spans CP ranks)
    (4, dict(cp=4, ep=2, chunks=2, recompute="full", batch_size=4)),  # CP4 x EP2
], ids=["cp2", "cp2-ep2-full", "cp4-ep2-full"])
def test_context_parallel_step_matches_world1(nproc, kw):
    seed = random.randrange(2**31)
    res = step_case(nproc, seed, fsdp=True, linear_ce="chunked", **kw)
    assert res.ok, (seed, res.failures())


@pytest.mark.parametrize("kw", [dict(ep=1, chunks=1, fsdp=True), dict(ep=2, chunks=2, fsdp=False),
                                dict(ep=2, chunks=2, fsdp=True),
                                dict(ep=2, chunks=2, fsdp=True, preset="tiny-hybrid", num_layers=4)],
                         ids=["fsdp", "ep-no-fsdp", "ep-fsdp", "ep-fsdp-hybrid"])
def test_selective_recompute_step_matches_world1(kw):
    seed = random.randrange(2**31)
    res = step_case(2, seed, recompute="selective", linear_ce="chunked", **kw)
    assert res.ok, (seed, res.failures())


@pytest.mark.slow  # the slow tier: compiles the core's graphs in every rank
def test_hybrid_compiled_core_under_context_parallel(monkeypatch):
    # The GPU path (compiled core pieces, conv and gated norm) with CP 2: initial states, state
    # summaries with extra value columns and conv halos all go through the traced graphs. On CPU
    # the graphs run through the partitioner inductor uses, in every spawned rank.
    monkeypatch.setenv("LONGMOE_FORCE_COMPILE", "aot_eager_decomp_partition")
    seed = random.randrange(2**31)
    res = step_case(2, seed, ep=1, chunks=1, recompute="full", fsdp=True, linear_ce="chunked",
                    preset="tiny-hybrid", num_layers=4, cp=2, batch_size=2,
                    gated_delta="chunked_compiled")
    assert res.ok, (seed, res.failures())


@pytest.mark.parametrize("nproc,cp,ep", [(2, 2, 1), (4, 4, 1), (4, 2, 2)])
def test_hybrid_context_parallel_matches_world1(nproc, cp, ep):
    # Gated DeltaNet under the zigzag split: conv halos and per-piece state summaries exchanged
    # over the CP group, composed in sequence order (CP 1 vs 2 vs 4; CP 2 x EP 2 on 4 ranks).
    seed = random.randrange(2**31)
    res = step_case(nproc, seed, ep=ep, chunks=2, recompute="full", fsdp=True,
                    linear_ce="chunked", preset="tiny-hybrid", num_layers=4, cp=cp,
                    batch_size=2 * nproc // cp)
    assert res.ok, (seed, res.failures())
