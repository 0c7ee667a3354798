"""The learnable synthetic task as a sample source with per-sample response lengths.

GRPO groups of `group_size` responses to one prompt. Each response follows a hidden Markov rule
(next = perm[prev], perm fixed by the seed) with its own probability q, else takes a uniform
noise token; its reward is the fraction of rule-following tokens and its advantage the
group-normalised reward (token-weighted: see _group_rewards). The rollout policy is uniform
(log 1/V), what a freshly initialised policy gives, so importance ratios start near 1 and the
clipped surrogate falls as the policy learns the rule. Response lengths come from a distribution
(longmoe.data.lengths), so packed micro-batches can be trained on realistic length mixes with a
loss that still falls.

Every draw comes from a generator keyed by (seed, kind, sample or group), never from a running
stream: sample i is the same whichever samples were drawn before it, on whichever rank, however
many ranks there are. The source is endless (no epochs) unless given a pool size.

Full rows (`data.response_len` unset, no token budget): every response has seq_len - prompt_len
+ 1 tokens, so prompt + response fill a row of seq_len positions (the last response token is
only a label). Those are drawn a GRPO group at a time, from a generator keyed by (seed, step,
group within the step), where step = i // batch_size: one [group_size, R] block per group,
advantages normalised over the group.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

import torch

from longmoe.data.lengths import LengthDist, parse_length
from longmoe.data.order import mix
from longmoe.data.sample import Sample
from longmoe.errors import ConfigError

# Stream tags: each kind of draw has its own key, so adding one never shifts another.
_RESPONSE_LEN, _PROMPT_IDS, _FOLLOW = range(11, 14)


def rule_walk(rule, start, follow, noise):
    """The responses' hidden-rule walk, without a loop over positions: token j is noise[j] where
    follow[j] is False, else rule applied to token j-1. Equivalently rule^d(anchor), with anchor
    the last noise token at or before j (or `start`) and d the follow steps since; rule^d comes
    from binary powers of the permutation (log2 R gathers instead of R sequential steps).
    Shapes: start [N], follow and noise [N, R]."""
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


class RuleSource:
    def __init__(self, vocab_size: int, seed: int, prompt_len: int, response_len: str | int,
                 group_size: int = 1, num_samples: int | None = None,
                 full_rows: tuple[int, int] | None = None):
        """`num_samples`: a finite pool of samples 0..n-1, visited in epochs like a file;
        None: endless (no epochs). `full_rows`: (seq_len, batch_size) for the full-row draw
        (module docstring); `response_len` is then seq_len - prompt_len + 1."""
        self.num_samples = num_samples
        self.full_rows = full_rows
        if full_rows is not None:
            response_len = f"fixed:{full_rows[0] - prompt_len + 1}"
        if group_size < 1:
            raise ConfigError("data.group_size", f"must be >= 1, got {group_size}")
        if prompt_len < 1:
            raise ConfigError("data.prompt_len", f"must be >= 1, got {prompt_len}")
        self.vocab, self.seed, self.group_size, self.prompt_len = (vocab_size, seed, group_size,
                                                                   prompt_len)
        self.response_dist: LengthDist = parse_length(response_len, "data.response_len")
        if self.response_dist.lo < 1:
            raise ConfigError("data.response_len", "responses need at least 1 token")
        self.rule = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self._rewards = lru_cache(maxsize=4096)(self._group_rewards)
        self._block = lru_cache(maxsize=256)(self._group_block)

    def _gen(self, *key: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix(self.seed, *key))

    def sizes(self, i: int) -> tuple[int, int]:
        """(prompt, response) tokens of sample i, without drawing its tokens."""
        u = random.Random(mix(self.seed, _RESPONSE_LEN, i)).random()
        return self.prompt_len, self.response_dist.draw(u)

    def longest(self) -> tuple[int, int]:
        """The longest prompt and sample: of the pool when finite, else what the distributions
        can draw."""
        if self.num_samples is not None:
            return self.prompt_len, max(sum(self.sizes(i)) for i in range(self.num_samples))
        return self.prompt_len, self.prompt_len + self.response_dist.hi

    def first_longer_than(self, budget: int) -> int | None:
        """The first sample of a finite pool longer than `budget` tokens."""
        return next((i for i in range(self.num_samples or 0) if sum(self.sizes(i)) > budget), None)

    def where(self, i: int) -> str:
        return f"synthetic sample {i}"

    def _follow(self, i: int) -> tuple[torch.Tensor, torch.Generator]:
        """Which of sample i's response tokens follow the rule, and the generator that then
        draws its noise tokens."""
        g = self._gen(_FOLLOW, i)
        q = float(torch.rand((), generator=g))
        return torch.rand(self.sizes(i)[1], generator=g) < q, g

    def _group_rewards(self, grp: int) -> tuple[float, ...]:
        """Each member's advantage: its reward less the group's token-weighted mean reward, over
        the token-weighted standard deviation. Weighting by response length makes the group's
        advantage sum over its trained tokens zero, so a step's surrogate starts at 0 (ratio 1)
        whatever the lengths, and every later fall is learning, not length noise."""
        G = self.group_size
        ks = range(grp * G, (grp + 1) * G)
        r = [float(self._follow(k)[0].float().mean()) for k in ks]
        w = [self.sizes(k)[1] for k in ks]
        mean = sum(a * b for a, b in zip(r, w)) / sum(w)
        std = math.sqrt(sum(b * (a - mean) ** 2 for a, b in zip(r, w)) / sum(w))
        return tuple((a - mean) / (std + 1e-4) for a in r)

    def _group_block(self, step: int, grp: int):
        """A full-row group: prompts [G, P], responses [G, R], advantages [G] (float32)."""
        G, P, V = self.group_size, self.prompt_len, self.vocab
        R = self.response_dist.hi
        g = torch.Generator().manual_seed(self.seed * 7919 + step * 104729 + grp * 15485863)
        prompts = torch.randint(0, V, (1, P), generator=g).expand(G, P)
        q = torch.rand(G, generator=g)
        follow = torch.rand(G, R, generator=g) < q[:, None]
        noise = torch.randint(0, V, (G, R), generator=g)
        resp = rule_walk(self.rule, prompts[:, -1], follow, noise)
        # Equal lengths make a group's token-weighted advantages sum to zero, so the surrogate
        # starts at exactly 0 (ratio 1) and every later fall is learning, not length noise.
        rg = follow.float().mean(1).view(-1, G)
        adv = (rg - rg.mean(1, keepdim=True)) / (rg.std(1, unbiased=False, keepdim=True) + 1e-4)
        return prompts, resp, adv.view(-1)

    def _full_row(self, i: int) -> Sample:
        seq_len, batch = self.full_rows
        step, k = divmod(i, batch)
        prompts, resp, adv = self._block(step, k // self.group_size)
        m = k % self.group_size
        uniform = torch.full((resp.shape[1],), -math.log(self.vocab))
        return Sample(prompt=prompts[m].clone(), response=resp[m].clone(),
                      advantage=float(adv[m]), old_logprobs=uniform, ref_logprobs=uniform,
                      rollout_logprobs=uniform, index=i, where=self.where(i))

    def get(self, i: int) -> Sample:
        if self.full_rows is not None:
            return self._full_row(i)
        G = self.group_size
        grp = i // G
        P, R = self.sizes(i)
        prompt = torch.randint(0, self.vocab, (P,), generator=self._gen(_PROMPT_IDS, grp))
        follow, g = self._follow(i)
        noise = torch.randint(0, self.vocab, (R,), generator=g)
        response = rule_walk(self.rule, prompt[-1:], follow[None], noise[None])[0]
        adv = self._rewards(grp)[i - grp * G]
        # The rollout, reference and old policies are all the uniform one.
        uniform = torch.full((R,), -math.log(self.vocab))
        return Sample(prompt=prompt, response=response, advantage=adv, old_logprobs=uniform,
                      ref_logprobs=uniform, rollout_logprobs=uniform, index=i,
                      where=self.where(i))

    def get_many(self, indices) -> list[Sample]:
        return [self.get(i) for i in indices]
