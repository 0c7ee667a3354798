"""MoE router replay through verl's worker (router_replay.mode on the longmoe actor): R3 replays
the rollout engine's routed_experts (verl's padded [bsz, seq, layers, top_k], made jagged by
its padding helper) in compute_log_prob and the update; R2 records the actor's own routing in
compute_log_prob (returned in verl's order, as verl's trainer hands it to the update) and
replays it in the update. Against PolicyTrainer called directly on samples with the same
routes; the reference policy routes by itself."""

import dataclasses

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

from _verl import (_train_inputs, ppo_config, ragged, reference,  # noqa: E402,F401
                   train_mini_batch, verl_env, verl_logprobs, worker)
from test_router_replay import foreign_routes, own_routes  # noqa: E402

# The update comparisons need the balance loss off (tests/_verl.py, MODELS): it is a statistic
# of each micro-batch, and verl's micro-batches are not the direct call's.
PRESET = "qwen3-moe"


def _padded_routes(td, samples):
    """Each sample's [len, layers, top_k] routes placed where verl's padded batch holds its
    tokens (prompt right-aligned before the response, responses left-aligned), zeros
    elsewhere."""
    P = td["prompts"].shape[1]
    L, K = samples[0].routed_experts.shape[1:]
    out = torch.zeros(len(samples), td["input_ids"].shape[1], L, K, dtype=torch.int16)
    for i, s in enumerate(samples):
        p, r = s.prompt_len, s.response.numel()
        out[i, P - p:P + r] = s.routed_experts.to(torch.int16)
    return out


def _with_routes(pt, samples, seed):
    return [dataclasses.replace(s, routed_experts=foreign_routes(pt, s, seed + i))
            for i, s in enumerate(samples)]


def test_r3_infer_replays_the_rollout_routes(verl_env):
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=5, seed=3)
    routed = _with_routes(pt, samples, 10)
    want = pt.compute_logprobs(routed)
    plain = pt.compute_logprobs(samples)
    td["routed_experts"] = _padded_routes(td, routed)
    w = worker(path, PRESET, replay="R3")
    for budget in (16, 200):
        lp, _, out = verl_logprobs(w, td, budget, entropy=False)
        for i, s in enumerate(samples):
            R = s.response.numel()
            assert torch.allclose(lp[i, :R], want[i], atol=1e-5, rtol=0), (budget, i)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(want, plain))
    # without replay the engine ignores the field: the router decides
    lp, _, _ = verl_logprobs(worker(path, PRESET), td, 200, entropy=False)
    for i, s in enumerate(samples):
        assert torch.allclose(lp[i, :s.response.numel()], plain[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_update_replays_the_batchs_routes(verl_env, fused, mode):
    """R3: the rollout's routes; R2: those compute_log_prob recorded (here another router's, so
    that replaying them changes the step)."""
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=1)
    routed = _with_routes(pt, samples, 20)
    td, with_old = _train_inputs(pt, td, routed)
    with_old = [dataclasses.replace(s, routed_experts=r.routed_experts)
                for s, r in zip(with_old, routed)]
    td["routed_experts"] = _padded_routes(td, routed)
    # old log-probs under the replayed routes: the first step is on-policy
    old = pt.compute_logprobs(with_old)
    td["old_log_probs"] = torch.stack([torch.nn.functional.pad(o, (0, td["responses"].shape[1]
                                                                   - o.numel())) for o in old])
    with_old = [dataclasses.replace(s, old_logprobs=o) for s, o in zip(with_old, old)]
    want = pt.forward_backward(with_old)
    want_step = pt.optim_step()
    w = worker(path, PRESET, max_tokens=24, mini_batch=4, fused=fused, replay=mode)
    out = train_mini_batch(w, td, 4)
    assert w.engine.fused_last is fused
    assert out["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)] * len(out["actor/ppo_kl"])
    assert out["loss"][0] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert out["grad_norm"][0] == pytest.approx(want_step["grad_norm"], rel=1e-5)


def test_r2_records_in_compute_log_prob_and_replays_in_the_update(verl_env):
    """The recorded routes are each token's own (in verl's order across reordered
    micro-batches); replayed in the update they give the plain step, as the routing they
    record is the one the update would make before any optimizer step."""
    from verl.workers.utils.padding import no_padding_2_padding  # noqa: F401
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=5, seed=2)
    w = worker(path, PRESET, max_tokens=24, mini_batch=5, replay="R2")
    _, _, out = verl_logprobs(w, td, 24, entropy=False)
    got = out["routed_experts"]
    assert got.is_nested and got.dtype == torch.int16
    for i, s in enumerate(samples):
        torch.testing.assert_close(got[i].long(), own_routes(pt, s), rtol=0, atol=0)
    # verl's trainer unions the output into the batch; its padding helper makes it jagged again
    td2, with_old = _train_inputs(pt, td, samples)
    td2["routed_experts"] = _padded_routes(td2, [dataclasses.replace(s, routed_experts=got[i])
                                                 for i, s in enumerate(samples)])
    want = pt.forward_backward(with_old)
    want_step = pt.optim_step()
    metrics = train_mini_batch(w, td2, 5)
    assert metrics["loss"][0] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"][0] == pytest.approx(want_step["grad_norm"], rel=1e-5)


def test_replay_without_routes_or_with_bad_ones_is_refused(verl_env):
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=2)
    w = worker(path, PRESET, replay="R3")
    with pytest.raises(ValueError, match="router_replay needs routed_experts"):
        verl_logprobs(w, td, 64, entropy=False)
    routed = _with_routes(pt, samples, 0)
    td["routed_experts"] = _padded_routes(td, routed)
    P = td["prompts"].shape[1]   # the last prompt column holds a token of every sequence
    td["routed_experts"][0, P - 1, 0, 0] = pt.run.model.num_experts
    with pytest.raises(ValueError, match=r"routed_experts\[\d+, 0, 0\] = \d+ is not an expert"):
        verl_logprobs(w, td, 64, entropy=False)


