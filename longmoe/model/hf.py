"""Hugging Face checkpoints in and out (`qwen3_moe`, `qwen3_5_moe`), straight into a sharded model.

Loading: every parameter of the (possibly FSDP-sharded, expert-parallel) model asks for exactly
the rows it holds; they are read from the safetensors shards with `get_slice`, so a rank reads only
its own experts and its own FSDP rows and the full model never sits on one rank. Experts can be
stored per expert (`mlp.experts.{e}.gate_proj.weight`, the published layout, which
`save_pretrained` writes) or fused (`mlp.experts.gate_up_proj` [E, 2F, H]).

Exporting writes the published layout: per-expert keys, sharded safetensors plus
`model.safetensors.index.json` and `config.json`. Each expert-parallel group writes its own
experts' shard; rank 0 writes the dense shard, the index and the config.

Names: ours <- theirs (prefix `model.` or, for the multimodal checkpoint, `model.language_model.`)
  embed.weight <- embed_tokens.weight        head.weight <- lm_head.weight (no prefix)
  layers.i.attn_norm / moe_norm <- input_layernorm / post_attention_layernorm
  layers.i.attn.* <- self_attn.* (full attention) or linear_attn.* (Gated DeltaNet)
  layers.i.moe.router.weight <- mlp.gate.weight
  layers.i.moe.experts.w_in[e] = [gate_proj; up_proj]^T, w_out[e] = down_proj^T
  layers.i.moe.shared.gate_up = [gate_proj; up_proj], .down, .gate <- mlp.shared_expert(_gate)
  head.norm.weight <- norm.weight
Which architecture a config is written as, and how RMSNorm weights convert between the w and
(1 + w) conventions, is decided in hf_compat.py: exactly, or refused naming the field.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from longmoe.errors import UserError
from longmoe.model.hf_compat import QWEN3, QWEN35, check_state, is_offset_norm, target

SUPPORTED = (QWEN3, "qwen3_5_moe", QWEN35)


class _Store:
    """The tensors of a checkpoint directory: key -> file, opened lazily, read by row ranges."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise UserError(f"hf checkpoint: {self.dir} is not a directory")
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            weight_map = None
        else:
            raise UserError(f"hf checkpoint: {self.dir} has neither model.safetensors nor "
                            "model.safetensors.index.json")
        self._open, self._safe_open = {}, safe_open
        if weight_map is None:
            f = self._file("model.safetensors")
            weight_map = {k: "model.safetensors" for k in f.keys()}
        missing = sorted({f for f in weight_map.values() if not (self.dir / f).exists()})
        if missing:
            raise UserError(f"hf checkpoint: shard {self.dir / missing[0]} listed in the index is "
                            f"missing ({len(missing)} missing)")
        self.map = weight_map
        self.prefix = "model.language_model." if any(
            k.startswith("model.language_model.") for k in weight_map) else "model."

    def _file(self, name):
        if name not in self._open:
            self._open[name] = self._safe_open(str(self.dir / name), "pt")
        return self._open[name]

    def has(self, key) -> bool:
        return key in self.map

    def shape(self, key) -> tuple:
        return tuple(self._slice(key).get_shape())

    def _slice(self, key):
        if key not in self.map:
            raise UserError(f"hf checkpoint: tensor {key} not found in {self.dir}")
        return self._file(self.map[key]).get_slice(key)

    def rows(self, key, lo=None, hi=None) -> torch.Tensor:
        s = self._slice(key)
        return s[lo:hi] if lo is not None else s[:]


# Per-layer parameters that map one to one (ours -> theirs, after the layer prefix).
_ONE_TO_ONE = {"attn_norm.weight": "input_layernorm.weight",
               "moe_norm.weight": "post_attention_layernorm.weight",
               "moe.router.weight": "mlp.gate.weight",
               "moe.shared.down.weight": "mlp.shared_expert.down_proj.weight",
               "moe.shared.gate.weight": "mlp.shared_expert_gate.weight"}


def _plain(name: str) -> str:
    """A parameter or module name without recompute wrappers' path components."""
    return name.replace("block.", "").replace("_checkpoint_wrapped_module.", "")


