from longmoe.tuning import default_chunks


def test_default_chunks_formula():
    assert default_chunks(1000) == 1
    assert default_chunks(16384) == 2
    assert default_chunks(65536) == 8
    assert default_chunks(1 << 20) == 8
