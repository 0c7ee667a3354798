"""verl's learning-rate schedule on the engine's optimizer, counted in verl's units.

verl's trainer calls the engine's `lr_scheduler_step` once per iteration (after the last
mini-batch of `update_actor`), and its FSDP engine builds the schedule from `actor.optim`:
`lr_scheduler_type` constant or cosine, warmup of `lr_warmup_steps` iterations (or
`lr_warmup_steps_ratio` x `total_training_steps` when that is not positive), `min_lr_ratio`,
`num_cycles`, `zero_indexed_step`. `RateSchedule` builds the same schedule with verl's own
constructors (verl.utils.torch_functional) over a one-value holder optimizer, steps it where verl
steps it, and the engine sets its rate on every group of the trainer's AdamW before each
optimizer step. All optimizer steps of one iteration therefore share one rate, as under verl's
FSDP engine; longmoe's own schedule (optim.warmup_steps, counted in optimizer steps) is not used.

Optimizers other than torch's AdamW, and `override_optimizer_config`, are refused: the trainer's
optimizer is AdamW (longmoe.api.PolicyTrainer).
"""

from __future__ import annotations

import warnings

import torch

from longmoe.errors import ConfigError

OPTIMIZERS = {("adamw", "torch.optim")}


def check_optimizer(optim) -> None:
    """One line naming the field for verl optimizer settings the engine would not honour."""
    if optim is None:
        return
    name = str(getattr(optim, "optimizer", "AdamW"))
    impl = str(getattr(optim, "optimizer_impl", "torch.optim"))
    if (name.lower(), impl) not in OPTIMIZERS:
        raise ConfigError("actor.optim.optimizer", f"the longmoe engine trains with torch.optim "
                                                   f"AdamW; got {name!r} from {impl!r}")
    if getattr(optim, "override_optimizer_config", None):
        raise ConfigError("actor.optim.override_optimizer_config",
                          "not supported by the longmoe engine (its AdamW takes lr, betas, "
                          "weight_decay and clip_grad from actor.optim)")
    kind = getattr(optim, "lr_scheduler_type", "constant")
    if kind not in ("constant", "cosine"):
        raise ConfigError("actor.optim.lr_scheduler_type", f"constant or cosine; got {kind!r}")


def warmup_steps(optim) -> int:
    """verl's warmup length in iterations (its FSDP engine's rule)."""
    n = getattr(optim, "lr_warmup_steps", -1)
    n = -1 if n is None else int(n)
    if n <= 0:
        n = int(float(getattr(optim, "lr_warmup_steps_ratio", 0.0))
                * int(getattr(optim, "total_training_steps", -1)))
    return n


class RateSchedule:
    """The rate verl's schedule gives each iteration; `calls`: lr_scheduler_step calls so far."""

    def __init__(self, optim, lr: float):
        from verl.utils.torch_functional import (get_constant_schedule_with_warmup,
                                                 get_cosine_schedule_with_warmup)
        self._holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        warm = warmup_steps(optim)
        if getattr(optim, "lr_scheduler_type", "constant") == "cosine":
            self._sched = get_cosine_schedule_with_warmup(
                optimizer=self._holder, num_warmup_steps=warm,
                num_training_steps=int(optim.total_training_steps),
                min_lr_ratio=getattr(optim, "min_lr_ratio", None),
                num_cycles=getattr(optim, "num_cycles", 0.5),
                zero_indexed_step=getattr(optim, "zero_indexed_step", True))
        else:
            self._sched = get_constant_schedule_with_warmup(optimizer=self._holder,
                                                            num_warmup_steps=warm)
        self.calls = 0

    @property
    def rate(self) -> float:
        """The rate of the current iteration's optimizer steps."""
        return float(self._sched.get_last_lr()[0])

    def step(self) -> float:
        """verl's lr_scheduler_step: advance one iteration; the rate from here on."""
        with warnings.catch_warnings():  # the holder never steps: its rate is all that is read
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
            self._sched.step()
        self.calls += 1
        return self.rate

    def advance_to(self, calls: int) -> None:
        """Resume: the position after `calls` lr_scheduler_step calls (from 0)."""
        if calls < self.calls:
            raise ValueError(f"cannot move the schedule back from {self.calls} to {calls}")
        while self.calls < calls:
            self.step()
