"""Which Hugging Face architecture computes the same function as a ModelConfig, and how our weights
map onto it: exactly, or refused with one line naming the field. Every path that hands weights to
another implementation (export_hf, named_weights_for_rollout, load_into_hf_model) and the import
(load_hf) goes through `target`.

The two targets, as transformers 5.x builds them (models/qwen3_moe, models/qwen3_5_moe):
  qwen3_moe          every layer full attention with q/k RMSNorm and no output gate, routed
                     experts only, RoPE over the whole head; RMSNorm scales by w.
  qwen3_5_moe_text   full-attention layers always gate their output and apply q/k RMSNorm;
                     Gated DeltaNet layers; always a sigmoid-gated shared expert; top-k weights
                     always renormalised; RoPE over partial_rotary_factor of the head. Its
                     RMSNorms (input and post-attention layer norms, the final norm, q/k norms)
                     scale by (1 + w); the Gated DeltaNet's gated norm scales by w.
A config with an output gate, a Gated DeltaNet layer or a shared expert needs qwen3_5_moe_text,
any other qwen3_moe. Both read silu, untied embeddings, no attention bias, default RoPE
(rope_type "default", 1/sqrt(head_dim) attention scale), which is what longmoe computes.

Norm convention: our RMSNorm scales by w, or by (1 + w) with model.norm_unit_offset. Where the
target's convention differs, those weights are written as w - 1 (or w + 1) and read back the other
way round: the same scale, so the same function (a gradient maps unchanged).

What cannot be expressed is refused: qk_norm false (both targets normalise q and k), no output
gate where qwen3_5_moe_text is needed, a qwen3_5_moe_text config without a shared expert or with
norm_topk_prob false, partial RoPE under qwen3_moe, and an aux-loss-free expert bias that differs
between experts (it steers selection; neither target has one) (`check_state`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from longmoe.errors import ConfigError, UserError

QWEN3 = "qwen3_moe"
QWEN35 = "qwen3_5_moe_text"
ARCHITECTURE = {QWEN3: "Qwen3MoeForCausalLM", QWEN35: "Qwen3_5MoeForCausalLM"}

# Our parameters that are RMSNorm weights with the model.norm_unit_offset convention (the Gated
# DeltaNet's gated norm, layers.i.attn.norm.weight, is plain w in both implementations).
_OFFSET_NORM = re.compile(r"(layers\.\d+\.(attn_norm|moe_norm|attn\.q_norm|attn\.k_norm)"
                          r"|head\.norm)\.weight")


@dataclass(frozen=True)
class Target:
    model_type: str       # QWEN3 or QWEN35
    chosen_by: str        # the field that decided it, for messages
    norm_shift: float     # theirs = ours + norm_shift, for the offset-convention norms

    @property
    def architecture(self) -> str:
        return ARCHITECTURE[self.model_type]


def unit_offset(model_type: str) -> bool:
    """Whether `model_type`'s RMSNorms (other than the gated one) scale by (1 + w)."""
    return model_type != QWEN3


def is_offset_norm(name: str) -> bool:
    """`name` (ours, without wrapper path components) is an RMSNorm weight with the
    norm_unit_offset convention."""
    return _OFFSET_NORM.fullmatch(name) is not None


def _refuse(field: str, why: str):
    raise ConfigError(f"model.{field}", why)


def target(cfg) -> Target:
    """The architecture that computes `cfg`'s function (a ModelConfig or a RunConfig), or a
    ConfigError naming the field that no architecture can express."""
    return _target(getattr(cfg, "model", cfg))


@functools.lru_cache(maxsize=64)
def _target(cfg) -> Target:
    kinds = {cfg.layer_type(i) for i in range(cfg.num_layers)}
    full = "full_attention" in kinds
    if full and not cfg.qk_norm:
        _refuse("qk_norm", "false cannot be exported: qwen3_moe and qwen3_5_moe_text both apply "
                           "RMSNorm to q and k in every full-attention layer")
    chosen_by = ("layer_types" if "linear_attention" in kinds else
                 "shared_expert_ffn_size" if cfg.shared_expert_ffn_size > 0 else
                 "attn_output_gate" if cfg.attn_output_gate else "")
    if chosen_by:
        need = f"(model.{chosen_by} needs qwen3_5_moe_text)"
        if full and not cfg.attn_output_gate:
            _refuse("attn_output_gate", f"false cannot be exported: qwen3_5_moe_text always gates "
                                        f"the attention output {need}")
        if cfg.shared_expert_ffn_size == 0:
            _refuse("shared_expert_ffn_size", f"0 cannot be exported: qwen3_5_moe_text always has "
                                              f"a shared expert {need}")
        if not cfg.norm_topk_prob:
            _refuse("norm_topk_prob", f"false cannot be exported: qwen3_5_moe_text always "
                                      f"renormalises the top-k weights {need}")
        model_type = QWEN35
    else:
        if cfg.partial_rotary_factor != 1.0:
            _refuse("partial_rotary_factor", f"{cfg.partial_rotary_factor} cannot be exported: "
                                             "qwen3_moe (no output gate, no shared expert, no "
                                             "Gated DeltaNet) rotates the whole head")
        model_type, chosen_by = QWEN3, "attn_output_gate"
    shift = float(cfg.norm_unit_offset) - float(unit_offset(model_type))
    return Target(model_type, chosen_by, shift)


