"""`longmoe bench moe-layer` times its arms (unpipelined, each chunk count, the megatron-core
baseline) in the same rounds, the order rotating, so they run under the same clocks."""

from longmoe.backends import get_backend
from longmoe.bench.moe_layer import _timed_rounds


def test_rounds_time_each_arm_once_per_round_in_rotating_order():
    order = []
    fns = [lambda i=i: order.append(i) for i in range(3)]
    out = _timed_rounds(get_backend("cpu"), fns, iters=4, warmup=2)
    assert order[:6] == [0, 0, 1, 1, 2, 2]  # warm-ups
    assert order[6:] == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    assert len(out) == 3 and all(ms >= 0 and peak >= 0 for ms, peak in out)
