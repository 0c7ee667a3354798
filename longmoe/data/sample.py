"""What one RL sample is: a prompt, a response and the per-response-token training signal.

Token ids are int64 tensors; per-response-token fields are float32 (log-probs, advantages) or
bool (loss mask) tensors of the response's length. `index` is the sample's stable position in its
source (line order for files, the draw index for synthetic data): shuffling, resuming and every
rank's plan refer to samples by it. `where` names the sample for error messages
("rollouts.jsonl:17", "synthetic sample 42").

Field names are those of a JSONL object or Parquet row:
  prompt, response            lists of token ids
  advantage                   a number, or one per response token
  old_logprobs                per response token (optional; missing means on-policy)
  ref_logprobs                per response token (optional; the reference policy, for KL terms)
  rollout_logprobs            per response token (optional; the inference engine's, for TIS)
  loss_mask                   0/1 or true/false per response token (optional; missing means all
                              trained)
  temperature                 the rollout's sampling temperature (optional, > 0; missing means 1):
                              log-probs are those of softmax(logits / temperature), as the
                              rollout engine sampled from
  routed_experts              router replay (optional): per token of prompt + response, for each
                              MoE layer, the top-k experts the rollout engine routed it to,
                              [P + R][layers][top_k] integers, a token's row all -1 where the
                              trainer's router decides (the trainer's forward uses these experts,
                              weighted by its own router's probabilities for them). A file's
                              routes become an int16 tensor (longmoe.data.routes); the API takes
                              any integer tensor [P + R, layers, top_k].
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from longmoe.data import routes as route_rules

LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")
FIELDS = ("prompt", "response", "advantage", *LOGPROB_FIELDS, "loss_mask", "temperature",
          "routed_experts")


# eq=False: tensors have no single truth value, and two draws being "equal" is never what a
# caller means by ==; tests compare fields.
@dataclass(frozen=True, eq=False)
class Sample:
    prompt: torch.Tensor                        # [P] int64
    response: torch.Tensor                      # [R] int64
    advantage: float | torch.Tensor             # scalar, or [R] float32
    old_logprobs: torch.Tensor | None = None    # [R] float32
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None       # [R] bool (the API also takes 0/1 numbers)
    temperature: float = 1.0                    # the rollout's sampling temperature, > 0
    routed_experts: torch.Tensor | None = None  # [P + R, layers, top_k] int, -1: not replayed
    index: int = 0
    where: str = ""

    def __len__(self) -> int:
        return self.prompt.numel() + self.response.numel()

    @property
    def prompt_len(self) -> int:
        return self.prompt.numel()

    @classmethod
    def from_row(cls, row: dict, index: int, where: str) -> "Sample":
        """A sample from a row already validated by the source's checker."""
        def floats(key):
            v = row.get(key)
            return None if v is None else torch.as_tensor(v, dtype=torch.float32)
        adv = row["advantage"]
        mask = row.get("loss_mask")
        routes = row.get("routed_experts")
        return cls(prompt=torch.as_tensor(row["prompt"], dtype=torch.long).reshape(-1),
                   response=torch.as_tensor(row["response"], dtype=torch.long).reshape(-1),
                   advantage=floats("advantage") if isinstance(adv, (list, tuple)) else float(adv),
                   old_logprobs=floats("old_logprobs"), ref_logprobs=floats("ref_logprobs"),
                   rollout_logprobs=floats("rollout_logprobs"),
                   loss_mask=None if mask is None else torch.as_tensor(mask).to(torch.bool),
                   temperature=float(row.get("temperature", 1.0)),
                   routed_experts=None if routes is None else route_rules.to_tensor(
                       route_rules.as_array(routes, where)),
                   index=index, where=where)

    def truncated(self, length: int) -> "Sample":
        """The first `length` tokens: the prompt whole and a prefix of the response (every
        per-response-token field cut alike). The caller guarantees prompt_len < length."""
        if length >= len(self):
            return self
        if length <= self.prompt_len:
            raise ValueError(f"{self.where}: cannot truncate to {length} tokens, the prompt "
                             f"alone has {self.prompt_len}")
        n = length - self.prompt_len
        cut = {k: getattr(self, k)[:n] for k in (*LOGPROB_FIELDS, "loss_mask")
               if getattr(self, k) is not None}
        adv = self.advantage[:n] if isinstance(self.advantage, torch.Tensor) else self.advantage
        if self.routed_experts is not None:
            cut["routed_experts"] = self.routed_experts[:length]
        return replace(self, response=self.response[:n], advantage=adv, **cut)


def trained_tokens(sample: Sample) -> int:
    """Response tokens that get a label: token j is predicted from position P+j-1, so with an
    empty prompt the first response token has no predictor; the loss mask removes the rest."""
    P, R = sample.prompt_len, sample.response.numel()
    first = 1 if P == 0 else 0
    if sample.loss_mask is None:
        return max(0, R - first)
    return int(sample.loss_mask[first:].sum())