def check_state(model, cfg, what: str):
    """Refuse weights whose function the target cannot compute although the config could be
    expressed: an aux-loss-free expert bias that differs between experts changes which experts
    a token picks (a bias equal for every expert changes nothing)."""
    from longmoe.model.moe import Router
    cfg = getattr(cfg, "model", cfg)
    if cfg.expert_bias_rate <= 0:
        return
    for m in model.modules():
        if isinstance(m, Router) and bool((m.expert_bias != m.expert_bias[0]).any()):
            raise UserError(f"{what}: model.expert_bias_rate: the trained expert bias steers "
                            f"routing, which {target(cfg).model_type} cannot express; "
                            f"export needs model.expert_bias_rate=0")


def _get(conf, key, default=None):
    return conf.get(key, default) if isinstance(conf, dict) else getattr(conf, key, default)


def check_receiver(conf, expected: dict, cfg, what: str):
    """Every config value transformers reads to build `expected["model_type"]` (a dict from
    hf_config) equals the receiver's `conf` (a transformers config or a dict), or a UserError
    names the first that differs and the field of ours it comes from."""
    cfg = getattr(cfg, "model", cfg)
    if conf is None:
        raise UserError(f"{what}: the receiver has no config to check against model.* (build it "
                        f"from longmoe.model.hf.hf_config)")
    if _get(conf, "model_type") != expected["model_type"]:
        raise UserError(f"{what}: the receiver is {_get(conf, 'model_type')!r}; this policy "
                        f"computes {expected['model_type']} (chosen by "
                        f"model.{target(cfg).chosen_by})")
    rope = _get(conf, "rope_parameters") or {}
    linear = "linear_attention" in cfg.layer_types  # else no layer reads the linear_* sizes
    checks = [(k, _get(conf, k), v) for k, v in expected.items()
              if k not in _NOT_READ and k != "rope_parameters"
              and (linear or not k.startswith("linear_"))]
    checks += [("rope_parameters." + k, rope.get(k, 1.0 if k == "partial_rotary_factor" else None),
                v) for k, v in expected["rope_parameters"].items()]
    for key, got, want in checks:
        if isinstance(want, list):
            got = list(got) if got is not None else None
        if got != want:
            ours = _OURS.get(key.split(".")[-1])
            source = (f"model.{ours} is {getattr(cfg, ours)!r}" if ours
                      else f"longmoe computes {want!r}")
            raise UserError(f"{what}: the receiver's config has {key}={got!r}; {source}")


# Keys of hf_config that do not change the function (a training loss weight, a storage dtype,
# the names) or are checked on their own.
_NOT_READ = {"model_type", "architectures", "dtype", "router_aux_loss_coef",
             "max_position_embeddings"}
# config.json key -> the ModelConfig field it is written from.
_OURS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
         "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
         "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim",
         "rms_norm_eps": "rms_norm_eps", "num_experts": "num_experts",
         "num_local_experts": "num_experts", "num_experts_per_tok": "top_k",
         "moe_intermediate_size": "moe_ffn_size", "norm_topk_prob": "norm_topk_prob",
         "shared_expert_intermediate_size": "shared_expert_ffn_size",
         "layer_types": "layer_types", "linear_conv_kernel_dim": "linear_conv_kernel",
         "linear_key_head_dim": "linear_key_head_dim",
         "linear_value_head_dim": "linear_value_head_dim",
         "linear_num_key_heads": "linear_num_key_heads",
         "linear_num_value_heads": "linear_num_value_heads",
         "rope_theta": "rope_theta", "partial_rotary_factor": "partial_rotary_factor"}
