"""RL policy-update batches as padded rows without a token budget (longmoe/train/feed.py's
"legacy" way; token-budget micro-batches and the Parquet source come from longmoe/data): prompt +
response token ids, a loss mask, advantages and the rollout policy's log-probs. Two sources, both
deterministic in (seed, rank, step) so a resumed run sees the same data as an uninterrupted one:

synthetic  GRPO groups on a learnable task: each response follows a hidden Markov rule
           (next = perm[prev]) with a per-response probability q, the reward is the fraction of
           rule-following tokens, advantages are group-normalised; responses fill the sequence.
           The rollout policy is uniform (log 1/V), which is what a freshly initialised policy
           produces, so importance ratios start near 1 and the clipped surrogate falls as the
           policy learns the rule.
jsonl      one object per line: {"prompt": [ids], "response": [ids], "advantage": float or
           [per response token], "old_logprobs": [per response token] (optional; missing means
           on-policy), "ref_logprobs" and "rollout_logprobs": [per response token] (optional;
           required when loss.kl_coef / loss.tis_cap use them), "loss_mask": [0/1 per
           response token] (optional)}.

A batch holds tensors [B, S]: input_ids, labels (next token; -100 where not trained), advantages,
old_logprobs (NaN where the rollout gave none: the trainer then uses the current policy's),
ref_logprobs and rollout_logprobs (NaN where not given), sample_tokens (per token, the trained
tokens of its whole sample, for the per-sample loss aggregation modes; one sample per row here),
and counts of its samples with no trained token and of those data.overlong truncated.

data.batch_size is the global batch: data rank r of W trains sequences [r*B/W, (r+1)*B/W) of the
step's B, whatever W is (sources key data by global sequence index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longmoe.data.order import step_indices
from longmoe.data.rule import rule_walk
from longmoe.data.validate import LOGPROB_FIELDS, fit, parse_sample, trained_tokens
from longmoe.errors import UserError
from longmoe.rl.objective import sample_token_counts
from longmoe.train.config import DataConfig

IGNORE = -100


@dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    masked: int = 0       # samples with no trained token (all-zero loss mask)
    truncated: int = 0    # samples whose response data.overlong=truncate cut
    ref_logprobs: torch.Tensor | None = None      # None: not given (all NaN)
    rollout_logprobs: torch.Tensor | None = None
    # None: one sample per row. Set before any split of a row (context parallel keeps it).
    sample_tokens: torch.Tensor | None = None

    TOKEN_FIELDS = ("input_ids", "labels", "advantages", "old_logprobs", "ref_logprobs",
                    "rollout_logprobs", "sample_tokens")

    def __post_init__(self):
        for f in ("ref_logprobs", "rollout_logprobs"):
            if getattr(self, f) is None:
                setattr(self, f, torch.full_like(self.advantages, float("nan")))
        if self.sample_tokens is None:
            rows = torch.arange(self.labels.shape[0], device=self.labels.device)
            self.sample_tokens = sample_token_counts(self.labels != IGNORE,
                                                     rows[:, None].expand_as(self.labels))

    def tokens(self) -> dict:
        """The per-token [B, S] tensors by field name."""
        return {f: getattr(self, f) for f in self.TOKEN_FIELDS}

    def with_tokens(self, fn) -> "Batch":
        """The same samples with `fn` applied to every per-token tensor."""
        return Batch(**{f: fn(t) for f, t in self.tokens().items()}, masked=self.masked,
                     truncated=self.truncated)

    def to(self, device) -> "Batch":
        return self.with_tokens(lambda t: t.to(device))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        return Batch(**{f: torch.cat([getattr(b, f) for b in batches]) for f in Batch.TOKEN_FIELDS},
                     masked=sum(b.masked for b in batches),
                     truncated=sum(b.truncated for b in batches))


def _pack(samples: list[dict], seq_len: int, truncated: int = 0) -> Batch:
    """Samples must fit (longmoe.data.validate.fit): nothing is cut here."""
    B = len(samples)
    ids = torch.zeros(B, seq_len, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE, dtype=torch.long)
    adv = torch.zeros(B, seq_len)
    logps = {k: torch.full((B, seq_len), float("nan")) for k in LOGPROB_FIELDS}
    for b, s in enumerate(samples):
        if len(s["prompt"]) + len(s["response"]) > seq_len + 1:
            raise ValueError(f"sample {b} has {len(s['prompt']) + len(s['response'])} tokens, "
                             f"more than seq_len + 1 = {seq_len + 1}")
        p = torch.as_tensor(s["prompt"], dtype=torch.long)
        r = torch.as_tensor(s["response"], dtype=torch.long)
        toks = torch.cat([p, r])[:seq_len]  # the last token of a full sample is a label only
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
        for k in LOGPROB_FIELDS:
            if s.get(k) is not None:
                logps[k][b, t] = torch.as_tensor(s[k], dtype=torch.float32)[j]
    masked = int(((labels != IGNORE).sum(1) == 0).sum())
    return Batch(ids, labels, adv, logps["old_logprobs"], masked, truncated,
                 logps["ref_logprobs"], logps["rollout_logprobs"])


class SyntheticSource:
    def __init__(self, cfg: DataConfig, vocab_size: int, seed: int):
        self.cfg, self.vocab, self.seed = cfg, vocab_size, seed
        g = torch.Generator().manual_seed(seed)
        self.rule = torch.randperm(vocab_size, generator=g)

    def batch(self, step: int, rank: int, world: int) -> Batch:
        """Data rank `rank`'s share of the step's global batch. Each GRPO group is drawn from
        its own generator keyed by (seed, step, global group index), so the global batch is the
        same whatever the world size: a run resumed on other GPUs sees the data an
        uninterrupted run would have."""
        cfg, V, G = self.cfg, self.vocab, self.cfg.group_size
        n = cfg.per_rank(world)
        first = rank * n
        g0, g1 = first // G, (first + n - 1) // G + 1
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
        # The rollout engine, the trainer's rollout-time policy and the reference policy are
        # all the uniform initial policy.
        uniform = [-math.log(V)] * R
        samples = [{"prompt": prompts[i].tolist(), "response": resp[i].tolist(),
                    "advantage": float(adv.view(-1)[i]), "old_logprobs": uniform,
                    "ref_logprobs": uniform, "rollout_logprobs": uniform}
                   for i in range(lo, lo + n)]
        return _pack(samples, cfg.seq_len)


@dataclass
class JsonlData:
    """The rows as trained, in file order (after data.overlong), and what the policy did."""
    path: Path
    rows: list[dict]
    truncated: list[bool]                               # per row
    lines: list[int] = field(default_factory=list)      # line number of each row
    dropped: list[int] = field(default_factory=list)    # line numbers
    masked: list[int] = field(default_factory=list)     # line numbers of rows training nothing
    overlong: str = "error"

    def counts(self) -> dict:
        return {"data_rows": len(self.rows), "data_dropped": len(self.dropped),
                "data_truncated": sum(self.truncated), "data_masked": len(self.masked)}

    def describe(self) -> str:
        def lines(ls):
            return ", ".join(map(str, ls[:5])) + (", ..." if len(ls) > 5 else "")
        parts = [f"data: {len(self.rows)} rows from {self.path}"]
        cut = [ln for ln, t in zip(self.lines, self.truncated) if t]
        if self.dropped or cut:
            parts.append(f"data.overlong={self.overlong}: {len(self.dropped)} dropped"
                         + (f" (line {lines(self.dropped)})" if self.dropped else "")
                         + f", {len(cut)} truncated" + (f" (line {lines(cut)})" if cut else ""))
        if self.masked:
            parts.append(f"{len(self.masked)} with no trained token (loss_mask all 0; line "
                         f"{lines(self.masked)})")
        return "; ".join(parts)


def read_jsonl(path: str | Path, vocab_size: int, seq_len: int,
               overlong: str = "error", require: dict[str, str] | None = None) -> JsonlData:
    """Load and check every row (errors name the file, line and field), then fit each into
    seq_len under the data.overlong policy. `require`: log-prob fields the loss needs
    (LossConfig.required_logprobs), missing from a row is an error."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data.path: {path} does not exist")
    data = JsonlData(path, [], [], overlong=overlong)
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{ln}"
            row, status = fit(parse_sample(line, where, vocab_size, require), seq_len, overlong,
                              where)
            if row is None:
                data.dropped.append(ln)
                continue
            data.rows.append(row)
            data.lines.append(ln)
            data.truncated.append(status == "truncated")
            if trained_tokens(row, seq_len) == 0:
                data.masked.append(ln)
    if not data.rows:
        raise UserError(f"{path}: no rows" + (f" ({len(data.dropped)} dropped by "
                                              f"data.overlong=drop)" if data.dropped else ""))
    return data


