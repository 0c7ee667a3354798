"""Writes tests/data/ckpt_v1/: checkpoints in the on-disk format `longmoe-checkpoint-1`, which
tests/test_checkpoint_compat.py loads to show that checkpoints written by an earlier longmoe still
resume. Run from the repository root (about 30 s on 2 cores):

    python tests/data/make_ckpt_fixture.py

It replaces tests/data/ckpt_v1/ with:

- `cli/ck/`: what `longmoe train --checkpoint-dir ck` writes on 2 gloo ranks in cpu_demo's layout
  (EP 2 x FSDP2, full recompute, 2 EP chunks) with a shrunk model (one attention + MoE layer,
  hidden 16, 4 experts) after 2 steps: `latest` and `step-00000002/` (two DCP shards and their
  `.metadata`, rng-rank0.pt, rng-rank1.pt, meta.json, manifest.json).
- `api/ck/`: what `PolicyTrainer.save(dir)` writes in one process after 2 optimizer steps on a
  shrunk hybrid model (one Gated DeltaNet layer, one attention layer, MoE in both).
- `expected.json`: how each was made (the CLI's arguments, the API's run config and the samples
  of each step, as JSON rows) and what the saving longmoe computed after loading it: the CLI's
  loss and gradient norm of steps 3 and 4 after `--resume` (same layout), the API's
  forward_backward loss, optim_step gradient norm and next loss after `load`.

The runs use fp32 on the CPU, one intra-op thread, fixed seeds; each resume is run twice and must
agree bit for bit, else the script fails. Nothing machine-specific is kept: checkpoint paths are
relative (DCP records the directory it saved to in `.metadata`), the `.lock` files are left out,
and the manifests' `written_by` (host, pid, time: informational, no check reads it) is replaced by
fixed values.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "ckpt_v1"
ENV = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
WRITTEN_BY = {"host": "localhost", "pid": 0, "time": "2026-01-01T00:00:00+0000"}

# The CLI run: cpu_demo's layout, a model small enough that the checkpoint is a few hundred KB.
# lr 0.02 makes an update move the next loss well past rounding, so a resume that lost the AdamW
# moments or the schedule shows in step 4's loss.
CLI_ARGS = ["--config", "cpu_demo", "--set", "model.num_layers=1", "--set", "model.hidden_size=16",
            "--set", "model.num_heads=2", "--set", "model.num_kv_heads=1",
            "--set", "model.head_dim=8", "--set", "model.vocab_size=128",
            "--set", "model.num_experts=4", "--set", "model.moe_ffn_size=8",
            "--set", "model.shared_expert_ffn_size=16", "--set", "data.batch_size=8",
            "--set", "data.seq_len=32", "--set", "data.prompt_len=8",
            "--set", "optim.lr=0.02", "--set", "optim.warmup_steps=4"]
CLI_SAVED, CLI_RESUMED = 2, 4

API_RUN = {
    "model": {"vocab_size": 64, "hidden_size": 16, "num_layers": 2, "num_heads": 2,
              "num_kv_heads": 1, "head_dim": 8, "partial_rotary_factor": 0.5,
              "attn_output_gate": True, "num_experts": 4, "top_k": 2, "moe_ffn_size": 8,
              "shared_expert_ffn_size": 16, "max_seq_len": 256,
              "layer_types": ["linear_attention", "full_attention"],
              "linear_num_key_heads": 1, "linear_num_value_heads": 2,
              "linear_key_head_dim": 8, "linear_value_head_dim": 8,
              "router_aux_loss_coef": 0.001, "init_std": 0.1},
    "parallel": {"ep": 1, "fsdp": False, "chunks": 1},
    "impl": {"linear_ce": "chunked", "ce_chunk_tokens": 16, "gated_delta": "chunked"},
    "data": {"max_tokens_per_micro_batch": 40},
    "loss": {"kl_coef": 0.1, "tis_cap": 1.5, "entropy_coef": 0.01},
    "optim": {"lr": 0.02, "warmup_steps": 3},
    "train": {"seed": 3, "device": "cpu"}}


def sample_rows(seed: int, n: int, vocab: int, first: int) -> list[dict]:
    """RL samples as JSON rows (Sample fields), near the model's start log-probs (-log V)."""
    import math

    import torch
    g = torch.Generator().manual_seed(seed)
    base = -math.log(vocab)
    rows = []
    for i in range(n):
        P, R = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 12, (1,),
                                                                               generator=g))
        old = (base + 0.2 * torch.randn(R, generator=g)).clamp(max=0.0)
        row = {"prompt": torch.randint(0, vocab, (P,), generator=g).tolist(),
               "response": torch.randint(0, vocab, (R,), generator=g).tolist(),
               "advantage": (torch.randn(R, generator=g).tolist() if i % 3 == 2
                             else float(torch.randn(1, generator=g))),
               "old_logprobs": old.tolist(),
               "ref_logprobs": (base + 0.3 * torch.randn(R, generator=g)).clamp(max=0).tolist(),
               "rollout_logprobs": (old + 0.1 * torch.randn(R, generator=g)).clamp(max=0).tolist(),
               "index": first + i}
        if i == 1:
            row["loss_mask"] = [int(b) for b in (torch.rand(R, generator=g) > 0.3).tolist()]
        rows.append(row)
    return rows


