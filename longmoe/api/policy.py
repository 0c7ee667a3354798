"""PolicyTrainer: the policy-update surface an RL framework calls, SPMD (every rank builds the
same object from one run config and makes the same calls in the same order).

    pt = PolicyTrainer(run)                 # model, layout, AdamW, schedule, objective: once
    stats = pt.forward_backward(samples)    # accumulate gradients (any number of calls)
    info = pt.optim_step()                  # clip, AdamW, schedule: one optimizer step
    lp = pt.compute_logprobs(samples)       # forward only, per sample, in input order
    pt.save(d); pt.load(d); pt.export_hf(d); pt.named_weights_for_rollout(bucket_bytes)
    pt.offload(); pt.reload()               # free the device for a colocated rollout engine

Normalisation: each forward_backward call's loss is normalised by the trained tokens (and, for
the seq-mean aggregation modes, the samples) of that call's whole global list, so its gradient
is the gradient of that list's mean loss however it is split over ranks and micro-batches; k
calls before one optim_step sum k such losses (PPO's accumulation of mini-batch losses). A
caller that splits one batch over several calls passes the whole batch's counts
(`num_tokens`, `num_samples`; PolicyTrainer.counts), and then k calls equal one call of the
union. docs/api.md has the full semantics.
"""

from __future__ import annotations

import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from longmoe.api.batches import (labelled, plan_call, rank_step_data, response_offsets,
                                 sample_offsets, scatter_results, scatter_routes, whole_rows)
from longmoe.api.checks import agree, check_masks, check_samples, with_bool_mask
from longmoe.backends import active_backend, get_backend
from longmoe.checkpoint.directory import claim, remove_stale_tmp
from longmoe.checkpoint.load import load as load_checkpoint
from longmoe.checkpoint.load import resume_point
from longmoe.checkpoint.manifest import run_identity
from longmoe.checkpoint.save import keep_newest
from longmoe.checkpoint.save import save as save_checkpoint
from longmoe.errors import UserError
from longmoe.model.flops import balance_crossover
from longmoe.parallel.mesh import build_layout, validate_layout
from longmoe.rl.logprobs import compute_logprobs as forward_logprobs
from longmoe.train.config import RunConfig, load_run_config
from longmoe.train.feed import StepData, check_budget_settings, route_dims
from longmoe.train.optim import LocalShardAdamW
from longmoe.train.precision import MasterWeights, store_parameters_as
from longmoe.train.setup import (all_finite, build_model, clip_grad_norm, finish_grads,
                                 set_cp_row_length, torch_dtype)
from longmoe.train.step import accumulate, local_micro_batch, step_counts
from longmoe.train.supervise import TrainingStopped

# Objective statistics: (sum key of Objective.stats / policy_loss, name of its mean per token)
STATS = (("clip_frac", "clip_frac"), ("ratio_sum", "ratio"), ("logprob_sum", "mean_logprob"),
         ("entropy", "entropy"), ("kl_sum", "kl"), ("tis_weight_sum", "tis_weight"),
         ("tis_clip_frac", "tis_clip_frac"), ("dual_clip_frac", "dual_clip_frac"))
KERNEL = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}


def _count(name: str, v) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UserError(f"forward_backward: {name} must be a positive int or None, got {v!r}")
    return v


def _not_below(num_tokens, num_samples, tokens: int, samples: int) -> None:
    """A normaliser below the call's own count would scale its loss up (num_tokens=3 for 28
    trained tokens: 9x); the normalisers are the whole batch's counts, so at least the call's."""
    for name, v, own, what in (("num_tokens", num_tokens, tokens, "trained tokens"),
                               ("num_samples", num_samples, samples, "samples with a trained "
                                                                     "token")):
        if v is not None and v < own:
            raise UserError(f"forward_backward: {name}={v} is below this call's own {own} "
                            f"{what}: pass the whole batch's counts (PolicyTrainer.counts) or "
                            f"None")


