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
