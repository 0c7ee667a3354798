"""RL policy-update batches: prompt + response token ids, a loss mask, advantages and the rollout
policy's log-probs. Two sources, both deterministic in (seed, rank, step) so a resumed run sees the
same data as an uninterrupted one:

synthetic  GRPO groups on a learnable task: each response follows a hidden Markov rule
           (next = perm[prev]) with a per-response probability q, the reward is the fraction of
           rule-following tokens, advantages are group-normalised; responses fill the sequence. The rollout policy is uniform
           (log 1/V), which is what a freshly initialised policy produces, so importance ratios
           start near 1 and the clipped surrogate falls as the policy learns the rule.
jsonl      one object per line: {"prompt": [ids], "response": [ids], "advantage": float or
           [per response token], "old_logprobs": [per response token] (optional; missing means
           on-policy), "loss_mask": [0/1 per response token] (optional)}.

A batch holds tensors [B, S]: input_ids, labels (next token; -100 where not trained), advantages,
old_logprobs (NaN where the rollout gave none: the trainer then uses the current policy's).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from longmoe.errors import UserError
from longmoe.train.config import DataConfig

IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids, self.labels, self.advantages,
                                                 self.old_logprobs)))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        return Batch(*(torch.cat([getattr(b, f) for b in batches]) for f in
                       ("input_ids", "labels", "advantages", "old_logprobs")))


def _pack(samples: list[dict], seq_len: int) -> Batch:
    B = len(samples)
    ids = torch.zeros(B, seq_len, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE, dtype=torch.long)
    adv = torch.zeros(B, seq_len)
    old = torch.full((B, seq_len), float("nan"))
    for b, s in enumerate(samples):
        p = torch.as_tensor(s["prompt"], dtype=torch.long)
        r = torch.as_tensor(s["response"], dtype=torch.long)
        toks = torch.cat([p, r])[:seq_len]
        ids[b, : toks.numel()] = toks
        # Position t predicts token t+1; response token j sits at len(p)+j, so it is the label
        # of position len(p)+j-1, which must lie inside the sequence.
        P = p.numel()
        j = torch.arange(max(0, 1 - P), min(r.numel(), seq_len + 1 - P))
        if s.get("loss_mask") is not None:
            j = j[torch.as_tensor(s["loss_mask"], dtype=torch.bool)[j]]
        t = P + j - 1
        labels[b, t] = r[j]
        a = s["advantage"]
        adv[b, t] = torch.as_tensor(a, dtype=torch.float32)[j] if isinstance(a, list) else float(a)
        if s.get("old_logprobs") is not None:
            old[b, t] = torch.as_tensor(s["old_logprobs"], dtype=torch.float32)[j]
    return Batch(ids, labels, adv, old)


def rule_walk(rule, start, follow, noise):
    """The responses' hidden-rule walk, without a loop over positions: token j is noise[j] where
    follow[j] is False, else rule applied to token j-1. Equivalently rule^d(anchor), with anchor
    the last noise token at or before j (or `start`) and d the follow steps since; rule^d comes
    from binary powers of the permutation (log2 R gathers instead of R sequential steps)."""
    N, R = follow.shape
    pos = torch.arange(R).expand(N, R)
    last = torch.cummax(torch.where(follow, -1, pos), dim=1).values    # last noise position
    val = torch.where(last >= 0, noise.gather(1, last.clamp(min=0)), start[:, None])
    d = torch.where(last >= 0, pos - last, pos + 1)
    power = rule
    for bit in range(max(1, int(R).bit_length())):
        take = (d >> bit) & 1 == 1
        if take.any():
            val = torch.where(take, power[val], val)
        power = power[power]
    return val


class SyntheticSource:
    def __init__(self, cfg: DataConfig, vocab_size: int, seed: int):
        self.cfg, self.vocab, self.seed = cfg, vocab_size, seed
        g = torch.Generator().manual_seed(seed)
        self.rule = torch.randperm(vocab_size, generator=g)

    def batch(self, step: int, rank: int, world: int) -> Batch:
        """This rank's `batch_size` sequences of the step's global batch. Each GRPO group is
        drawn from its own generator keyed by (seed, step, global group index), so the global
        batch is the same whatever the world size: a run resumed on other GPUs sees the data an
        uninterrupted run would have."""
        cfg, V, G = self.cfg, self.vocab, self.cfg.group_size
        first = rank * cfg.batch_size
        g0, g1 = first // G, (first + cfg.batch_size - 1) // G + 1
        P, R = cfg.prompt_len, cfg.seq_len - cfg.prompt_len + 1  # R: longest labelled response
        prompts, q, follow, noise = [], [], [], []
        for grp in range(g0, g1):
            g = torch.Generator().manual_seed(self.seed * 7919 + step * 104729 + grp * 15485863)
            prompts.append(torch.randint(0, V, (1, P), generator=g).expand(G, P))
            qg = torch.rand(G, generator=g)
            q.append(qg)
            follow.append(torch.rand(G, R, generator=g) < qg[:, None])
            noise.append(torch.randint(0, V, (G, R), generator=g))
        prompts, follow, noise = torch.cat(prompts), torch.cat(follow), torch.cat(noise)
        resp = rule_walk(self.rule, prompts[:, -1], follow, noise)
        # Equal lengths make a group's token-weighted advantages sum to zero, so the surrogate
        # starts at exactly 0 (ratio 1) and every later fall is learning, not length noise.
        rg = follow.float().mean(1).view(-1, G)
        adv = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, unbiased=False, keepdim=True) + 1e-4))
        lo = first - g0 * G
        samples = [{"prompt": prompts[i].tolist(), "response": resp[i].tolist(),
                    "advantage": float(adv.view(-1)[i]), "old_logprobs": [-math.log(V)] * R}
                   for i in range(lo, lo + cfg.batch_size)]
        return _pack(samples, cfg.seq_len)


def read_jsonl(path: str | Path, vocab_size: int) -> list[dict]:
    """Load and validate every row; errors name the line and field."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data.path: {path} does not exist")
    rows = []
    for ln, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{ln}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object")
        for key in ("prompt", "response", "advantage"):
            if key not in row:
                raise UserError(f"{where}: missing field {key!r}")
        for key in ("prompt", "response"):
            ids = row[key]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in ids):
                raise UserError(f"{where}: {key} must be a list of integer token ids")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise UserError(f"{where}: {key} token id {bad[0]} is outside [0, {vocab_size})")
        if not row["response"]:
            raise UserError(f"{where}: response is empty")
        n = len(row["response"])
        for key in ("old_logprobs", "loss_mask"):
            if row.get(key) is not None and (not isinstance(row[key], list) or len(row[key]) != n):
                raise UserError(f"{where}: {key} must be a list of {n} values (one per response token)")
        a = row["advantage"]
        if isinstance(a, list):
            if len(a) != n:
                raise UserError(f"{where}: advantage list has {len(a)} values, response has {n}")
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            raise UserError(f"{where}: advantage must be a number or a list of numbers")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows


class JsonlSource:
    def __init__(self, cfg: DataConfig, vocab_size: int, rows: list[dict] | None = None):
        self.cfg = cfg
        self.rows = rows if rows is not None else read_jsonl(cfg.path, vocab_size)

    def batch(self, step: int, rank: int, world: int) -> Batch:
        B = self.cfg.batch_size
        first = (step * world + rank) * B
        picked = [self.rows[(first + i) % len(self.rows)] for i in range(B)]
        return _pack(picked, self.cfg.seq_len)


def make_source(cfg: DataConfig, vocab_size: int, seed: int):
    if cfg.source == "jsonl":
        return JsonlSource(cfg, vocab_size)
    return SyntheticSource(cfg, vocab_size, seed)
