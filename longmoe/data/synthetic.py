"""Synthetic RL samples with a chosen length distribution, for benchmarks and tests.

Samples come in GRPO groups of `group_size` responses to one prompt (group g = index //
group_size). Every value is drawn from a generator keyed by (seed, index) or (seed, group), never
from a running stream, so sample i is the same whichever samples were drawn before it, whichever
rank asks, and however many ranks there are. Token ids are uniform over the vocabulary; each
response gets a reward uniform in [0, 1) and the group-normalised advantage (r - mean) / (std +
1e-4); the rollout policy is uniform, so old_logprobs are log(1/V), what a freshly initialised
policy gives. (These batches have realistic shapes, not a learnable task.)
"""

from __future__ import annotations

import math
import random

import torch

from longmoe.data.lengths import LengthDist, parse_length
from longmoe.data.order import mix
from longmoe.data.sample import Sample
from longmoe.errors import ConfigError

# Stream tags: each kind of draw has its own key, so adding a field never shifts another.
_PROMPT_LEN, _RESPONSE_LEN, _PROMPT_IDS, _RESPONSE_IDS, _REWARD = range(1, 6)


class SyntheticSource:
    num_samples = None      # endless: no epochs

    def __init__(self, vocab_size: int, seed: int, prompt_len: str | int = 32,
                 response_len: str | int = "fixed:96", group_size: int = 1):
        if group_size < 1:
            raise ConfigError("data.group_size", f"must be >= 1, got {group_size}")
        self.vocab, self.seed, self.group_size = vocab_size, seed, group_size
        self.prompt_dist: LengthDist = parse_length(prompt_len, "data.prompt_len")
        self.response_dist: LengthDist = parse_length(response_len, "data.response_len")
        if self.response_dist.lo < 1:
            raise ConfigError("data.response_len", "responses need at least 1 token")

    def _u(self, *key: int) -> float:
        return random.Random(mix(self.seed, *key)).random()

    def _gen(self, *key: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix(self.seed, *key))

    def sizes(self, i: int) -> tuple[int, int]:
        """(prompt, response) tokens of sample i, without drawing its tokens."""
        g = i // self.group_size
        return (self.prompt_dist.draw(self._u(_PROMPT_LEN, g)),
                self.response_dist.draw(self._u(_RESPONSE_LEN, i)))

    def longest(self) -> tuple[int, int]:
        """The longest prompt and sample the distributions can draw."""
        return self.prompt_dist.hi, self.prompt_dist.hi + self.response_dist.hi

    def where(self, i: int) -> str:
        return f"synthetic sample {i}"

    def get(self, i: int) -> Sample:
        G = self.group_size
        g = i // G
        P, R = self.sizes(i)
        prompt = torch.randint(0, self.vocab, (P,), generator=self._gen(_PROMPT_IDS, g))
        response = torch.randint(0, self.vocab, (R,), generator=self._gen(_RESPONSE_IDS, i))
        rewards = [self._u(_REWARD, k) for k in range(g * G, (g + 1) * G)]
        mean = sum(rewards) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / G)
        adv = (rewards[i - g * G] - mean) / (std + 1e-4)
        return Sample(prompt=prompt, response=response, advantage=adv,
                      old_logprobs=torch.full((R,), -math.log(self.vocab)),
                      index=i, where=self.where(i))

    def get_many(self, indices) -> list[Sample]:
        return [self.get(i) for i in indices]
