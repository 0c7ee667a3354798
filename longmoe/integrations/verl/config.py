"""verl config classes for the longmoe engine, following verl's own pattern: an EngineConfig
subclass (what the engine reads) and an ActorConfig subclass (selected by `_target_`, with
`strategy: longmoe`) that hands its `longmoe` section to the engine, as FSDPActorConfig hands
over `fsdp_config`.

The model, parallel layout, precision, objective settings and data settings are longmoe's: a run
config (`run_config`, a YAML path or a recipe name) plus dotted `overrides`, exactly as
`PolicyTrainer.from_config` takes them. From verl's side the engine takes the optimizer
(lr, betas, weight_decay, clip_grad) and its learning-rate schedule (schedule.py), and, with
`model_from_path`, the model
architecture and weights of `actor_rollout_ref.model.path` (a Hugging Face directory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from verl.workers.config import ActorConfig, EngineConfig

from longmoe.errors import ConfigError


@dataclass
class LongMoEEngineConfig(EngineConfig):
    """`strategy: longmoe`. run_config: a longmoe run YAML or recipe name (None: defaults);
    overrides: dotted longmoe settings applied after it (["parallel.ep=8", ...]);
    model_from_path: build the model from the verl model path's config.json and load its
    weights (off: the run config's model section and random init); fused_ppo_loss: see
    longmoe.integrations.verl.fused."""

    strategy: str = "longmoe"
    run_config: Optional[str] = None
    overrides: list = field(default_factory=list)
    model_from_path: bool = True
    # verl's ppo_loss with settings longmoe's objective computes alike runs fused into the LM
    # head (longmoe/integrations/verl/fused.py); off: always verl's own loss code
    fused_ppo_loss: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.strategy != "longmoe":
            raise ConfigError("strategy", f"the longmoe engine config needs strategy=longmoe, "
                                          f"got {self.strategy!r}")
        if not all(isinstance(o, str) and "=" in o for o in self.overrides):
            raise ConfigError("longmoe.overrides", f"each override is 'key=value', got "
                                                   f"{list(self.overrides)!r}")


@dataclass
class LongMoEActorConfig(ActorConfig):
    """`actor_rollout_ref.actor._target_: longmoe.integrations.verl.LongMoEActorConfig` with
    `strategy: longmoe`; the engine's settings sit under `longmoe:`."""

    strategy: str = "longmoe"
    longmoe: LongMoEEngineConfig = field(default_factory=LongMoEEngineConfig)
    use_remove_padding: bool = True
    use_rollout_log_probs: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.engine = self.longmoe


def optimizer_overrides(optim) -> list[str]:
    """longmoe overrides from verl's OptimizerConfig (None: the run config's own)."""
    if optim is None:
        return []
    out = [f"optim.lr={float(optim.lr)!r}", f"optim.weight_decay={float(optim.weight_decay)!r}"]
    betas = getattr(optim, "betas", None)
    if betas is not None:
        out.append(f"optim.betas=[{float(betas[0])!r}, {float(betas[1])!r}]")
    clip = getattr(optim, "clip_grad", None)
    if clip is not None:
        out.append(f"optim.grad_clip={float(clip)!r}")
    # The schedule (warmup, constant or cosine) is verl's, in iterations: the engine applies it
    # (schedule.py); longmoe's own optim.warmup_steps stays 0.
    return out


def model_overrides(engine_config: LongMoEEngineConfig, model_config) -> list[str]:
    """model.hf_config and train.init_hf from verl's model path, when model_from_path."""
    if not engine_config.model_from_path or model_config is None:
        return []
    path = model_config.get("local_path") or model_config.get("path")
    if not path or not (Path(path) / "config.json").is_file():
        raise ConfigError("model.path", f"{path!r} has no config.json; set "
                                        f"longmoe.model_from_path=false to take the model from "
                                        f"the longmoe run config")
    init = f"train.init_hf={path}" if any(Path(path).glob("*.safetensors")) else None
    return [f"model.hf_config={Path(path) / 'config.json'}"] + ([init] if init else [])


def run_config(engine_config: LongMoEEngineConfig, model_config, optimizer_config):
    """The longmoe RunConfig the engine's PolicyTrainer is built from: the run config, then
    verl's model path and optimizer, then the engine's own overrides (which win)."""
    from longmoe.train.config import load_run_config
    overrides = (model_overrides(engine_config, model_config)
                 + optimizer_overrides(optimizer_config) + list(engine_config.overrides))
    return load_run_config(engine_config.run_config, overrides)
