"""Zigzag split bookkeeping (the distributed attention itself is checked end to end in
test_equivalence.py against world size 1)."""

import pytest
import torch

from longmoe.parallel.context_parallel import split_sequence, zigzag_positions


@pytest.mark.parametrize("S,cp", [(8, 1), (16, 2), (24, 4), (48, 3)])
def test_zigzag_covers_the_sequence_once_and_balances_work(S, cp):
    parts = [zigzag_positions(S, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(S))
    # Causal work of a token ~ its position + 1: every rank gets the same total.
    work = [int((p + 1).sum()) for p in parts]
    assert len(set(work)) == 1
    P = S // (2 * cp)
    assert parts[0][:P].tolist() == list(range(P)) and parts[0][P:].tolist() == list(range(S - P, S))


def test_split_sequence_keeps_labels_aligned():
    ids = torch.arange(32).view(2, 16)
    labels = ids + 1  # next-token labels, built before the split
    pos = zigzag_positions(16, 2, 1)
    a, b = split_sequence(ids, pos), split_sequence(labels, pos)
    assert torch.equal(b, a + 1) and torch.equal(a[0], pos)


def test_bad_lengths():
    with pytest.raises(ValueError, match="2\\*cp=4"):
        zigzag_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_packing_follows_the_zigzag_split(cp):
    from longmoe.model.packing import PackedRows
    from longmoe.parallel.context_parallel import local_packing
    p = PackedRows.from_lengths([[6, 1, 17, 12, 7], [48]], 48)
    seen = torch.zeros(2, 48, dtype=torch.long)
    for r in range(cp):
        share = local_packing(p, cp, r)
        if cp == 1:
            assert share is p
            continue
        pos = zigzag_positions(48, cp, r)
        assert share.whole is p
        for name in ("sample_ids", "positions", "starts", "history"):
            assert torch.equal(getattr(share, name), split_sequence(getattr(p, name), pos)), name
        seen[:, pos] += 1
        # A piece begins mid-sample unless a sample starts right there.
        P = 48 // (2 * cp)
        assert share.starts[0, P].item() == bool(p.starts[0, pos[P]])
    assert cp == 1 or (seen == 1).all()
