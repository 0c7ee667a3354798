"""Model configuration: a frozen dataclass, named presets, and import from a Hugging Face config.json.

A config that cannot work is rejected when it is built, with the field name in the message.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from longmoe.errors import ConfigError


LAYER_TYPES = ("full_attention", "linear_attention")


def declared_types(obj, prefix: str):
    """Every float field of the frozen dataclass `obj` stored as a float (a whole number from YAML
    or `--set x=0` arrives as an int, and a config.json written from it then fails transformers'
    strict float check on load); a bool is neither a number nor stored as one, and a bool field
    takes only true or false."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.type == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"{prefix}.{f.name}", f"expected a number, got {v!r}")
            object.__setattr__(obj, f.name, float(v))
        elif f.type == "bool" and not isinstance(v, bool):
            raise ConfigError(f"{prefix}.{f.name}", f"expected true or false, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    # Fraction of each head's dims that RoPE rotates (Qwen3.5 rotates 1/4; Qwen3 all).
    partial_rotary_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Zero-centred RMSNorm, x_hat * (1 + w) with w initialised to 0 (Qwen3.5/Qwen3-Next).
    norm_unit_offset: bool = False
    # RMSNorm on q and k per head before RoPE (Qwen3 family).
    qk_norm: bool = True
    # Qwen3.5/Qwen3-Next: q_proj also emits a per-head gate; attn_out *= sigmoid(gate).
    attn_output_gate: bool = False
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_size: int = 32
    # 0 disables the shared expert; otherwise its FFN width, gated by sigmoid(x @ w_gate).
    shared_expert_ffn_size: int = 0
    # Renormalise the top-k softmax weights so they sum to one per token.
    norm_topk_prob: bool = True
    # Load-balancing loss weight (Switch-style f_i * P_i over the global batch); 0 turns it off.
    router_aux_loss_coef: float = 1e-3
    # Aux-loss-free balancing: a per-expert bias added to scores for selection only,
    # nudged by `expert_bias_rate * sign(mean_load - load)` after every step; 0 turns it off.
    expert_bias_rate: float = 0.0
    max_seq_len: int = 4096
    init_std: float = 0.02
    # Layer types ("full_attention" / "linear_attention"); empty means all full attention.
    # A linear_attention layer is Gated DeltaNet (longmoe/model/deltanet.py) with these sizes:
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    source: str = ""

    def __post_init__(self):
        declared_types(self, "model")
        pos = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
               "head_dim", "num_experts", "top_k", "moe_ffn_size", "max_seq_len"]
        for name in pos:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{name}", f"must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("model.num_kv_heads",
                              f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.top_k > self.num_experts:
            raise ConfigError("model.top_k", f"{self.top_k} > num_experts={self.num_experts}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError("model.partial_rotary_factor", "must be in (0, 1]")
        if self.rotary_dim % 2:
            raise ConfigError("model.partial_rotary_factor",
                              f"rotates {self.rotary_dim} dims of head_dim={self.head_dim}; must be even")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError("model.layer_types", f"has {len(self.layer_types)} entries for "
                                                   f"num_layers={self.num_layers}")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"model.layer_types[{i}]",
                                  f"unknown layer type {t!r}; valid: {', '.join(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                    raise ConfigError(f"model.{name}", f"must be a positive integer, got {v!r}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError("model.linear_num_key_heads",
                                  f"{self.linear_num_key_heads} does not divide "
                                  f"linear_num_value_heads={self.linear_num_value_heads}")
        for name in ("rms_norm_eps", "rope_theta", "init_std"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name}", f"must be > 0, got {getattr(self, name)!r}")
        if self.shared_expert_ffn_size < 0:
            raise ConfigError("model.shared_expert_ffn_size", "must be >= 0")
        for name in ("router_aux_loss_coef", "expert_bias_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}", "must be >= 0")

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def replace(self, **kw) -> "ModelConfig":
        return from_dict({**dataclasses.asdict(self), **kw})

    def linear_attention_params(self) -> int:
        """Parameters of one Gated DeltaNet (linear_attention) mixer."""
        H, Hv, dv = self.hidden_size, self.linear_num_value_heads, self.linear_value_head_dim
        Kd, Vd = self.linear_num_key_heads * self.linear_key_head_dim, Hv * dv
        conv = 2 * Kd + Vd
        return H * conv + H * Vd + 2 * H * Hv + conv * self.linear_conv_kernel + 2 * Hv + dv + Vd * H

    def num_params(self) -> dict[str, int]:
        """Parameter counts: total and active per token (top-k routed + shared + dense parts)."""
        h, hd = self.hidden_size, self.head_dim
        q_out = self.num_heads * hd * (2 if self.attn_output_gate else 1)
        attn = h * q_out + 2 * h * self.num_kv_heads * hd + self.num_heads * hd * h
        attn += 2 * hd if self.qk_norm else 0
        expert = 3 * h * self.moe_ffn_size
        shared = 3 * h * self.shared_expert_ffn_size + h if self.shared_expert_ffn_size else 0
        router = h * self.num_experts
        linear = self.linear_attention_params()
        n_linear = sum(1 for i in range(self.num_layers)
                       if self.layer_type(i) == "linear_attention")
        moe_common = shared + router + 2 * h
        mixers = (self.num_layers - n_linear) * attn + n_linear * linear
        emb = 2 * self.vocab_size * h + h
        total = mixers + self.num_layers * (moe_common + self.num_experts * expert) + emb
        active = mixers + self.num_layers * (moe_common + self.top_k * expert) + emb
        return {"total": total, "active": active}


def from_dict(d: dict[str, Any], prefix: str = "model") -> ModelConfig:
    """Build a ModelConfig from a plain dict, rejecting unknown fields by name."""
    if not isinstance(d, dict):
        raise ConfigError(prefix, f"expected a mapping, got {type(d).__name__}")
    d = dict(d)
    preset = d.pop("preset", None)
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{prefix}.preset", f"expected a preset name, got {preset!r}")
    num_layers = d.pop("num_layers", None)
    base = dataclasses.asdict(get_preset(preset)) if preset else {}
    known = {f.name: f for f in fields(ModelConfig)}
    for k in d:
        if k not in known:
            raise ConfigError(f"{prefix}.{k}", "unknown field")
    merged = {**base, **d}
    if num_layers is not None:
        merged["num_layers"] = num_layers
        lt = tuple(merged.get("layer_types") or ())
        if lt and isinstance(num_layers, int) and num_layers > 0:
            lt = tuple(lt[i % len(lt)] for i in range(num_layers))  # truncate, or repeat the pattern
        merged["layer_types"] = lt
    if "layer_types" in merged:
        merged["layer_types"] = tuple(merged["layer_types"])
    return ModelConfig(**merged)


# ---- presets ------------------------------------------------------------------------------

def _qwen35_layer_types(n: int) -> tuple[str, ...]:
    # Three Gated DeltaNet layers, then one gated full-attention layer (full_attention_interval=4).
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))


PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on a 2-core CPU; still has GQA, partial rotary, gates, shared expert.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        partial_rotary_factor=0.5, attn_output_gate=True, num_experts=8, top_k=2,
        moe_ffn_size=32, shared_expert_ffn_size=48, max_seq_len=1024, source="longmoe tiny"),
    # tiny with the Qwen3.5 hybrid layout: three Gated DeltaNet layers, then full attention.
    "tiny-hybrid": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        partial_rotary_factor=0.25, norm_unit_offset=True, attn_output_gate=True, num_experts=8,
        top_k=2, moe_ffn_size=32, shared_expert_ffn_size=48, max_seq_len=1024,
        layer_types=_qwen35_layer_types(4), linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, source="longmoe tiny-hybrid"),
    # Source: huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (model_type qwen3_moe).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, partial_rotary_factor=1.0, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        qk_norm=True, attn_output_gate=False, num_experts=128, top_k=8, moe_ffn_size=768,
        shared_expert_ffn_size=0, norm_topk_prob=True, router_aux_loss_coef=1e-3,
        max_seq_len=40960, source="huggingface.co/Qwen/Qwen3-30B-A3B config.json"),
    # Source: huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json, text_config
    # (model_type qwen3_5_moe), cross-checked with transformers' configuration_qwen3_5_moe.py and
    # THUDM/slime scripts/models/qwen3.5-35B-A3B.sh. router_aux_loss_coef 0.001 is the
    # transformers default (not confirmed in the original file). 30 of its 40 layers are Gated
    # DeltaNet (16 key heads, 32 value heads, dims 128, conv kernel 4: transformers' defaults for
    # qwen3_5_moe, which the published config uses). The MTP head and the vision tower are not
    # modelled.
    "qwen3.5-35b-a3b": ModelConfig(
        vocab_size=248320, hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2,
        head_dim=256, partial_rotary_factor=0.25, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
        norm_unit_offset=True, qk_norm=True, attn_output_gate=True, num_experts=256, top_k=8,
        moe_ffn_size=512, shared_expert_ffn_size=512, norm_topk_prob=True, router_aux_loss_coef=1e-3,
        max_seq_len=262144, layer_types=_qwen35_layer_types(40),
        source="huggingface.co/Qwen/Qwen3.5-35B-A3B config.json (text_config)"),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


