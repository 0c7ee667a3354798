"""Grouped GEMM: out[rows of group g] = x[rows of group g] @ w[g].

Legend: M rows (tokens grouped by expert, contiguous), K in features, N out features, G groups.

Implementations (registry "grouped_mm"):
  reference  one matmul per non-empty group; runs everywhere.
  torch      torch._grouped_mm (one kernel for all groups) where the backend supports it.
  triton     a portable Triton grouped GEMM (ops/kernels/grouped_gemm.py): the path where
             _grouped_mm is unavailable (builds without it); tiles per vendor from backends.
"""

from __future__ import annotations

import torch

from longmoe.ops.registry import Registry

GROUPED_MM = Registry("grouped_mm", renamed={"loop": "reference"})


def _torch_check(x_MK, w_GKN, sizes):
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no _grouped_mm"
    if x_MK.device.type == "cpu":
        return "torch._grouped_mm needs an accelerator"
    from longmoe.backends import active_backend
    if not active_backend().supports_grouped_mm(x_MK.dtype):
        return f"backend {active_backend().name} does not support _grouped_mm for {x_MK.dtype}"
    if x_MK.shape[1] % 16 or w_GKN.shape[2] % 16:
        return "K and N must be multiples of 16"
    return None


@GROUPED_MM.register("torch", priority=10, check=_torch_check)
def _torch_grouped(x_MK, w_GKN, sizes, offs=None):
    return torch._grouped_mm(x_MK, w_GKN, offs=_offs(sizes, x_MK.device) if offs is None else offs)


def _triton_check(x_MK, w_GKN, sizes):
    from longmoe.ops.kernels import triton_ready
    if x_MK.device.type != "cpu" and x_MK.element_size() > 2:
        # Its tiles are sized for 2-byte inputs (fp32 needs twice the shared memory: the largest
        # shipped tile asked for 288 KiB) and fp32 dots would round through tf32: the reference keeps
        # fp32 exact.
        return f"the Triton grouped GEMM takes 2-byte inputs on a GPU, not {x_MK.dtype}"
    return triton_ready(x_MK.device)


@GROUPED_MM.register("triton", priority=5, check=_triton_check)
def _triton_grouped(x_MK, w_GKN, sizes, offs=None):
    from longmoe.backends import active_backend
    from longmoe.ops.kernels.grouped_gemm import GroupedMM
    sizes = host_sizes(offs) if sizes is None else sizes
    # Few rows per expert (fine-grained MoE, short chunks) wants smaller M tiles.
    bucket = "m<=256" if sum(sizes) <= 256 * max(1, len(sizes)) else None
    return GroupedMM.apply(x_MK, w_GKN, list(sizes), active_backend().kernel_config("grouped_gemm", bucket))


@GROUPED_MM.register("reference", priority=0, reference=True)
def _reference(x_MK, w_GKN, sizes, offs=None):
    sizes = host_sizes(offs) if sizes is None else sizes
    outs, s = [], 0
    for g, n in enumerate(sizes):
        if n:
            outs.append(x_MK[s:s + n] @ w_GKN[g])
        s += n
    if not outs:
        # Zero rows: still return something computed *from x*, so autograd runs the backward
        # collectives upstream of it (an expert-parallel rank that received no tokens must
        # still join the backward all-to-all its peers run).
        return x_MK @ w_GKN[0]
    return torch.cat(outs)


def grouped_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, sizes: list[int] | None,
               offs: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """`sizes`: rows of each group (a host list); or None with `offs` alone, the int32 end row of
    each group on the device, whose last entry must be x's row count (it is not read back to
    check): the torch implementation then runs without a host synchronisation, the others read
    the sizes from `offs`."""
    if sizes is None:
        if offs is None or offs.shape != (w_GKN.shape[0],):
            raise ValueError(f"grouped_mm: without sizes, offs must hold one end row per group "
                             f"({w_GKN.shape[0]}), got "
                             f"{None if offs is None else tuple(offs.shape)}")
        return GROUPED_MM.select(impl, x_MK, w_GKN, sizes).fn(x_MK, w_GKN, sizes, offs)
    if sum(sizes) != x_MK.shape[0] or len(sizes) != w_GKN.shape[0]:
        raise ValueError(f"grouped_mm: sizes (sum {sum(sizes)}, {len(sizes)} groups) do not match "
                         f"x{tuple(x_MK.shape)} and w{tuple(w_GKN.shape)}")
    return GROUPED_MM.select(impl, x_MK, w_GKN, sizes).fn(x_MK, w_GKN, sizes, offs)


# ---- weight gradient without autograd (for schedules that order dgrad and wgrad themselves) ----

def host_sizes(offs: torch.Tensor) -> list[int]:
    """Rows of each group from the device's end rows (one host read)."""
    return torch.diff(offs, prepend=offs.new_zeros(1)).tolist()


def _offs(sizes, device):
    return torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)


def _wgrad_torch(x_MK, dy_MN, sizes, offs=None):
    offs = _offs(sizes, x_MK.device) if offs is None else offs
    out = torch._grouped_mm(x_MK.t(), dy_MN, offs=offs)
    # Groups without rows: make them exact zeros whatever the kernel leaves there (a mask built
    # on the device from the offsets: a host index list would cost a stream synchronisation).
    if 0 in sizes:
        rows = torch.diff(offs, prepend=offs.new_zeros(1))
        out.masked_fill_((rows == 0)[:, None, None], 0)
    return out


def _wgrad_triton(x_MK, dy_MN, sizes, offs=None):
    from longmoe.backends import active_backend
    from longmoe.ops.kernels.grouped_gemm import grouped_dw
    return grouped_dw(x_MK, dy_MN, list(sizes), active_backend().kernel_config("grouped_gemm"))


def _wgrad_reference(x_MK, dy_MN, sizes, offs=None):
    out = x_MK.new_zeros((len(sizes), x_MK.shape[1], dy_MN.shape[1]))
    s = 0
    for g, n in enumerate(sizes):
        if n:
            out[g] = x_MK[s:s + n].t() @ dy_MN[s:s + n]
        s += n
    return out


_WGRAD = {"torch": _wgrad_torch, "triton": _wgrad_triton, "reference": _wgrad_reference}


def grouped_mm_wgrad(x_MK: torch.Tensor, dy_MN: torch.Tensor, sizes: list[int],
                     w_GKN: torch.Tensor, impl: str = "auto",
                     offs: torch.Tensor | None = None) -> torch.Tensor:
    """dW[g] = x_g^T @ dy_g: the weight gradient of grouped_mm(x, w, sizes), computed by the same
    implementation the forward would pick for w (`impl`), in w's dtype."""
    return wgrad_fn(impl, x_MK, w_GKN, sizes)(x_MK, dy_MN, sizes, w_GKN, offs)


def wgrad_fn(impl: str, x_MK: torch.Tensor, w_GKN: torch.Tensor, sizes: list[int]):
    """grouped_mm_wgrad with the implementation chosen once, for a schedule that calls it per
    chunk on operands of the same kind (the choice depends on device, dtype and widths only)."""
    fn = _WGRAD[GROUPED_MM.select(impl, x_MK, w_GKN, sizes).name]

    def run(x, dy, sizes, w, offs=None):
        if x.shape[0] == 0:
            return w.new_zeros(w.shape)
        return fn(x, dy, sizes, offs).to(w.dtype)
    return run