class JsonlSource:
    def __init__(self, cfg: DataConfig, vocab_size: int, data: JsonlData | None = None,
                 require: dict[str, str] | None = None, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self.data = data or read_jsonl(cfg.path, vocab_size, cfg.seq_len, cfg.overlong, require)

    def batch(self, step: int, rank: int, world: int) -> Batch:
        """Rows in file order, wrapping around (data.shuffle: each epoch in its own permutation,
        longmoe.data.order): step s trains positions [s*B, (s+1)*B) of that sequence, data rank
        r its slice of them."""
        B, n, rows = self.cfg.batch_size, self.cfg.per_rank(world), self.data.rows
        order = step_indices(step, B, len(rows), self.seed, self.cfg.shuffle)
        picked = order[rank * n:(rank + 1) * n]
        return _pack([rows[i] for i in picked], self.cfg.seq_len,
                     truncated=sum(self.data.truncated[i] for i in picked))


def make_source(cfg: DataConfig, vocab_size: int, seed: int,
                require: dict[str, str] | None = None):
    """`require`: the log-prob fields the loss needs (the synthetic source has them all)."""
    if cfg.source == "jsonl":
        return JsonlSource(cfg, vocab_size, require=require, seed=seed)
    return SyntheticSource(cfg, vocab_size, seed)