# ---- Hugging Face config.json -------------------------------------------------------------

_LINEAR_KEYS = (("linear_num_key_heads", "linear_num_key_heads"),
                ("linear_num_value_heads", "linear_num_value_heads"),
                ("linear_key_head_dim", "linear_key_head_dim"),
                ("linear_value_head_dim", "linear_value_head_dim"),
                ("linear_conv_kernel", "linear_conv_kernel_dim"))


def from_hf_config(path: str | Path, num_layers: int | None = None) -> ModelConfig:
    """Read a `qwen3_moe` or `qwen3_5_moe` config.json (config only; no weights)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("model.hf_config", f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError("model.hf_config", f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError("model.hf_config", f"{path}: top level must be a JSON object")
    mt = raw.get("model_type")
    text = raw.get("text_config", raw) if mt in ("qwen3_5_moe",) else raw
    if mt not in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text"):
        raise ConfigError("model.hf_config", f"{path}: unsupported model_type {mt!r} "
                                             "(supported: qwen3_moe, qwen3_5_moe, qwen3_5_moe_text)")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = text.get("rope_theta", rope.get("rope_theta", 10000.0))
    prf = text.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    try:
        n_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
    except KeyError as e:
        raise ConfigError("model.hf_config", f"{path}: missing key {e.args[0]!r}") from None
    layer_types = tuple(text.get("layer_types") or ())
    if not layer_types and text.get("full_attention_interval"):
        k = int(text["full_attention_interval"])
        layer_types = tuple("full_attention" if (i + 1) % k == 0 else "linear_attention"
                            for i in range(n_layers))
    try:
        cfg = dict(
            vocab_size=int(text["vocab_size"]), hidden_size=hidden, num_layers=n_layers,
            num_heads=heads, num_kv_heads=int(text.get("num_key_value_heads", heads)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            partial_rotary_factor=float(prf), rope_theta=float(theta),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), qk_norm=True,
            norm_unit_offset=mt != "qwen3_moe",
            attn_output_gate=bool(text.get("attn_output_gate", mt != "qwen3_moe")),
            num_experts=int(text["num_local_experts"] if "num_local_experts" in text
                            else text["num_experts"]), top_k=int(text["num_experts_per_tok"]),
            moe_ffn_size=int(text["moe_intermediate_size"]),
            shared_expert_ffn_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
            # Qwen3.5 drops the key and always renormalises.
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.0) or 0.0),
            max_seq_len=int(text.get("max_position_embeddings", 4096)),
            layer_types=layer_types, source=str(path),
            **{ours: int(text[theirs]) for ours, theirs in _LINEAR_KEYS if theirs in text})
    except KeyError as e:
        raise ConfigError("model.hf_config", f"{path}: missing key {e.args[0]!r}") from None
    if num_layers is not None:
        cfg["num_layers"] = num_layers
        cfg["layer_types"] = layer_types[:num_layers]
    return ModelConfig(**cfg)


def model_config_from(section: dict[str, Any] | None) -> ModelConfig:
    """The `model:` section of a run config: a preset, an hf_config path, or explicit fields."""
    section = dict(section or {"preset": "tiny"})
    hf = section.pop("hf_config", None)
    if hf is not None and not isinstance(hf, str):
        raise ConfigError("model.hf_config", f"expected a path to a config.json, got {hf!r}")
    if hf is not None:
        n = section.pop("num_layers", None)
        cfg = from_hf_config(hf, n)
        return cfg.replace(**section) if section else cfg
    return from_dict(section)
