"""The memory estimate's norm terms (longmoe.plan.memory.norm_bytes) against the bytes autograd
keeps for one forward of each norm on the path the estimate names: the Triton kernels of
ops/kernels/norm_rows.py (impl.norm=auto on a GPU), run on CPU under TRITON_INTERPRET=1, through
the layers that call them: the block's RMSNorm, the q/k norms inside Attention.project (q as the
layer slices it beside the output gate) and the Gated DeltaNet output norm on tensors shaped as
its forward makes them (the cos/sin tables the q/k norms keep are computed once a forward for
every layer, 4R bytes a token, and are left out). Bytes per token are the difference between two token counts (unique
storages, saved_tensors_hooks), so the weights cancel. The eager functions keep fp32 copies
instead: the same count must not match them."""

import json
import sys

import pytest
import torch

from _interpreter import last_json_line, run_interpreted

PRESETS = ("qwen3.5-35b-a3b", "qwen3-30b-a3b")     # with and without the attention output gate
TOKENS = (8, 16)


def _saved_per_token(run) -> float:
    """Bytes a token of what `run(T, hooks)` keeps for backward inside `hooks()`, less the
    tensors it returns (inputs every layer shares)."""
    kept = {}
    for T in TOKENS:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        shared = run(T, lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        for t in shared or ():
            seen.pop(t.untyped_storage().data_ptr(), None)
        kept[T] = sum(seen.values())
    return (kept[TOKENS[1]] - kept[TOKENS[0]]) / (TOKENS[1] - TOKENS[0])


def _measure(preset: str, impl: str) -> dict:
    from longmoe.config import get_preset
    from longmoe.model import layers
    from longmoe.model.deltanet import GatedDeltaNet
    from longmoe.model.layers import Attention, RMSNorm, rope_cos_sin
    torch.manual_seed(0)
    cfg = get_preset(preset)
    bf16 = torch.bfloat16
    out = {}

    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset).to(bf16)
    norm.impl = impl

    def rms(T, hooks):
        x = torch.randn(1, T, cfg.hidden_size, dtype=bf16, requires_grad=True)
        with hooks():
            norm(x)
    out["rms"] = _saved_per_token(rms)

    attn = Attention(cfg).to(bf16)
    attn.q_norm.impl = attn.k_norm.impl = impl

    def qk(T, hooks):
        x = torch.randn(1, T, cfg.hidden_size, dtype=bf16, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(T), cfg.rotary_dim, cfg.rope_theta, bf16)
        plain = layers.RMSNorm.with_rope

        def counted(self, *a):
            with hooks():
                return plain(self, *a)
        layers.RMSNorm.with_rope = counted
        try:
            attn.project(x, cos, sin)
        finally:
            layers.RMSNorm.with_rope = plain
        return cos, sin     # computed once a forward for every layer: not a layer's bytes
    out["qk"] = _saved_per_token(qk)

    if any(cfg.layer_type(i) == "linear_attention" for i in range(cfg.num_layers)):
        gdn = GatedDeltaNet(cfg).to(bf16)
        gdn.norm.impl = impl

        def gated(T, hooks):
            x = torch.randn(1, T, cfg.hidden_size, dtype=bf16, requires_grad=True)
            shape = (1, T, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
            o = torch.randn(shape, dtype=bf16, requires_grad=True)   # the core's output
            z = gdn.in_proj_z(x).reshape(shape)
            with hooks():
                gdn.norm(o, z, fused=True, dtype=bf16)
        out["gated"] = _saved_per_token(gated)
    return out


@pytest.fixture(scope="module")
def measured():
    p = run_interpreted([__file__], timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return last_json_line(p.stdout)


@pytest.mark.parametrize("preset", PRESETS)
def test_norm_terms_are_what_the_kernels_keep(measured, preset):
    from longmoe.config import get_preset
    from longmoe.plan.memory import norm_bytes
    est = norm_bytes(get_preset(preset))
    got = measured[preset]["triton"]
    assert set(got) <= set(est)
    for kind, n in got.items():
        assert est[kind] == n, (kind, est[kind], n)


@pytest.mark.parametrize("preset", PRESETS)
def test_the_eager_norms_keep_other_bytes(measured, preset):
    # the count tells the paths apart: the eager functions' fp32 copies are not what it counts
    from longmoe.config import get_preset
    from longmoe.plan.memory import norm_bytes
    est = norm_bytes(get_preset(preset))
    for kind, n in measured[preset]["reference"].items():
        assert n > est[kind], (kind, est[kind], n)


if __name__ == "__main__":  # the interpreted half
    print(json.dumps({p: {impl: _measure(p, impl) for impl in ("triton", "reference")}
                      for p in PRESETS}))
    sys.exit(0)