def _our_layer_names(model) -> dict[str, torch.nn.Parameter]:
    return {_plain(n): p for n, p in model.named_parameters()}


def _local_rows(p) -> tuple[int, int]:
    """Rows [lo, hi) of dim 0 that this rank's shard of `p` holds (all rows if unsharded)."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return offset[0], offset[0] + shape[0]
    return 0, p.shape[0]


def _source(store: _Store, ours: str, first_expert: int):
    """fn(lo, hi) -> rows lo..hi of our tensor `ours`, read from the checkpoint, and the full
    shape our tensor has according to the checkpoint."""
    P = store.prefix
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", ours)
    if ours == "embed.weight":
        key = P + "embed_tokens.weight"
        return (lambda lo, hi: store.rows(key, lo, hi)), store.shape(key)
    if ours == "head.weight":
        return (lambda lo, hi: store.rows("lm_head.weight", lo, hi)), store.shape("lm_head.weight")
    if ours == "head.norm.weight":
        key = P + "norm.weight"
        return (lambda lo, hi: store.rows(key, lo, hi)), store.shape(key)
    if m is None:
        raise UserError(f"hf checkpoint: no mapping for parameter {ours}")
    L, rest = P + f"layers.{m.group(1)}.", m.group(2)
    if rest in _ONE_TO_ONE or rest.startswith("attn."):
        name = _ONE_TO_ONE.get(rest) or (("linear_attn." if store.has(L + "linear_attn." + rest[5:])
                                     else "self_attn.") + rest[5:])
        key = L + name
        return (lambda lo, hi: store.rows(key, lo, hi)), store.shape(key)
    if rest == "moe.shared.gate_up.weight":
        g, u = L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"
        F = store.shape(g)[0]

        def read(lo, hi):
            parts = []
            if lo < F:
                parts.append(store.rows(g, lo, min(hi, F)))
            if hi > F:
                parts.append(store.rows(u, max(lo, F) - F, hi - F))
            return torch.cat(parts)
        return read, (2 * F, store.shape(g)[1])
    if rest in ("moe.experts.w_in", "moe.experts.w_out"):
        fused = L + ("mlp.experts.gate_up_proj" if rest.endswith("w_in") else
                     "mlp.experts.down_proj")
        if store.has(fused):
            E, a, b = store.shape(fused)
            return (lambda lo, hi: store.rows(fused, first_expert + lo, first_expert + hi)
                    .transpose(1, 2)), (E, b, a)
        e0 = L + "mlp.experts.0."
        if rest.endswith("w_in"):
            F, H = store.shape(e0 + "gate_proj.weight")

            def read(lo, hi):
                return torch.stack([torch.cat([store.rows(L + f"mlp.experts.{e}.gate_proj.weight"),
                                               store.rows(L + f"mlp.experts.{e}.up_proj.weight")]).T
                                    for e in range(first_expert + lo, first_expert + hi)])
            return read, (None, H, 2 * F)
        H, F = store.shape(e0 + "down_proj.weight")
        return (lambda lo, hi: torch.stack([store.rows(L + f"mlp.experts.{e}.down_proj.weight").T
                                            for e in range(first_expert + lo, first_expert + hi)])
                ), (None, F, H)
    raise UserError(f"hf checkpoint: no mapping for parameter {ours}")


def _import_shift(store: _Store, cfg) -> float:
    """The checkpoint's model_type must be the architecture that computes `cfg` (hf_compat);
    returns the RMSNorm shift between its convention and ours."""
    conf = store.dir / "config.json"
    if not conf.exists():
        raise UserError(f"hf checkpoint: {store.dir} has no config.json (its model_type decides "
                        f"how the RMSNorm weights convert)")
    mt = json.loads(conf.read_text()).get("model_type")
    want = target(cfg)
    if {"qwen3_5_moe": QWEN35}.get(mt, mt) != want.model_type:
        raise UserError(f"hf checkpoint: {conf} has model_type {mt!r}; the model config computes "
                        f"{want.model_type} (chosen by model.{want.chosen_by})")
    return want.norm_shift


@torch.no_grad()
def load_hf(model, directory: str | Path) -> int:
    """Fill every parameter of `model` (plain, FSDP2-sharded or expert-parallel) from a Hugging
    Face checkpoint directory; returns the number of elements this rank read. Shapes are checked
    against the model before anything is copied, so a mismatch leaves the model untouched."""
    from longmoe.model.moe import GroupedExperts
    store = _Store(directory)
    shift = _import_shift(store, model.cfg)
    first = {_plain(n): m.first_expert
             for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    plan = []
    for name, p in _our_layer_names(model).items():
        owner = name.rsplit(".", 1)[0]
        readf, shape = _source(store, name, first.get(owner, 0))
        if shift and is_offset_norm(name):  # theirs = ours + shift (hf_compat)
            readf = (lambda f: lambda lo, hi: f(lo, hi).float() - shift)(readf)
        full = tuple(p.shape)
        want = full[1:] if owner in first else full
        got = tuple(shape[1:]) if owner in first else tuple(shape)
        if tuple(want) != got:
            raise UserError(f"hf checkpoint: {name} has shape {got} in {store.dir} but the model "
                            f"config needs {tuple(want)}")
        if owner in first and shape[0] is not None and shape[0] < first[owner] + full[0]:
            raise UserError(f"hf checkpoint: {name}: {shape[0]} experts in {store.dir}, the model "
                            f"needs {first[owner] + full[0]}")
        plan.append((name, p, readf))
    n = 0
    for name, p, readf in plan:
        lo, hi = _local_rows(p)
        local = p.to_local() if isinstance(p, DTensor) else p
        if hi > lo:
            local.copy_(readf(lo, hi).to(local.dtype))
            n += local.numel()
    return n


# ---- export -------------------------------------------------------------------------------

def gathered_parameters(model):
    """(our name, full tensor, its GroupedExperts or None), one parameter at a time in the same
    order on every rank. A sharded (DTensor) parameter is all-gathered over its mesh, so every rank
    must drain this; an expert stack comes out as this rank's [L, ...] experts, gathered over the
    ranks that share them. Only one gathered tensor is alive per step when the caller drops it."""
    from longmoe.model.moe import GroupedExperts
    experts = {_plain(n): m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    for name, p in _our_layer_names(model).items():
        full = p.full_tensor() if isinstance(p, DTensor) else p  # collective: every rank
        yield name, full.detach(), experts.get(name.rsplit(".", 1)[0])
        del full  # before the next gather, not after it


def hf_tensors(name: str, t: torch.Tensor, first_expert: int, cfg, prefix: str = "model.",
               grad: bool = False) -> dict:
    """Our (full, or one rank's experts) tensor -> {hf key: tensor} in the published layout of
    hf_compat.target(cfg). The values are views of `t` (per expert: transposed), except RMSNorm
    weights whose convention differs from the target's (w -/+ 1, a new tensor). `grad`: `t` is a
    gradient, which maps unchanged (d/d(w - 1) = d/dw)."""
    if not grad and is_offset_norm(name) and (shift := target(cfg).norm_shift):
        t = t + shift
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if name == "embed.weight":
        return {prefix + "embed_tokens.weight": t}
    if name == "head.weight":
        return {"lm_head.weight": t}
    if name == "head.norm.weight":
        return {prefix + "norm.weight": t}
    L, rest = prefix + f"layers.{m.group(1)}.", m.group(2)
    if rest == "moe.experts.w_in":
        out = {}
        for i in range(t.shape[0]):
            gate, up = t[i].T.chunk(2)
            e = first_expert + i
            out[L + f"mlp.experts.{e}.gate_proj.weight"] = gate
            out[L + f"mlp.experts.{e}.up_proj.weight"] = up
        return out
    if rest == "moe.experts.w_out":
        return {L + f"mlp.experts.{first_expert + i}.down_proj.weight": t[i].T
                for i in range(t.shape[0])}
    if rest == "moe.shared.gate_up.weight":
        g, u = t.chunk(2)
        return {L + "mlp.shared_expert.gate_proj.weight": g, L + "mlp.shared_expert.up_proj.weight": u}
    if rest in _ONE_TO_ONE:
        return {L + _ONE_TO_ONE[rest]: t}
    linear = cfg.layer_type(int(m.group(1))) == "linear_attention"
    return {L + ("linear_attn." if linear else "self_attn.") + rest[5:]: t}


def hf_config(cfg, dtype: str = "bfloat16") -> dict:
    """config.json for `cfg` as the architecture that computes it (hf_compat.target: qwen3_moe or
    qwen3_5_moe_text; ConfigError naming the field where none does). Every value transformers
    reads to build the model is written, floats as floats (its strict config rejects an int)."""
    cfg = getattr(cfg, "model", cfg)
    t = target(cfg)
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    out = {"model_type": t.model_type, "architectures": [t.architecture],
           "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": float(cfg.rms_norm_eps), "num_experts": cfg.num_experts,
           "num_experts_per_tok": cfg.top_k, "moe_intermediate_size": cfg.moe_ffn_size,
           "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu",
           "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
           "router_aux_loss_coef": float(cfg.router_aux_loss_coef), "dtype": dtype}
    if t.model_type == QWEN35:
        rope["partial_rotary_factor"] = float(cfg.partial_rotary_factor)
        out.update(shared_expert_intermediate_size=cfg.shared_expert_ffn_size,
                   layer_types=[cfg.layer_type(i) for i in range(cfg.num_layers)],
                   linear_conv_kernel_dim=cfg.linear_conv_kernel,
                   linear_key_head_dim=cfg.linear_key_head_dim,
                   linear_value_head_dim=cfg.linear_value_head_dim,
                   linear_num_key_heads=cfg.linear_num_key_heads,
                   linear_num_value_heads=cfg.linear_num_value_heads)
    else:
        out.update(num_local_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    out["rope_parameters"] = rope
    return out


def _atomic_write(path: Path, write):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + "-")
    os.close(fd)
    write(tmp)
    os.replace(tmp, path)


@torch.no_grad()
def export_hf(model, cfg, directory: str | Path, dtype: torch.dtype = torch.bfloat16):
    """Write `model` (every rank calls this) as a Hugging Face checkpoint directory."""
    from safetensors.torch import save_file

    target(cfg)  # every rank refuses the same config, before any collective
    check_state(model, cfg, "export_hf")
    out = Path(directory)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dense, mine, ep_rank = {}, {}, 0
    for name, full, experts in gathered_parameters(model):
        if experts is not None:
            ep_rank = experts.first_expert // experts.num_local
            mine.update(hf_tensors(name, full, experts.first_expert, cfg))
        else:
            dense.update(hf_tensors(name, full, 0, cfg))
    # One writer per expert group: the lowest rank holding those experts.
    writers = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(writers, ep_rank)
    else:
        writers = [ep_rank]
    n_groups = max(writers) + 1
    files, nbytes = {}, 0
    if rank == writers.index(ep_rank):
        fname = f"model-experts-{ep_rank + 1:05d}-of-{n_groups:05d}.safetensors"
        tensors = {k: v.to(dtype).contiguous().cpu() for k, v in mine.items()}
        _atomic_write(out / fname, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        files.update({k: fname for k in tensors})
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
    gathered = [None] * len(writers)
    if dist.is_initialized():
        dist.all_gather_object(gathered, (files, nbytes))
    else:
        gathered = [(files, nbytes)]
    if rank == 0:
        tensors = {k: v.to(dtype).contiguous().cpu() for k, v in dense.items()}
        _atomic_write(out / "model-dense.safetensors",
                      lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        weight_map = {k: "model-dense.safetensors" for k in tensors}
        for f, _ in gathered:
            weight_map.update(f)
        size = sum(v.numel() * v.element_size() for v in tensors.values())
        size += sum(b for _, b in gathered)
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        _atomic_write(out / "model.safetensors.index.json",
                      lambda tmp: Path(tmp).write_text(json.dumps(index, indent=1)))
        conf = hf_config(cfg, str(dtype).replace("torch.", ""))
        _atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(conf, indent=1)))
    if dist.is_initialized():
        dist.barrier()
    return out
