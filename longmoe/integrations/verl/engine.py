"""LongMoEEngine: verl's training-engine interface (verl.workers.engine.base.BaseEngine) over
longmoe's PolicyTrainer, registered as backend "longmoe" for language models.

What verl calls, and what runs:
  initialize              PolicyTrainer(run config from LongMoEEngineConfig, verl's model path
                          and optimizer settings; config.run_config)
  forward_backward_batch  verl's token-budget micro-batches (prepare_micro_batches from
                          max_token_len_per_gpu, the same count on every data rank); each one
                          packed end to end into one longmoe row with exact sample boundaries
                          (batch.py), our model's per-token log-probs (and entropy) with their
                          gradients, verl's `loss_function` applied to them in verl's layout,
                          backward; outputs restored to verl's order (postprocess_batch_func)
  optimizer_step          PolicyTrainer.optim_step: clip, AdamW, longmoe's schedule; the norm
  get_per_tensor_param    PolicyTrainer.named_weights_for_rollout: HF names, full tensors
  save/load_checkpoint    PolicyTrainer.save / load (DCP, verified manifest); verl's
                          max_ckpt_to_keep over the directories it saves into (retention.py)

verl's loss is computed outside our LM head: the head returns log-probs with their gradient and
verl's loss runs on them, except for verl's own ppo_loss with settings our objective computes
alike, which runs fused into the head (fused.py). The MoE balance loss is added as
PolicyTrainer.forward_backward adds it (its mean over micro-batches). Under context parallelism
log-probs are gathered into whole rows (forward only) and training takes the fused path only.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.fsdp import FSDPModule
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

from longmoe.api import PolicyTrainer
from longmoe.api.batches import whole_rows
from longmoe.data.packing import pack_rows
from longmoe.errors import ConfigError, UserError
from longmoe.integrations.verl.batch import (check_routes, check_sequences, infer_fields,
                                             routed_values, sequences, temperatures, to_nested,
                                             to_samples)
from longmoe.integrations.verl.config import run_config
from longmoe.integrations.verl.fused import fused_micro_step, fused_run
from longmoe.integrations.verl.retention import SavedPaths, keep_count, remove_old
from longmoe.integrations.verl.schedule import RateSchedule, check_optimizer
from longmoe.train.feed import min_row, pad_multiple
from longmoe.train.kernel_manifest import ManifestRun, check_kernel_manifest
from longmoe.train.setup import loss_scale, set_cp_row_length
from longmoe.train.step import local_micro_batch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
BUCKET_BYTES = 512 << 20
SCHEDULE_FILE = "verl_lr_schedule.json"  # beside the step-N directories of a save


class _ModeCtx(BaseEngineCtx):
    """verl's offload/reload around a mode, plus the module's train/eval flag."""

    def __enter__(self):
        super().__enter__()
        self.engine.trainer.model.train(self.mode == "train")


@EngineRegistry.register(model_type="language_model", backend="longmoe", device=["cuda", "cpu"])
class LongMoEEngine(BaseEngine):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        if getattr(engine_config, "strategy", None) != "longmoe":
            raise ConfigError("engine.strategy", "the longmoe engine needs strategy=longmoe")
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode = None
        self.trainer: PolicyTrainer | None = None
        self.last_step: dict | None = None
        self.fused_last = False  # whether the last training pass ran verl's loss fused
        # Built here, host only: verl asks for the data-parallel rank before initialize.
        check_optimizer(optimizer_config)
        self.run = run_config(engine_config, model_config, optimizer_config)
        if self.run.train.kernel_manifest:
            check_kernel_manifest(self.run.train.kernel_manifest)
        self.manifest: ManifestRun | None = None
        if optimizer_config is not None and self.run.optim.warmup_steps:
            raise ConfigError("optim.warmup_steps", "under verl the rate follows actor.optim "
                                                    "(lr_warmup_steps, lr_scheduler_type), "
                                                    "counted in iterations; leave longmoe's "
                                                    "own warmup at 0")
        self.schedule: RateSchedule | None = None
        self.cp = self.run.parallel.cp
        if self.cp > 1 and not engine_config.fused_ppo_loss and not engine_config.forward_only:
            # verl's own loss reads whole rows of log-probs; under CP each rank holds a zigzag
            # slice, and gathering them would cut the gradient. The fused loss needs no gather.
            raise ConfigError("parallel.cp", "context parallelism trains through the fused "
                                             "ppo_loss only; set longmoe.fused_ppo_loss=true")
        self._dp_group = None
        self._saved = SavedPaths()  # where save_checkpoint wrote, for max_ckpt_to_keep
        # MoE router replay (verl's router_replay.mode): R2 records the experts of the actor's
        # log-prob pass and replays them in its update; R3 replays the rollout engine's in both.
        # A reference policy (forward_only) always routes by itself, as in verl.
        rr = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
        if rr not in ("disabled", "R2", "R3"):
            raise ConfigError("router_replay.mode", f"must be disabled, R2 or R3; got {rr!r}")
        self.replay_mode = "disabled" if getattr(engine_config, "forward_only", False) else rr
        if self.replay_mode != "disabled" and self.run.model.top_k < 2:
            # verl marks a token without a recorded route by an all-zero row (routed_values):
            # at top_k 1 that row reads as a route to expert 0
            raise ConfigError("router_replay.mode", f"{rr} needs model.top_k >= 2 (verl marks "
                              f"tokens without a recorded route by all-zero rows); the model "
                              f"has top_k {self.run.model.top_k}")

    # ---- setup and modes -----------------------------------------------------------------------

    def initialize(self):
        # train.kernel_manifest's pool compiles beside the model build (kernel_manifest.py);
        # each call's kernel compiles are watched from here on
        from longmoe.backends import active_backend
        self.manifest = ManifestRun(self.run.train.kernel_manifest, active_backend(),
                                    dist.get_rank() if dist.is_initialized() else 0, "call")
        # verl's reference policy (forward_only): parameters stored in the compute dtype, no
        # masters; log-probs bit for bit those of a full trainer (PolicyTrainer docs)
        self.trainer = PolicyTrainer(self.run,
                                     forward_only=bool(getattr(self.engine_config,
                                                               "forward_only", False)))
        if self.optimizer_config is not None:
            self.schedule = RateSchedule(self.optimizer_config, self.run.optim.lr)
        if self.cp > 1:  # ranks of one CP index across data ranks; every rank makes every group
            world, rank = dist.get_world_size(), dist.get_rank()
            for c in range(self.cp):
                g = dist.new_group(list(range(c, world, self.cp)))
                if rank % self.cp == c:
                    self._dp_group = g
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to("cpu", model=self.is_param_offload_enabled,
                    optimizer=self.is_optimizer_offload_enabled,
                    grad=self.is_param_offload_enabled)

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Offload to the host ("cpu") or reload to the trainer's device (verl's device name):
        PolicyTrainer.offload / reload (longmoe.api.offload). Gradients always travel with
        their parameters (torch keeps a gradient on its parameter's device), so `grad` adds
        nothing to `model`."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if self.trainer.device.type == "cpu":  # verl's host platform: already on the host
            return
        if device == "cpu":
            self.trainer.offload(params=model, optimizer=optimizer)
        else:
            self.trainer.reload(params=model, optimizer=optimizer)

    def _on_device(self):
        """Reload what is offloaded (for a save, a load or a weight hand-off, as verl's FSDP
        engine does); returns what to offload again afterwards."""
        pt = self.trainer
        back = {"params": pt.params_on_host, "optimizer": pt.optimizer_on_host}
        if any(back.values()):
            pt.reload(**back)
        return back

    def _restore(self, back):
        if any(back.values()):
            self.trainer.offload(**back)

    # ---- data-parallel queries -----------------------------------------------------------------

    # Consecutive ranks share sequences under CP (longmoe.parallel.mesh): rank // cp is the data
    # rank, and the first rank of each CP group hands its outputs back to verl.

    def get_data_parallel_rank(self):
        return (dist.get_rank() if dist.is_initialized() else 0) // self.cp

    def get_data_parallel_size(self):
        return (dist.get_world_size() if dist.is_initialized() else 1) // self.cp

    def get_data_parallel_group(self):
        if self.cp > 1:
            return self._dp_group
        return dist.group.WORLD if dist.is_initialized() else None

    def is_mp_src_rank_with_outputs(self):
        return (dist.get_rank() if dist.is_initialized() else 0) % self.cp == 0

    # ---- forward / backward --------------------------------------------------------------------

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        self.trainer.require_device("longmoe engine: forward_backward_batch")
        self.manifest.begin()
        out = self._forward_backward_batch(data, loss_function, forward_only)
        # the pool is collected after the first training call, or a call that finds it done
        lines, compiles, _ = self.manifest.end(collect=not forward_only)
        if compiles and compiles["kernel_compiles"]:
            lines.append(f"{'log-prob' if forward_only else 'training'} call "
                         f"{self.manifest.done} compiled {compiles['kernel_compiles']} "
                         f"kernel(s) in {compiles['kernel_compile_s']:.1f} s")
        if lines and (not dist.is_initialized() or dist.get_rank() == 0):
            for line in lines:
                print(f"longmoe engine: {line}", flush=True)
        return out

    def _forward_backward_batch(self, data: TensorDict, loss_function, forward_only):
        pt, layout = self.trainer, self.trainer.layout
        infer = forward_only and loss_function is None
        if infer and data["input_ids"].device.type != "cpu":
            data = data.cpu()  # verl's micro-batching reads lengths: once, on the host
        group = self.get_data_parallel_group()
        dp_size = self.get_data_parallel_size()
        mask = data["loss_mask"]
        n = (mask.values() if mask.is_nested else mask).sum()
        if dp_size > 1:  # one rank: the count is its own, with no device round trip
            n = n.to(torch.float64).to(pt.device)
            dist.all_reduce(n, group=group)
        tokens = int(n.item())
        tu.assign_non_tensor(data, batch_num_tokens=tokens, dp_size=dp_size)
        fused = (None if forward_only or not self.engine_config.fused_ppo_loss
                 else fused_run(loss_function, pt.run, data))
        self.fused_last = fused is not None
        if layout.cp > 1 and not forward_only and fused is None:
            raise UserError("longmoe engine: under parallel.cp > 1 only verl's ppo_loss with "
                            "settings the fused path takes can train (docs/integrations/verl.md)")
        temperatures(data)  # once per batch, on the host: refused before any micro-batch runs
        if fused is None:
            check_sequences(data, pt.run.model.vocab_size)
        replay, record = self._routing(data, forward_only)
        if replay:
            m = pt.run.model
            check_routes(data, m.num_layers, m.top_k, m.num_experts)
        # verl copies every field of the batch into its micro-batches; inference reads only
        # the tokens (and verl's settings), so the other fields are not copied
        split = infer_fields(data, routes=replay) if infer else data
        # verl agrees the micro-batch count across data ranks with device collectives and
        # reads them back (.item()); with one data rank there is nothing to agree
        micro, indices = prepare_micro_batches(data=split, dp_group=group if dp_size > 1 else None,
                                               same_micro_num_in_dp=True)
        keep_outputs = forward_only or tu.get_non_tensor_data(data, "return_model_output", False)
        model = pt.model
        sync = (not forward_only and isinstance(model, FSDPModule) and len(micro) > 1
                and layout.world > 1 and pt.run.parallel.grad_sync == "step")
        if infer:
            outputs = self._infer(micro, replay, record)
        else:
            outputs = self._micro_steps(micro, loss_function, forward_only, group, fused,
                                        tokens, dp_size, sync, keep_outputs, replay, record)
        if forward_only:
            for m in model.modules():  # as PolicyTrainer.compute_logprobs: see there
                if isinstance(m, FSDPModule):
                    m.reshard()
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def _routing(self, data, forward_only: bool) -> tuple[bool, bool]:
        """(replay the batch's routed_experts, record this pass's) for this call. verl marks
        the actor's calls with enable_routing_replay for the engines it knows; a False there
        (a reference pass) turns both off here too."""
        if self.replay_mode == "disabled" or not tu.get_non_tensor_data(
                data, "enable_routing_replay", True):
            return False, False
        if self.replay_mode == "R3":
            return True, False
        return not forward_only, forward_only  # R2

    def _micro_steps(self, micro, loss_function, forward_only, group, fused, tokens, dp_size,
                     sync, keep_outputs, replay=False, record=False):
        """Every micro-batch with verl's loss (or the fused one); records the pass for
        optim_step when training."""
        pt, layout, model, M = self.trainer, self.trainer.layout, self.trainer.model, len(micro)
        loads = ([] if forward_only
                 else [torch.zeros_like(m.router.last_load) for m in model.moe_layers()])
        outputs, total = [], None
        try:
            for j, mb in enumerate(micro):
                if sync:
                    model.set_requires_gradient_sync(j == M - 1)
                if fused is not None:  # verl's ppo_loss inside our LM head (fused.py)
                    loss, aux, out = fused_micro_step(pt, mb, fused, tokens, dp_size, M, replay)
                    loss = loss * dp_size  # as verl's loss below: it carries dp_size
                elif forward_only:
                    with torch.no_grad():
                        loss, aux, out = self._micro_step(mb, loss_function, True, group,
                                                          replay, record)
                else:
                    loss, aux, out = self._micro_step(mb, loss_function, False, group, replay)
                    # verl's loss carries dp_size (gradients are averaged over data ranks);
                    # longmoe's scale is the world size (averaged over every rank).
                    scale = loss_scale(layout)
                    (loss * (scale / dp_size) + aux * (scale / M)).backward()
                if not forward_only:
                    both = (loss / dp_size + aux / M).detach()
                    total = both if total is None else total + both
                    for acc, m in zip(loads, model.moe_layers()):
                        acc += m.router.last_load
                if not keep_outputs:
                    out.pop("model_output", None)
                outputs.append(out)
        finally:
            if sync:
                model.set_requires_gradient_sync(True)
        if not forward_only:
            self._note_call(total, loads, tokens)
        return outputs

    def _forward(self, mb: TensorDict, entropy: bool, replay: bool = False,
                 record: bool = False):
        """(per-token log-probs [1, row], entropies or None, aux loss, the micro-batch's
        sequence offsets, the recorded experts [1, row, layers, top_k] or None) of one
        micro-batch, packed on the host and copied to the device without blocking
        (PackedBatch.to). `replay`: the micro-batch's routed_experts; `record`: this
        forward's routing (forward only)."""
        pt = self.trainer
        values, offsets = sequences(mb)
        samples = to_samples(values, offsets, temperatures(mb),
                             routed_values(mb) if replay else None)
        pb = pack_rows([samples], pad_multiple=pad_multiple(pt.run), min_len=min_row(pt.run))
        batch, positions, packing = local_micro_batch(pb, pt.layout, pt.device)
        row = int(pb.input_ids.shape[1])
        if pt.layout.cp > 1:
            set_cp_row_length(pt.model, pt.layout, row)
        with pt.model.record_routes() if record else contextlib.nullcontext() as take:
            lp, ent, aux, _ = pt.model(batch.input_ids, batch.labels, positions,
                                       with_entropy=entropy, packing=packing,
                                       temperature_BS=batch.temperature,
                                       routes_BSLK=batch.routed_experts)
            # int32 for the gather (NCCL and gloo have no int16), int16 as verl's rollout gives
            routes = take(*batch.input_ids.shape).to(torch.int32) if record else None
        if pt.layout.cp > 1:  # forward only (see forward_backward_batch): whole rows back
            lp = whole_rows(lp, row, pt.layout)
            ent = whole_rows(ent, row, pt.layout) if entropy else None
            routes = whole_rows(routes, row, pt.layout) if record else None
        return lp, ent, aux, offsets, None if routes is None else routes.to(torch.int16)

    def _infer(self, micro, replay: bool = False, record: bool = False) -> list[dict]:
        """Inference (verl's compute_log_prob): every micro-batch's forward is queued without
        a host synchronisation between them, and the results of the whole batch come to the
        host in one copy, so verl's reordering and collection (postprocess_batch_func, the
        worker's .cpu()) handle host tensors and launch no device work of their own."""
        rows, offs, entropy = [], [], False
        with torch.no_grad():
            for mb in micro:
                entropy = bool(tu.get_non_tensor_data(mb, "calculate_entropy", False))
                lp, ent, _, offsets, routes = self._forward(mb, entropy, replay, record)
                rows.append([lp[0, :offsets[-1]]] + ([ent[0, :offsets[-1]]] if entropy else [])
                            + ([routes[0, :offsets[-1]]] if record else []))
                offs.append(offsets)
        parts = [r for rs in rows for r in rs]
        if not parts:
            return []
        if len({p.dtype for p in parts}) == 1:
            host = torch.cat(parts).cpu().split([p.numel() for p in parts])
        else:
            host = [p.cpu() for p in parts]
        outputs, k = [], 0
        for rs, offsets in zip(rows, offs):
            got = host[k:k + len(rs)]
            k += len(rs)
            model_output = {"log_probs": to_nested(got[0], offsets)}
            if entropy:
                model_output["entropy"] = to_nested(got[1], offsets)
            if record:
                model_output["routed_experts"] = to_nested(got[-1], offsets)
            outputs.append({"model_output": model_output, "loss": 0.0, "metrics": {}})
        return outputs

    def _micro_step(self, mb: TensorDict, loss_function, forward_only: bool, group,
                    replay: bool = False, record: bool = False):
        pt = self.trainer
        entropy = bool(tu.get_non_tensor_data(mb, "calculate_entropy", False))
        lp, ent, aux, offsets, routes = self._forward(mb, entropy, replay, record)
        model_output = {"log_probs": to_nested(lp[0], offsets)}
        if entropy:
            model_output["entropy"] = to_nested(ent[0], offsets)
        if record:
            model_output["routed_experts"] = to_nested(routes[0].cpu(), offsets)
        if loss_function is None:
            raise UserError("longmoe engine: a training pass needs a loss_function")
        mb_dev = mb.to(pt.device) if pt.device.type != "cpu" else mb
        loss, metrics = loss_function(model_output=model_output, data=mb_dev, dp_group=group)
        out = {"model_output": detach_tree(model_output), "loss": float(loss.detach().item()),
               "metrics": metrics}
        return loss, aux, out

    def _note_call(self, loss, loads, tokens: int) -> None:
        """What PolicyTrainer.forward_backward records for its optim_step (the pending call, its
        loss for the finite check, the routers' load, the trained tokens): this engine ran the
        micro-batches itself, with verl's loss."""
        self.trainer.record_pass(loss, loads, tokens)

    # ---- optimizer -----------------------------------------------------------------------------

    def optimizer_zero_grad(self):
        if self.trainer.pending_calls:
            self.trainer.discard_pending()

    def optimizer_step(self):
        """PolicyTrainer.optim_step at the rate of verl's schedule for this iteration (a
        non-finite step applies nothing); the gradient norm."""
        if self.schedule is not None:
            for g in self.trainer.optim.param_groups:
                g["lr"] = self.schedule.rate
        self.last_step = self.trainer.optim_step()
        if self.schedule is not None:
            self.last_step["lr"] = self.schedule.rate
        return float(self.last_step["grad_norm"])

    def lr_scheduler_step(self):
        """verl's once-an-iteration call: advance its schedule (schedule.py); the rate the next
        optimizer steps apply. Without verl's optimizer config, longmoe's own schedule (it
        advances with each optimizer step)."""
        if self.schedule is None:
            return self.trainer.lr
        return self.schedule.step()

    # ---- weights and checkpoints ---------------------------------------------------------------

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """(generator of (Hugging Face name, full tensor), None): rank 0 yields every tensor
        (longmoe.rl.weights, senders="rank0"); every rank must drain it (gathers inside)."""
        dtype = DTYPES.get(str(self.engine_config.dtype))
        if self.trainer.params_on_host:  # verl offloads again after the hand-off
            self.trainer.reload(params=True, optimizer=False)
        buckets = self.trainer.named_weights_for_rollout(BUCKET_BYTES, dtype, senders="rank0")

        def tensors():
            for bucket in buckets:
                yield from bucket
        return tensors(), None

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None,
                        **kwargs):
        """PolicyTrainer.save(local_path): local_path/step-N (N: optimizer steps taken), and the
        position of verl's schedule beside it (local_path/SCHEDULE_FILE). Then only the newest
        max_ckpt_to_keep of the directories saved into remain (None or 0: all; retention.py)."""
        if hdfs_path:
            raise UserError("longmoe engine: save_checkpoint: hdfs_path is not supported; copy "
                            "local_path yourself")
        keep, created = keep_count(max_ckpt_to_keep), self._saved.new(local_path)
        back = self._on_device()
        try:
            out = self.trainer.save(local_path)
        finally:
            self._restore(back)
        if self.schedule is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            path = Path(local_path) / SCHEDULE_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"lr_scheduler_steps": self.schedule.calls,
                                       "optimizer_steps": self.trainer.step}))
            os.replace(tmp, path)
        self._saved.saved(local_path, created, out)
        remove_old(self._saved.beyond(keep), self.trainer.close, (SCHEDULE_FILE,),
                   not dist.is_initialized() or dist.get_rank() == 0)
        return out

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False, **kwargs):
        """PolicyTrainer.load(local_path), and verl's schedule at the position saved with it (a
        checkpoint without one, from PolicyTrainer.save, starts the schedule at its first
        iteration: a warning says so)."""
        if hdfs_path:
            raise UserError("longmoe engine: load_checkpoint: hdfs_path is not supported")
        self.optimizer_zero_grad()
        back = self._on_device()
        try:
            out = self.trainer.load(local_path)
        finally:
            self._restore(back)
        if self.schedule is not None:
            path = Path(local_path) / SCHEDULE_FILE
            if path.is_file():
                calls = int(json.loads(path.read_text())["lr_scheduler_steps"])
                self.schedule = RateSchedule(self.optimizer_config, self.run.optim.lr)
                self.schedule.advance_to(calls)
            else:
                warnings.warn(f"longmoe engine: {path} is missing; verl's learning-rate "
                              f"schedule starts at its first iteration")
        return out
