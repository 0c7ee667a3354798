"""Full rows (one sample per row of seq_len, longmoe.data.rows) are the same batches, bit for
bit, that `longmoe train` trained on without a token budget before they became a packing policy
of the one batch type: the digests below were taken from those batches (the demo's synthetic
data, and a JSONL file under data.overlong truncate and drop, shuffled), so the demo's and the
CLI's losses stay what they were."""

import hashlib
import json
import random

import pytest

from _rows import feed_rows
from longmoe.errors import UserError

FIELDS = ("input_ids", "labels", "advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")


def digest(batch) -> str:
    h = hashlib.sha256()
    for f in FIELDS:
        h.update(getattr(batch, f).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _rows():
    rng = random.Random(20261204)
    out = []
    for i in range(11):
        P, R = rng.randint(0 if i else 1, 12), rng.randint(1, 20)
        row = {"prompt": [rng.randrange(50) for _ in range(P)],
               "response": [rng.randrange(50) for _ in range(R)],
               "advantage": (round(rng.uniform(-2, 2), 3) if i % 2
                             else [round(rng.uniform(-2, 2), 3) for _ in range(R)])}
        if i % 3 == 0:
            row["old_logprobs"] = [round(-rng.uniform(0, 4), 3) for _ in range(R)]
        if i % 4 == 1:
            row["ref_logprobs"] = [round(-rng.uniform(0, 4), 3) for _ in range(R)]
        if i % 3 == 2:
            row["loss_mask"] = [int(rng.random() < 0.7) for _ in range(R)]
        if i == 4:   # longer than seq_len + 1
            row = {"prompt": [7] * 4, "response": [8] * 30, "advantage": 0.5}
        out.append(row)
    return out


@pytest.mark.parametrize("step,rank,want", [(0, 0, "6a9db261364c2846"), (0, 1, "26874502063a6039"),
                                            (7, 0, "97590e619f1c045c"), (7, 1, "3ba1b83576ed81b2")])
def test_demo_synthetic_rows_are_pinned(step, rank, want):
    # cpu_demo's data settings on its 2 data ranks
    data = dict(batch_size=32, seq_len=128, prompt_len=32, group_size=4)
    batch, _ = feed_rows(data, step, rank, 2, vocab=512, seed=0)
    assert not batch.packed and digest(batch) == want


@pytest.mark.parametrize("overlong,step,want", [
    ("truncate", 0, ("a7c4ee5f7f9fadc2", 2, 0)), ("truncate", 3, ("42bc611ec5de32cb", 3, 0)),
    ("drop", 0, ("dd0fa3046fa38586", 0, 0)), ("drop", 3, ("326e3ceec9e4f7e2", 0, 0))])
def test_jsonl_rows_are_pinned(tmp_path, overlong, step, want):
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    data = dict(source="jsonl", path=str(p), batch_size=6, seq_len=24, overlong=overlong,
                shuffle=True)
    batch, got = feed_rows(data, step, vocab=50, seed=3)
    assert (digest(batch), got.truncated, got.masked) == want


def test_jsonl_rows_are_streamed(tmp_path):
    # The rows way keeps an index, not the rows: a step reads its lines from the file, so a row
    # rewritten in place after opening (same lengths) is trained as it now is, and one whose
    # lengths changed is an error naming its line.
    from longmoe.data.rows import FittedFile
    p = tmp_path / "r.jsonl"
    rows = [{"prompt": [1, 2], "response": [3, 4, 5], "advantage": 0.5} for _ in range(4)]
    write = lambda: p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")  # noqa: E731
    write()
    data, other = FittedFile(p, 50, 8), FittedFile(p, 50, 8)
    assert data.source.index_nbytes() == 20 * len(rows)
    rows[0] = {"prompt": [9, 9], "response": [8, 8, 8], "advantage": 0.5}
    write()
    assert data.step_rows(0, 2, 0, 2, 0, False)[0].input_ids[0, :5].tolist() == [9, 9, 8, 8, 8]
    rows[1] = {"prompt": [9], "response": [8, 8, 8], "advantage": 0.5}
    write()
    with pytest.raises(UserError, match=f"^{p}:2: row changed since the file was opened"):
        other.step_rows(0, 2, 0, 2, 0, False)


def test_jsonl_has_no_nan_in_any_way(tmp_path):
    # An unchecked field holding NaN is refused when a file is opened, for the rows way and the
    # token-budget way alike (Python's json would read it).
    from longmoe.data.rows import FittedFile
    from longmoe.data.sources import JsonlSource
    from longmoe.data.validate import check_sample
    p = tmp_path / "r.jsonl"
    p.write_text('{"prompt": [1], "response": [2, 3], "advantage": 1, "reward": NaN}\n')
    for open_file in (lambda: FittedFile(p, 50, 8),
                      lambda: JsonlSource(p, lambda row, where: check_sample(row, where, 50))):
        with pytest.raises(UserError, match=f"^{p}:1: NaN is not valid JSON"):
            open_file()
