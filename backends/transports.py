"""All-to-all transports for expert dispatch/combine, chosen by the collective adapter.

  process_group     torch.distributed.all_to_all_single on the group's backend (NCCL, RCCL, gloo).
                    Runs kernels that occupy compute units while they move data.
  symmetric_memory  within one node: every rank copies the rows it sends straight into its peers'
                    symmetric-memory receive buffers (peer-to-peer copies, run by copy engines,
                    no compute units), between two group barriers; no multicast. Needs the full
                    send matrix, which the route plan already holds on every rank.

Both fill a preallocated `out` on the current stream; the caller picks that stream.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class ProcessGroupA2A:
    name = "process_group"

    def __call__(self, out, inp, out_splits, in_splits, group, matrix=None):
        if group is None and not dist.is_initialized():
            out.copy_(inp)  # one process and no group: the all-to-all of one rank is a copy
            return
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)


def symmetric_memory_unavailable(device: torch.device) -> str | None:
    """Why the symmetric-memory transport cannot run here, or None."""
    if device.type == "cpu":
        return "symmetric memory needs GPU peer access; this is a CPU device"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"torch.distributed._symmetric_memory unavailable: {type(e).__name__}: {e}"
    return None


class SymmetricMemoryA2A:
    """Push all-to-all through one symmetric receive buffer per process group.

    Layout of rank d's buffer: the rows from source 0, then source 1, ... (source order, as the
    output wants them). Sequence per call, all on the current stream:
      barrier  -> every peer has finished reading its buffer from the previous call;
      copies   -> rows for peer p go to p's buffer at offset sum(matrix[s][p] for s < me);
      barrier  -> every write into my buffer has landed;
      copy-out -> my buffer into `out` (the local rows are copied directly).
    The buffer grows when a call needs more; all ranks see the same matrix, so they grow together
    (symmetric allocation is collective)."""

    name = "symmetric_memory"

    def __init__(self):
        self._bufs: dict[str, tuple[torch.Tensor, object, int]] = {}
        # Outgrown buffers stay alive: copies queued on the stream may still read them, and a
        # symmetric allocation is not stream-ordered like the caching allocator's blocks.
        self._retired: list = []

    def _buffer(self, group, nbytes: int, device):
        from torch.distributed import _symmetric_memory as symm
        key = group.group_name
        cur = self._bufs.get(key)
        if cur is None or cur[2] < nbytes:
            cap = max(nbytes, 2 * cur[2] if cur else 0)
            cap = (cap + 4095) // 4096 * 4096
            if hasattr(symm, "enable_symm_mem_for_group"):
                symm.enable_symm_mem_for_group(key)
            buf = symm.empty(cap, dtype=torch.uint8, device=device)
            if cur is not None:
                self._retired.append(cur)
            cur = (buf, symm.rendezvous(buf, group), cap)
            self._bufs[key] = cur
        return cur

    def __call__(self, out, inp, out_splits, in_splits, group, matrix=None):
        if matrix is None:
            raise ValueError("symmetric_memory all-to-all needs the full send matrix")
        S, me = len(matrix), dist.get_rank(group)
        row_shape = tuple(out.shape[1:])
        row, esize = math.prod(row_shape), out.element_size()
        need = max(sum(matrix[s][d] for s in range(S)) for d in range(S)) * row * esize
        buf, handle, _ = self._buffer(group, max(need, esize), out.device)
        pushes, local, pulls = push_plan(matrix, me)
        handle.barrier(channel=0)
        for peer, src, n, dst in pushes:
            remote = handle.get_buffer(peer, (n,) + row_shape, out.dtype, dst * row)
            remote.copy_(inp[src:src + n])
        if local:
            src, n, dst = local
            out[dst:dst + n].copy_(inp[src:src + n])
        handle.barrier(channel=0)
        mine = buf[: out.shape[0] * row * esize].view(out.dtype).view((-1,) + row_shape)
        for lo, hi in pulls:
            out[lo:hi].copy_(mine[lo:hi])


def push_plan(matrix: list[list[int]], me: int):
    """Copies for rank `me` in a push all-to-all where rank d's receive buffer holds the rows of
    source 0, then source 1, ... (matrix[s][d] rows each), exactly the output's order.

    Returns (pushes, local, pulls): pushes = [(peer, first input row, rows, first row in the
    peer's buffer)], starting at a different peer on each rank; local = (first input row, rows,
    first output row) for the rows kept here, or None; pulls = [(lo, hi)] output row ranges to
    copy from this rank's own buffer (everything but the local rows)."""
    S = len(matrix)
    send_off = [sum(matrix[me][:p]) for p in range(S)]
    pushes = []
    for i in range(1, S):
        p = (me + i) % S
        if matrix[me][p]:
            pushes.append((p, send_off[p], matrix[me][p], sum(matrix[s][p] for s in range(me))))
    recv_lo = sum(matrix[s][me] for s in range(me))
    n_me, total = matrix[me][me], sum(matrix[s][me] for s in range(S))
    local = (send_off[me], n_me, recv_lo) if n_me else None
    pulls = [(lo, hi) for lo, hi in ((0, recv_lo), (recv_lo + n_me, total)) if hi > lo]
    return pushes, local, pulls