class PolicyTrainer:
    """See the module docstring. Attributes: model, layout, run, step (optimizer steps taken,
    skipped ones included), backend, device, objective, optim, sched."""

    def __init__(self, run: RunConfig, backend=None, device: torch.device | None = None,
                 forward_only: bool = False):
        """`forward_only`: a policy that only computes log-probs (a reference policy): its
        parameters are stored in parallel.param_dtype, the values the training forward computes
        with, so its log-probs are bit for bit those of a trainer built without it, in half the
        memory of fp32 shards and with no fp32 masters; forward_backward, optim_step, save and
        load refuse."""
        if not isinstance(run, RunConfig):
            raise UserError(f"PolicyTrainer: run must be a longmoe.train.config.RunConfig, got "
                            f"{type(run).__name__}")
        self.run = run
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        validate_layout(world, run.parallel.ep, run.model.num_experts, run.parallel.cp)
        check_budget_settings(run)
        self.backend = backend or (active_backend() if run.train.device == "auto"
                                   else get_backend(run.train.device))
        if device is None:  # one device per process: its node-local rank's
            local = int(os.environ.get("LOCAL_RANK", rank))
            self.backend.set_device(local)
            device = self.backend.device(local)
        self.device = device
        torch.manual_seed(run.train.seed + rank)
        if self.backend.device_type != "cpu":
            torch.set_float32_matmul_precision(run.impl.fp32_matmul)
        self.layout = build_layout(self.backend.device_type, run.parallel.ep, run.parallel.cp)
        self.model = build_model(run, self.layout, self.device)
        o, par = run.optim, run.parallel
        self.forward_only = bool(forward_only)
        if self.forward_only:
            store_parameters_as(self.model, torch_dtype(par.param_dtype))
        self.master = None
        if (not self.forward_only and not (par.fsdp and self.layout.dp_mesh is not None)
                and par.param_dtype != "float32"):
            self.master = MasterWeights(self.model, torch_dtype(par.param_dtype))
        self.optim_impl = o.impl if o.impl != "auto" else (
            "foreach" if self.backend.device_type == "cpu" else "fused")
        params = self.master.parameters() if self.master else self.model.parameters()
        # torch's AdamW, stepped on DTensors' local shards (longmoe/train/optim.py)
        self.optim = LocalShardAdamW(params, lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay, **KERNEL[self.optim_impl])
        warm = o.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.optim, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.objective = run.loss.objective()
        self.crossover = balance_crossover(run.model)
        if self.crossover == float("inf"):
            self.crossover = 1e300  # no full attention: cost is tokens alone
        self.step = 0
        self.bad_steps = 0
        self.params_on_host = self.optimizer_on_host = False  # offload / reload
        self._dirs = {}       # checkpoint directory -> its DirLock (longmoe.checkpoint), from a save
        self._reset_pending()

    @classmethod
    def from_config(cls, path: str | None = None, overrides: list[str] | None = None,
                    **kwargs) -> "PolicyTrainer":
        return cls(load_run_config(path, list(overrides or [])), **kwargs)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step applies."""
        return self.sched.get_last_lr()[0]

    def _advance_schedule(self):
        with warnings.catch_warnings():
            # A skipped step (or a load) advances the schedule on purpose: the rate is a
            # function of the step index. torch warns when no optimizer step came first.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self.sched.step()

    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move the parameters (gradients, if any, with them) and/or AdamW's moments to
        page-locked host memory and release the device's cached blocks (longmoe.api.offload).
        Every call that computes with them refuses to run until reload."""
        from longmoe.api.offload import move
        move(self, "host", params, optimizer)

    def reload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move what offload moved back to the trainer's device; values are bit for bit those
        offloaded."""
        from longmoe.api.offload import move
        move(self, "device", params, optimizer)

    def require_trainable(self, what: str) -> None:
        if self.forward_only:
            raise UserError(f"{what}: this PolicyTrainer was built forward_only (a reference "
                            f"policy): it computes log-probs only")

    def require_device(self, what: str, optimizer: bool = False) -> None:
        if self.params_on_host or (optimizer and self.optimizer_on_host):
            part = "parameters" if self.params_on_host else "optimizer state"
            raise UserError(f"{what}: the policy's {part} are offloaded to the host; call "
                            f"reload() first")

    def _reset_pending(self):
        self._calls = 0
        self._tokens = 0
        self._loss = None     # this rank's loss + aux loss over the pending calls (finite check)
        self._load = [torch.zeros_like(m.router.last_load) for m in self.model.moe_layers()]

    # ---- samples -------------------------------------------------------------------------------

    def _plan(self, samples, what: str, signal: bool):
        """The call's plan, from the samples as trained: 0/1 masks as bool; compute_logprobs
        (not `signal`) reads no training field, the mask included."""
        check_samples(samples, what, self.run.model.vocab_size, signal=False,
                      routes=self._route_dims)
        if signal:
            check_masks(samples, what)
        fix = with_bool_mask if signal else labelled
        return plan_call(self.run, [fix(s) for s in samples], self.layout.data_world,
                         self.crossover, what)

    @property
    def _route_dims(self) -> tuple[int, int, int] | None:
        """(layers, top_k, experts): the shape a sample's routed_experts must fit."""
        return route_dims(self.run)

    def _checked(self, samples, what: str, call: str, signal: bool, extra=(), after=()):
        """Host checks and the call's plan, then the agreement collective (checks.agree): the
        same verdict on every rank before any collective of the model. `extra`: checks of the
        call's other arguments; `after`: of the arguments against the plan. Returns the plan."""
        self.require_device(what)
        if signal:  # a training call
            self.require_trainable(what)
        error = plan = None
        try:
            for check in extra:
                check()
            V, need = self.run.model.vocab_size, self.run.loss.required_logprobs()
            plan = self._plan(samples, what, signal)
            if signal:
                kept = [max(n - s.prompt_len, 0) for s, n in zip(samples, plan.plan.lengths)]
                check_samples(samples, what, V, need, signal=True, kept=kept,
                              routes=self._route_dims)
            for check in after:
                check(plan.tokens, plan.samples)
        except UserError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a peer must not wait for a rank that failed
            error = UserError(f"{what}: the samples could not be checked ({type(e).__name__}: "
                              f"{e})")
        agree(samples, what, error, call, self.layout.batch_group, self.device, signal)
        return plan

    def counts(self, samples) -> dict:
        """{"tokens", "samples"}: what forward_backward(samples) normalises by (the trained
        tokens after data.overlong, and the samples with a trained token). Host only."""
        call = self._plan(samples, "counts", True)
        return {"tokens": call.tokens, "samples": call.samples}

    def forward_backward(self, samples, num_tokens: int | None = None,
                         num_samples: int | None = None) -> dict:
        """Forward and backward of the objective over `samples` (the same global list on every
        rank; or a longmoe.train.feed.StepData: this rank's share, already planned), gradients
        added to those of earlier calls since the last optim_step. `num_tokens` /
        `num_samples`: the normalisers (default: this call's own). Returns python floats
        reduced over ranks: loss, aux_loss, tokens, samples, micro_batches, padding_share and
        the objective's per-token means (clip_frac, ratio, mean_logprob, and where the
        objective computes them entropy, kl, tis_weight, tis_clip_frac, dual_clip_frac)."""
        what = "forward_backward"
        if isinstance(samples, StepData):
            self.require_trainable(what)
            data = samples
            n_tok, n_smp = step_counts(data.trained_tokens, data.trained_samples, self.layout,
                                       self.device)
            _count("num_tokens", num_tokens), _count("num_samples", num_samples)
            _not_below(num_tokens, num_samples, n_tok, n_smp)   # the counts are global
        else:
            call = self._checked(samples, what, f"forward_backward {num_tokens} {num_samples}",
                                 True, extra=(lambda: _count("num_tokens", num_tokens),
                                              lambda: _count("num_samples", num_samples)),
                                 after=(lambda t, n: _not_below(num_tokens, num_samples, t, n),))
            data = rank_step_data(self.run, call, self.layout.data_rank)
            n_tok, n_smp = call.tokens, call.samples
        tokens = num_tokens if num_tokens is not None else n_tok
        nsamp = num_samples if num_samples is not None else n_smp
        loss, aux, stats = accumulate(self.model, data.micro, self.run, self.layout, tokens,
                                      self.device, nsamp, finish=False)
        self.record_pass((loss + aux).detach(), [m.router.last_load for m in self.model.moe_layers()],
                         n_tok)
        return self._reduce(loss, aux, stats, data, n_tok, n_smp)

    def record_pass(self, loss, loads, tokens: int) -> None:
        """Count one backward pass toward the next optim_step: its loss (for the finite check),
        each MoE layer's router load (for the expert-bias update) and its trained tokens.
        forward_backward calls this; an adapter that runs micro-batches itself with its own loss
        (longmoe.integrations.verl) calls it once per pass."""
        for acc, m, got in zip(self._load, self.model.moe_layers(), loads):
            acc += got
            if got is not m.router.last_load:
                m.router.last_load.copy_(got)
        self._loss = loss if self._loss is None else self._loss + loss
        self._calls += 1
        self._tokens += tokens

    @property
    def pending_calls(self) -> int:
        """Backward passes since the last optim_step (or discard_pending)."""
        return self._calls

    def discard_pending(self) -> None:
        """Drop the gradients and counts of the passes since the last optim_step."""
        self.optim.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._reset_pending()

    def _reduce(self, loss, aux, stats, data: StepData, n_tok: int, n_smp: int) -> dict:
        """The call's statistics summed over ranks: one all-reduce and one host read (the
        device values are stacked where they are, not read one by one)."""
        cp, dev = self.layout.cp, self.device
        f64 = lambda v: torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(())  # noqa: E731
        on_device = torch.stack([f64(loss.detach()), f64(aux.detach())]
                                + [f64(stats[k].detach() if torch.is_tensor(stats[k]) else stats[k])
                                   if k in stats else f64(0.0) for k, _ in STATS])
        host = torch.tensor([data.row_tokens / cp, sum(data.lengths) / cp]
                            + [float(k in stats) for k, _ in STATS], dtype=torch.float64,
                            device=dev)
        t = torch.cat([on_device, host])
        if self.layout.world > 1:
            dist.all_reduce(t, group=self.layout.batch_group)
        v = t.tolist()
        n = len(STATS)
        sums, (rows, useful), present = v[2:2 + n], v[2 + n:4 + n], v[4 + n:]
        g = max(n_tok, 1)
        out = {"loss": v[0], "aux_loss": v[1], "tokens": n_tok, "samples": n_smp,
               "micro_batches": len(data.micro),
               "padding_share": (rows - useful) / rows if rows else 0.0,
               "row_tokens": round(rows), "useful_tokens": round(useful)}
        for (_, name), total, have in zip(STATS, sums, present):
            if have:
                out[name] = total / g
        return out

    def optim_step(self, stop_on_bad: bool = True) -> dict:
        """Apply the gradients of the forward_backward calls since the last optim_step: clip to
        optim.grad_clip, AdamW, the schedule. A step whose loss or gradient norm is non-finite on
        any rank, or that trained no token, applies no update (skipped: "nonfinite" or
        "no_tokens"); the schedule advances anyway. train.max_bad_steps non-finite steps in a row
        raise TrainingStopped (`stop_on_bad=False`: never; watch info["bad_steps"]). Returns
        {"grad_norm", "lr" (applied), "step" (steps taken), "skipped", "bad_steps"}."""
        self.require_trainable("optim_step")
        if self._calls == 0:
            raise UserError("optim_step: no forward_backward since the last optim_step: there "
                            "is no gradient to apply")
        self.require_device("optim_step", optimizer=True)
        model, o = self.model, self.run.optim
        finish_grads(model, self.layout, self.run.parallel.fsdp)
        if self.master:
            self.master.grads_to_master()
        gnorm, finite = clip_grad_norm(model, o.grad_clip, self.layout,
                                       self.master.grad_of if self.master else None,
                                       loss=self._loss)
        skipped = "nonfinite" if not finite else "no_tokens" if self._tokens == 0 else None
        if skipped is None:
            self.optim.step()
            if self.master:
                self.master.master_to_model()
            for acc, m in zip(self._load, model.moe_layers()):
                m.router.last_load.copy_(acc)
                m.router.update_expert_bias()
        self.optim.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        lr = self.lr
        self._advance_schedule()
        self.step += 1
        self._reset_pending()
        if skipped == "nonfinite":
            self.bad_steps += 1
        elif skipped is None:
            self.bad_steps = 0
        info = {"grad_norm": gnorm, "lr": lr, "step": self.step, "skipped": skipped,
                "bad_steps": self.bad_steps}
        if stop_on_bad and self.bad_steps >= self.run.train.max_bad_steps:
            raise TrainingStopped(
                f"optim_step: {self.bad_steps} steps in a row (up to step {self.step}) had a "
                f"non-finite loss or gradient norm and applied no update "
                f"(train.max_bad_steps={self.run.train.max_bad_steps})")
        return info

    @torch.no_grad()
    def compute_logprobs(self, samples, with_entropy: bool = False, with_routes: bool = False):
        """Per sample (input order, every rank), the log-probs of its response tokens under the
        current weights: fp32 CPU tensors of the response's length, forward only through the
        LM head's linear cross-entropy. The loss mask is ignored (every response token gets
        its value); NaN where there is none: the first token of an empty prompt, tokens past
        a data.overlong truncation, all of a dropped sample. with_entropy: (log-probs,
        entropies of the full softmax). with_routes: and, last, per sample the experts each of
        its tokens was routed to, [prompt + response, layers, top_k] int16 CPU tensors (-1 past
        a truncation): the sample's routed_experts for replaying this routing in a later
        forward_backward (router replay R2)."""
        what = "compute_logprobs"
        call = self._checked(samples, what, f"compute_logprobs {bool(with_entropy)} "
                                            f"{bool(with_routes)}", False)
        samples = list(samples)
        data = rank_step_data(self.run, call, self.layout.data_rank, transform=labelled)
        offsets = response_offsets(samples)
        T, k = offsets[-1], 2 if with_entropy else 1
        # values then "has a value" per field; each token is written by one rank only (the
        # first of its CP group), so the sum is exact.
        flat = torch.zeros(2 * k * T, dtype=torch.float32, device=self.device)
        results, routes = [], []
        for mb in data.micro:
            batch, positions, packing = local_micro_batch(mb, self.layout, self.device)
            if self.layout.cp > 1:
                set_cp_row_length(self.model, self.layout, mb.row_len)
            # token ids were range-checked on the host (_checked): no device read per micro-batch
            with self.model.record_routes() if with_routes else nullcontext() as take:
                lp, ent = forward_logprobs(self.model, batch.input_ids, batch.labels, positions,
                                           packing, with_entropy, check_values=False,
                                           temperature=batch.temperature,
                                           routes=batch.routed_experts)
                if with_routes:  # int32: collectives have no int16
                    routes.append(whole_rows(take(*batch.input_ids.shape).to(torch.int32),
                                             mb.row_len, self.layout))
            got = [whole_rows(lp, mb.row_len, self.layout)]
            if with_entropy:
                got.append(whole_rows(ent, mb.row_len, self.layout))
            results.append(got)
        # A forward with no backward leaves the FSDP units that skip resharding after forward
        # (the LM head's) unsharded, their module attributes plain tensors: the next gradient
        # norm would miss their gradients and pt.model would show stale weights after a step.
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        if self.layout.cp_rank == 0:
            for f in range(k):
                scatter_results(call, [r[f] for r in results], self.layout.data_rank, offsets,
                                flat[f * T:(f + 1) * T])
                per_micro = [torch.ones_like(r[f]) for r in results]
                scatter_results(call, per_micro, self.layout.data_rank, offsets,
                                flat[(k + f) * T:(k + f + 1) * T])
        if self.layout.world > 1:
            dist.all_reduce(flat, group=self.layout.batch_group)
        flat = flat.cpu()
        outs = []
        for f in range(k):
            vals, has = flat[f * T:(f + 1) * T], flat[(k + f) * T:(k + f + 1) * T]
            vals = torch.where(has > 0, vals, float("nan"))
            outs.append([vals[offsets[i]:offsets[i + 1]].clone() for i in range(len(samples))])
        if with_routes:
            outs.append(self._gathered_routes(call, samples, routes))
        return tuple(outs) if len(outs) > 1 else outs[0]

    def _gathered_routes(self, call, samples, routes) -> list[torch.Tensor]:
        """compute_logprobs' recorded experts per sample, on every rank: each token's written
        by one rank (plus one, so 0 is "none"), summed over the batch group."""
        offs, m = sample_offsets(samples), self.run.model
        flat = torch.zeros(offs[-1], m.num_layers, m.top_k, dtype=torch.int32, device=self.device)
        if self.layout.cp_rank == 0:
            scatter_routes(call, routes, self.layout.data_rank, offs, flat)
        if self.layout.world > 1:
            dist.all_reduce(flat, group=self.layout.batch_group)
        flat = (flat.cpu() - 1).to(torch.int16)
        return [flat[offs[i]:offs[i + 1]].clone() for i in range(len(samples))]

    # ---- weights -------------------------------------------------------------------------------

    def named_weights_for_rollout(self, bucket_bytes: int, dtype: torch.dtype | None = None,
                                  senders: str = "owners"):
        """longmoe.rl.weights.named_weights_for_rollout of this trainer's model (every rank
        drains the iterator)."""
        from longmoe.rl.weights import named_weights_for_rollout
        self.require_device("named_weights_for_rollout")
        return named_weights_for_rollout(self.model, self.run, self.layout, bucket_bytes, dtype,
                                         senders)

    def _identity(self) -> dict:
        return run_identity(self.run, self.layout.world, self.layout.ep, self.layout.cp)

    def _finite_or_stop(self, what: str):
        if not all_finite(self.model.parameters(), self.layout, self.device):
            raise TrainingStopped(f"{what}: the parameters are not finite; nothing was written")

    def save(self, directory, keep: int | None = None) -> str:
        """A DCP checkpoint of weights, AdamW state and generator states at DIR/step-N (N =
        self.step), published atomically (longmoe.checkpoint.save). Gradients of pending
        forward_backward calls are not saved. From its first save into DIR on, this trainer
        holds DIR's lock (the one `longmoe train --checkpoint-dir` takes) until it is closed or
        the process ends: another run's save into DIR is refused. `keep`: after the publish,
        only the newest `keep` step directories of DIR remain (longmoe.checkpoint.save.
        keep_newest; None keeps all). Returns the step directory."""
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise UserError(f"save: keep must be an int >= 1 or None (keep all), got {keep!r}")
        self.require_trainable("save")
        self.require_device("save", optimizer=True)
        self._finite_or_stop("save")
        self._own(directory)
        path = save_checkpoint(directory, self.step, self.model, self.optim, self.backend,
                               self.run, self._identity())
        if keep is not None:
            keep_newest(directory, keep, path)
        return str(path)

    def _own(self, directory) -> None:
        """Rank 0 claims DIR's lock on the first save into it (and, as the directory's only
        writer, removes the leftovers of saves that died); every rank gets its verdict."""
        key = os.path.realpath(directory)
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = None
        if rank == 0 and key not in self._dirs:
            try:
                lock = claim(directory, "save")
                if not lock.shared:
                    remove_stale_tmp(lock.root)
                self._dirs[key] = lock
            except UserError as e:
                error = e
        if self.layout.world > 1:
            flag = torch.tensor([int(error is not None)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if bool(flag.item()) and error is None:
                error = UserError(f"save: {directory} is in use by another run (rank 0 could "
                                  f"not take its lock)")
        if error is not None:
            raise error

    def close(self, directory=None) -> None:
        """Give up the checkpoint directories' locks this trainer holds (also done when the
        process ends); `directory`: that one's alone (nothing if it holds none)."""
        keys = list(self._dirs) if directory is None else [os.path.realpath(directory)]
        for key in keys:
            lock = self._dirs.pop(key, None)
            if lock is not None:
                lock.release()

    def load(self, directory) -> str:
        """Load the checkpoint DIR/latest names, after verifying every file against its manifest
        (sizes and sha256); the model must match the run's. Returns the step directory."""
        if self._calls:
            raise UserError("load: forward_backward gradients are pending; call optim_step "
                            "before loading (loading would drop them)")
        self.require_trainable("load")
        self.require_device("load", optimizer=True)
        point = resume_point(directory, self.run, self._identity(), allow_batch_change=True,
                             full=True)
        if point is None:
            raise UserError(f"load: no checkpoint in {directory}")
        self.load_point(point)
        return str(point.path)

    def load_point(self, point) -> None:
        """Load a resolved longmoe.checkpoint.load.ResumePoint (the CLI's --resume); the
        schedule continues at its step."""
        load_checkpoint(point, self.model, self.optim, self.backend)
        self.step = point.step
        self.sched.last_epoch = point.step - 1
        self._advance_schedule()
        self.bad_steps = 0

    def export_hf(self, directory, dtype: torch.dtype | None = None) -> str:
        """A Hugging Face checkpoint directory (longmoe.model.hf.export_hf; every rank calls
        it). dtype: default bf16 on accelerators, fp32 on CPU."""
        self.require_device("export_hf")
        self._finite_or_stop("export_hf")
        from longmoe.model.hf import export_hf
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type != "cpu" else torch.float32
        return str(export_hf(self.model, self.run.model, directory, dtype=dtype))