def samples(rows: list[dict]):
    """The rows as longmoe.data.sample.Sample (the public constructor)."""
    import torch

    from longmoe.data.sample import Sample

    def f(v):
        return None if v is None else torch.tensor(v, dtype=torch.float32)
    return [Sample(torch.tensor(r["prompt"], dtype=torch.long),
                   torch.tensor(r["response"], dtype=torch.long),
                   f(r["advantage"]) if isinstance(r["advantage"], list) else r["advantage"],
                   old_logprobs=f(r["old_logprobs"]), ref_logprobs=f(r["ref_logprobs"]),
                   rollout_logprobs=f(r["rollout_logprobs"]),
                   loss_mask=None if "loss_mask" not in r else torch.tensor(r["loss_mask"]).bool(),
                   index=r["index"], where=f"sample {r['index']}")
            for r in rows]


def api_batches() -> list[list[dict]]:
    """Steps 1-2 (saved), then the batch of step 3 and of step 4 (after load)."""
    vocab = API_RUN["model"]["vocab_size"]
    return [sample_rows(10 + k, 5, vocab, first=10 * k) for k in range(4)]


def longmoe(*args: str, cwd: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "longmoe", *args], cwd=cwd, env=ENV,
                       capture_output=True, text=True, timeout=600)
    if p.returncode:
        sys.exit(f"longmoe {' '.join(args)} failed:\n{p.stderr[-3000:]}")


def tidy(ckpt: Path):
    """Leave out the lock file and make `written_by` machine-independent."""
    (ckpt / ".lock").unlink(missing_ok=True)
    for manifest in ckpt.glob("step-*/manifest.json"):
        body = json.loads(manifest.read_text())
        body["written_by"] = WRITTEN_BY
        manifest.write_text(json.dumps(body, indent=1))


def cli_resume(src: Path) -> list[dict]:
    """Steps 3 and 4 of `longmoe train --resume` from a copy of `src` (a checkpoint dir)."""
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(src, Path(d) / "ck")
        longmoe("train", *CLI_ARGS, "--steps", str(CLI_RESUMED), "--checkpoint-dir", "ck",
                "--resume", "--metrics-out", "m.jsonl", cwd=Path(d))
        rows = [json.loads(ln) for ln in (Path(d) / "m.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "loss", "grad_norm", "lr")} for r in rows]


def write_cli() -> dict:
    work = OUT / "cli"
    work.mkdir(parents=True)
    longmoe("train", *CLI_ARGS, "--steps", str(CLI_SAVED), "--checkpoint-dir", "ck", cwd=work)
    tidy(work / "ck")
    first, second = cli_resume(work / "ck"), cli_resume(work / "ck")
    if first != second:
        sys.exit(f"the CLI resume is not deterministic: {first} vs {second}")
    return {"args": CLI_ARGS, "saved_step": CLI_SAVED, "steps": CLI_RESUMED, "resumed": first}


def api_after_load(ckpt: Path, batches) -> dict:
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    pt = PolicyTrainer(from_dict(API_RUN))
    pt.load(ckpt)
    stats = pt.forward_backward(samples(batches[2]))
    info = pt.optim_step()
    nxt = pt.forward_backward(samples(batches[3]))
    pt.close()
    return {"step": pt.step, "loss": stats["loss"], "grad_norm": info["grad_norm"],
            "lr": info["lr"], "next_loss": nxt["loss"]}


def write_api() -> dict:
    import torch

    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    torch.set_num_threads(1)
    work = OUT / "api"
    work.mkdir(parents=True)
    batches = api_batches()
    pt = PolicyTrainer(from_dict(API_RUN))
    for rows in batches[:2]:
        pt.forward_backward(samples(rows))
        pt.optim_step()
    cwd = os.getcwd()
    os.chdir(work)  # a relative path: DCP records the directory it saved to
    try:
        pt.save("ck")
    finally:
        os.chdir(cwd)
    pt.close()
    tidy(work / "ck")
    first, second = api_after_load(work / "ck", batches), api_after_load(work / "ck", batches)
    if first != second:
        sys.exit(f"the API load is not deterministic: {first} vs {second}")
    return {"run": API_RUN, "batches": batches, "saved_step": 2, "after_load": first}


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    expected = {"format": "longmoe-checkpoint-1", "written_at_commit": commit,
                "cli": write_cli(), "api": write_api()}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.relative_to(ROOT)}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
