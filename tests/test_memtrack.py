"""The CPU peak-memory counter: views are not counted twice, a storage stays counted while any
view of it lives, memory from before the mode is not counted, and a storage freed and then
replaced at the same address is counted again."""

import torch

from longmoe.paired.memtrack import TensorBytes


def test_views_keep_their_storage_counted():
    with TensorBytes() as m:
        a = torch.empty(1024)  # 4 KiB
        v = a.detach()[3:].view(-1, 1)
        del a  # the storage lives on in the view
        b = torch.empty(512)  # 2 KiB beside it
        assert m.live == 4096 + 2048
        del v, b
        assert m.live == 0
    assert m.peak == 4096 + 2048


def test_memory_from_before_is_not_counted():
    w = torch.randn(256, 256)
    with TensorBytes() as m:
        t = w.t()[1:]
        w.mul_(2)
        y = w.sum(0)
    assert m.peak == y.untyped_storage().nbytes() and t.shape == (255, 256)


def test_a_new_storage_is_counted_at_a_reused_address():
    with TensorBytes() as m:
        peaks = []
        for _ in range(50):  # the allocator hands the same address back again and again
            a = torch.empty(4096)
            b = a.detach()
            del a  # the first storage lives on in b
            c = torch.empty(4096)
            peaks.append(m.live)
            del b, c
    assert peaks == [2 * 4096 * 4] * 50 and m.peak == 2 * 4096 * 4
