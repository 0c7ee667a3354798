"""Shared by the packing tests: where each sample of `PackedRows.from_lengths`-style rows lies."""


def samples_of(rows):
    """(row, start, length) of every sample, rows given as lists of sample lengths."""
    out = []
    for r, lengths in enumerate(rows):
        off = 0
        for n in lengths:
            out.append((r, off, n))
            off += n
    return out
