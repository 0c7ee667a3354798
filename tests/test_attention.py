"""SDPA with a backend preference (longmoe.ops.attention): same results as plain SDPA whichever
backend serves the call, the config names the field on a bad value, and the order comes from data."""

import pytest
import torch
import torch.nn.functional as F

from longmoe.ops.attention import SDPA_NAMES, Attention, preferred_order, sdpa_backends


def _qkv(B, N, K, S, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda n: torch.randn(B, n, S, D, generator=g, device=device, dtype=dtype)  # noqa: E731
    return [t.requires_grad_() for t in (mk(N), mk(K), mk(K))]


def _grads(fn, q, k, v, w):
    out = fn(q, k, v)
    return [out.detach()] + list(torch.autograd.grad((out * w).sum(), (q, k, v)))


@pytest.mark.parametrize("impl", ["auto", "math", "flash"])
def test_cpu_backends_match_plain_sdpa(impl):
    """On CPU the backends that serve it give torch's own results: outputs and gradients (GQA,
    odd length, causal)."""
    q, k, v = _qkv(2, 6, 2, 37, 16, torch.float64)
    w = torch.randn(2, 6, 37, 16, dtype=torch.float64)
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                enable_gqa=True), q, k, v, w)
    got = _grads(lambda a, b, c: Attention(impl)(a, b, c, is_causal=True, enable_gqa=True),
                 q, k, v, w)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_orders_and_errors():
    assert preferred_order("cudnn") == ["cudnn"]
    assert preferred_order("auto", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="fa3"):
        Attention("fa3")
    with pytest.raises(ValueError, match="nope"):
        sdpa_backends(["nope"])


def test_config_names_the_field():
    from longmoe.errors import ConfigError
    from longmoe.train.config import ImplConfig
    assert ImplConfig(attention="cudnn").attention == "cudnn"
    with pytest.raises(ConfigError, match=r"impl\.attention.*'fa3'"):
        ImplConfig(attention="fa3")


def test_auto_order_is_data(tmp_path):
    """Each GPU backend's kernels.json may list an "sdpa" order per arch; every name in it is a
    real backend."""
    import json
    from pathlib import Path
    import longmoe.backends as b
    for vendor in ("cuda", "rocm", "cpu"):
        table = json.loads((Path(b.__file__).parent / vendor / "kernels.json").read_text())
        for arch, buckets in table.get("sdpa", {}).items():
            for cfg in buckets.values():
                assert set(cfg["order"]) <= set(SDPA_NAMES), (vendor, arch)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("impl", ["flash", "cudnn", "auto"])
def test_gpu_backends_match_math_bf16(impl):
    """The model's attention shape (head dim 256, GQA 8:1, causal) in bf16 through each preferred
    backend against the math backend in fp32."""
    q, k, v = _qkv(1, 8, 1, 1000, 256, torch.bfloat16, device="cuda")
    w = torch.randn(1, 8, 1000, 256, device="cuda", dtype=torch.bfloat16)
    f32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_backends(["math"]):
        ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(
            a, b, c, is_causal=True, enable_gqa=True), *f32, w.float())
    try:
        got = _grads(lambda a, b, c: Attention(impl)(a, b, c, is_causal=True, enable_gqa=True),
                     q, k, v, w)
    except RuntimeError as e:  # e.g. no cuDNN attention on ROCm: pinned means no fallback
        if "No available kernel" not in str(e):
            raise
        pytest.skip(f"SDPA backend {impl} cannot serve this shape here")
    for a, b in zip(got, ref):
        scale = b.abs().max()
        assert float((a.float() - b).abs().max() / scale) < 2e-2


@pytest.mark.needs_cuda
@pytest.mark.parametrize("impl", ["auto", "flash", "cudnn"])
def test_gpu_full_recompute_reruns_the_same_backend(impl):
    """Under non-reentrant checkpoint the recomputed forward (run by the autograd engine's
    thread) must pick the backend the first forward picked: a different one saves tensors of
    another dtype and the checkpoint refuses them."""
    from torch.utils.checkpoint import checkpoint
    q, k, v = _qkv(1, 8, 1, 1000, 256, torch.bfloat16, device="cuda")
    att = Attention(impl)
    seen = []

    def f(a, b, c):
        with torch.no_grad(), sdpa_backends(preferred_order(impl, a.device)):
            seen.append(int(torch._fused_sdp_choice(a, b, c, is_causal=True, enable_gqa=True)))
        return att(a, b, c, is_causal=True, enable_gqa=True)
    out = checkpoint(f, q, k, v, use_reentrant=False)
    out.float().sum().backward()
    print(impl, "order", preferred_order(impl, q.device), "torch default",
          torch._C._get_sdp_priority_order(), "choices", seen)
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cpu_unservable_backend_is_an_error_not_a_silent_switch():
    q, k, v = _qkv(1, 2, 2, 8, 16, torch.float32)
    with pytest.raises(RuntimeError):
        Attention("cudnn")(q, k, v, is_causal=True)