def test_rows_verl_fills_with_zeros_route_by_the_router(verl_env):
    """verl's agent loop zero-fills the rows the rollout recorded none for (the final generated
    token; a trajectory's trailing tool tokens): those rows repeat expert 0 and route as the
    router decides, exactly as -1 rows through the API; a mixed row is refused by name."""
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=5)
    routed = _with_routes(pt, samples, 30)
    native = []
    for i, s in enumerate(routed):
        r = s.routed_experts.clone()
        r[-1 if i % 2 else -4:] = 0          # one final row; or four trailing rows
        routed[i] = dataclasses.replace(s, routed_experts=r)
        native.append(dataclasses.replace(s, routed_experts=_zero_rows_off(r)))
    want = pt.compute_logprobs(native)
    td["routed_experts"] = _padded_routes(td, routed)
    lp, _, _ = verl_logprobs(worker(path, PRESET, replay="R3"), td, 200, entropy=False)
    for i, s in enumerate(samples):
        R = s.response.numel()
        assert torch.allclose(lp[i, :R], want[i], atol=1e-5, rtol=0), i
    # the zero rows do reach the router: replaying expert 0 there would change the log-probs
    # of the response tokens that follow the four zero-filled rows
    forced = pt.compute_logprobs([dataclasses.replace(s, routed_experts=_dupes_to_distinct(
        s.routed_experts)) for s in routed])
    assert not torch.allclose(forced[0], want[0], atol=1e-4)
    P = td["prompts"].shape[1]
    td["routed_experts"][0, P - 1, 0] = torch.tensor([-1] + [3] * (routed[0].routed_experts
                                                              .shape[-1] - 1))
    with pytest.raises(ValueError, match=r"routed_experts\[\d+, 0\] = \[-1, 3.*mixes"):
        verl_logprobs(worker(path, PRESET, replay="R3"), td, 200, entropy=False)


def _zero_rows_off(r):
    """A row of zeros (verl's mark of no route) as longmoe's -1 row."""
    return torch.where((r == 0).all(-1, keepdim=True), torch.full_like(r, -1), r)


def _dupes_to_distinct(r):
    """Zero rows as the distinct experts 0..top_k-1: a real route, unlike verl's mark."""
    K = r.shape[-1]
    return torch.where((r == 0).all(-1, keepdim=True), torch.arange(K).expand_as(r), r)


def test_replay_needs_top_k_of_two(verl_env):
    pt, path = reference(PRESET, verl_env)
    with pytest.raises(ValueError, match=r"router_replay.mode.*top_k >= 2"):
        worker(path, PRESET, replay="R3", extra=["model.top_k=1"])


def test_hydra_router_replay_mode_reaches_the_engine_config(verl_env):
    from verl.utils.config import omega_conf_to_dataclass
    cfg = ppo_config("actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.longmoe.router_replay.mode=R3")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.engine.router_replay.mode == "R3"


def _cp_record(rank, world, backend, path, data):
    import os

    from tensordict import TensorDict
    from verl.plugin.platform import platform_manager

    from _verl import HostPlatform
    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"})
    platform_manager.set_platform(HostPlatform())
    w = worker(path, PRESET, max_tokens=24, extra=["parallel.cp=2"], replay="R2")
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    td = left_right_2_no_padding(TensorDict(data, batch_size=[data["prompts"].shape[0]]))
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False,
                         max_token_len_per_gpu=24)
    out = w.infer_batch(td)
    return None if out is None else [t.clone() for t in tu.get(out, "routed_experts").unbind()]


@pytest.mark.slow
def test_r2_records_whole_rows_under_context_parallelism(verl_env):
    """CP 2: each rank routes a zigzag half of every row; the recorded routes come back whole,
    in the row's order, on the rank that hands outputs to verl."""
    from longmoe.api import run_local
    pt, path = reference(PRESET, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "right", n=4, seed=8)
    got = run_local(_cp_record, 2, str(path), {k: td[k] for k in td.keys()})
    assert got[1] is None
    for s, r in zip(samples, got[0]):
        torch.testing.assert_close(r.long(), own_routes(pt, s), rtol=0, atol=0)
