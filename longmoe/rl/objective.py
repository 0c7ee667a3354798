"""The policy-update objective, defined once as per-token math on (logp, old, ref, rollout,
advantage, weight). The fused LM-head path (ops/linear_ce_fused.py) calls `token_loss_grads`
chunk by chunk, the plain references (the registry's "reference" and the trainer's unfused
path) differentiate `token_loss` with autograd; paired tests hold the two together.

Which log-probs are compared (all per response token, natural log, <= 0):
  logp      the current policy being trained (the LM head's output; the only one with gradient).
  old       `old_logprobs`: the trainer's own policy when the rollout was generated (PPO's
            pi_old). NaN (not given) means on-policy: old = logp, detached, so the ratio is 1
            and the gradient is the plain policy gradient.
  ref       `ref_logprobs`: the frozen reference policy, for the KL term.
  rollout   `rollout_logprobs`: what the rollout engine (vLLM, SGLang, ...) reported for the
            sampled tokens; it differs from `old` by the engine's numerics and sampling
            kernels, which truncated importance sampling corrects.

Per token t, with r = exp(logp - old) and A the advantage:
  pg   = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)        clipped surrogate (PPO/GRPO)
  pg   = min(pg, -c A) where A < 0                                 dual clip, c = dual_clip_c
  pg  *= min(exp(old - rollout), tis_cap), detached                truncated IS, tis_cap > 0
  loss = pg + kl_coef * k(logp, ref) - entropy_coef * entropy
  k1 = logp - ref,  k2 = (logp - ref)^2 / 2,  k3 = exp(ref - logp) - (ref - logp) - 1
The step's loss is sum_t w_t loss_t with aggregation weights w (`Objective.token_weights`):
the kernel path only ever sees w, so every aggregation mode runs through it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from longmoe.errors import ConfigError

KL_ESTIMATORS = ("k1", "k2", "k3")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")


def check_fields(cfg, prefix: str = "") -> None:
    """One ConfigError naming `prefix + field` for the first objective setting that cannot
    work. Shared by Objective and the run config's loss section (which has the same fields)."""
    def number(name: str, low: float | None = None, strict: bool = False) -> float:
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(prefix + name, f"must be a finite number, got {v!r}")
        if low is not None and (v <= low if strict else v < low):
            raise ConfigError(prefix + name, f"must be {'>' if strict else '>='} {low:g}, got {v}")
        return v

    number("clip_low", 0.0)
    if cfg.clip_low >= 1:
        raise ConfigError(prefix + "clip_low", f"must be < 1, got {cfg.clip_low}")
    number("clip_high", 0.0)
    number("entropy_coef")
    number("kl_coef", 0.0)
    if cfg.kl_estimator not in KL_ESTIMATORS:
        raise ConfigError(prefix + "kl_estimator", f"must be {', '.join(KL_ESTIMATORS)}; got "
                                                   f"{cfg.kl_estimator!r}")
    number("tis_cap", 0.0)
    # c <= 1 would cap a negative-advantage token below its own unclipped loss at ratio 1.
    if number("dual_clip_c", 0.0) and cfg.dual_clip_c <= 1:
        raise ConfigError(prefix + "dual_clip_c", f"must be > 1 (or 0: off), got {cfg.dual_clip_c}")
    if cfg.loss_agg_mode not in AGG_MODES:
        raise ConfigError(prefix + "loss_agg_mode", f"must be {', '.join(AGG_MODES)}; got "
                                                    f"{cfg.loss_agg_mode!r}")


@dataclass(frozen=True, eq=False)
class TokenInputs:
    """The objective's per-token inputs, all of one shape (that of the labels). `weights` holds
    the aggregation weights (Objective.token_weights; 0 where nothing is trained). A log-prob
    tensor may be None when the objective does not use it; NaN entries of `old_logprobs` mean
    on-policy."""
    advantages: torch.Tensor
    weights: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None

    def map(self, fn) -> "TokenInputs":
        """The same inputs with `fn` applied to every tensor (reshape, slice, to device)."""
        return TokenInputs(**{f.name: None if getattr(self, f.name) is None
                              else fn(getattr(self, f.name)) for f in fields(self)})

    def check(self, shape, objective: "Objective") -> None:
        """ValueError naming the field: a shape that is not `shape`, or a log-prob tensor the
        objective uses but was not given."""
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None and tuple(t.shape) != tuple(shape):
                raise ValueError(f"{f.name}{tuple(t.shape)} must match labels{tuple(shape)}")
        for name, why in objective.required_logprobs().items():
            if getattr(self, name) is None:
                raise ValueError(f"{name}: required ({why})")


@dataclass(frozen=True, eq=False)
class FusedLoss:
    """What the LM head needs to fuse the policy loss into its linear cross-entropy: the
    objective, its per-token inputs (shaped like the labels) and the POLICY_LOSS impl."""
    objective: "Objective"
    inputs: TokenInputs
    impl: str = "auto"


@dataclass(frozen=True)
class Objective:
    clip_low: float = 0.2           # ratio floor 1 - clip_low
    clip_high: float = 0.28         # ratio ceiling 1 + clip_high ("clip-higher" when > clip_low)
    dual_clip_c: float = 0.0        # dual-clip PPO: a negative-advantage token's loss <= -c*A; 0 off
    kl_coef: float = 0.0            # KL-to-reference loss term; 0 off (ref_logprobs not needed)
    kl_estimator: str = "k3"        # k1 | k2 | k3 (Schulman's estimators of KL(pi || ref))
    tis_cap: float = 0.0            # truncated IS against rollout_logprobs; 0 off
    entropy_coef: float = 0.0       # entropy bonus
    loss_agg_mode: str = "token-mean"   # token-mean | seq-mean-token-mean | seq-mean-token-sum

    def __post_init__(self):
        check_fields(self)

    def required_logprobs(self) -> dict[str, str]:
        """field -> the setting that needs it, for the log-prob inputs this objective reads
        besides old_logprobs (which is optional: missing means on-policy)."""
        out = {}
        if self.kl_coef:
            out["ref_logprobs"] = f"kl_coef={self.kl_coef:g} needs the reference policy's log-probs"
        if self.tis_cap:
            out["rollout_logprobs"] = (f"tis_cap={self.tis_cap:g} needs the rollout engine's "
                                       f"log-probs")
        return out

    # ---- per-token math ----------------------------------------------------------------------

    def _common(self, logp, x: TokenInputs, mask):
        """(A, old, r, pg before TIS, dual-capped flags or None, TIS weight or None); logp may
        carry gradient, the rest never does. Masked tokens get finite values (r = 1, no KL),
        whatever their inputs hold."""
        adv = torch.where(mask, x.advantages.to(logp.dtype), 0.0)
        old = logp.detach()
        if x.old_logprobs is not None:
            o = x.old_logprobs.to(logp.dtype)
            old = torch.where(torch.isnan(o), old, o)
        ratio = torch.exp(torch.where(mask, logp - old, 0.0))
        s1 = ratio * adv
        s2 = torch.clamp(ratio, 1 - self.clip_low, 1 + self.clip_high) * adv
        pg = torch.maximum(-s1, -s2)
        capped = None
        if self.dual_clip_c:
            cap = -self.dual_clip_c * adv
            capped = (adv < 0) & (pg > cap)
            pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
        tis = None
        if self.tis_cap:
            roll = self._given(x, "rollout_logprobs").to(logp.dtype)
            tis = torch.clamp(torch.exp(torch.where(mask, old - roll, 0.0)), max=self.tis_cap).detach()
        return adv, old, ratio, s1, s2, pg, capped, tis

    def _kl(self, logp, x: TokenInputs, mask):
        """(k per token, dk/dlogp), d = ref - logp; expm1 keeps k3 exact near d = 0."""
        d = torch.where(mask, self._given(x, "ref_logprobs").to(logp.dtype) - logp, 0.0)
        if self.kl_estimator == "k1":
            return -d, torch.ones_like(d)
        if self.kl_estimator == "k2":
            return 0.5 * d * d, -d
        e = torch.expm1(d)
        return e - d, -e

    def _given(self, x: TokenInputs, name: str) -> torch.Tensor:
        t = getattr(x, name)
        if t is None:
            raise ValueError(f"{name}: required ({self.required_logprobs()[name]})")
        return t

    def _need_entropy(self, entropy):
        if self.entropy_coef and entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef:g} needs the per-token entropy")

    def token_loss(self, logp, entropy, x: TokenInputs, mask) -> torch.Tensor:
        """w_t * loss_t per token (0 where `mask` is False), differentiable in logp and entropy:
        the plain reference that autograd differentiates."""
        self._need_entropy(entropy)
        _, _, _, _, _, pg, _, tis = self._common(logp, x, mask)
        loss = pg if tis is None else pg * tis
        if self.kl_coef:
            loss = loss + self.kl_coef * self._kl(logp, x, mask)[0]
        if self.entropy_coef:
            loss = loss - self.entropy_coef * entropy
        return torch.where(mask, x.weights.to(logp.dtype) * loss, 0.0)

    @torch.no_grad()
    def token_loss_grads(self, logp, entropy, x: TokenInputs, mask):
        """(w*loss, w * d loss/d logp, w * d loss/d entropy or None when entropy_coef is 0) per
        token, in closed form: what the fused kernel needs to form the logit gradient in its
        forward pass. Equal to token_loss and its autograd gradients (tests/test_rl_objective)."""
        self._need_entropy(entropy)
        adv, _, ratio, s1, s2, pg, capped, tis = self._common(logp, x, mask)
        # pg = max(-s1, -s2): the unclipped branch carries -A r; the clipped one is constant.
        g = torch.where(s1 <= s2, -adv * ratio, 0.0)
        if capped is not None:
            g = torch.where(capped, 0.0, g)
        if tis is not None:
            pg, g = pg * tis, g * tis
        loss = pg
        if self.kl_coef:
            k, dk = self._kl(logp, x, mask)
            loss, g = loss + self.kl_coef * k, g + self.kl_coef * dk
        g_ent = None
        if self.entropy_coef:
            loss = loss - self.entropy_coef * entropy
            g_ent = torch.full_like(logp, -self.entropy_coef)
        w = torch.where(mask, x.weights.to(logp.dtype), 0.0)
        loss = torch.where(mask, w * loss, 0.0)
        return loss, w * g, (None if g_ent is None else w * g_ent)

    @torch.no_grad()
    def stats(self, logp, entropy, x: TokenInputs, mask) -> dict[str, torch.Tensor]:
        """Sums over the trained tokens (divide by the global trained-token count for means):
        clip_frac (tokens whose clipped branch is active), ratio_sum, logprob_sum, entropy, and
        for the terms that are on kl_sum (the chosen estimator), tis_weight_sum and
        tis_clip_frac (tokens whose weight hit the cap), dual_clip_frac."""
        logp = logp.detach()
        _, old, ratio, s1, s2, _, capped, tis = self._common(logp, x, mask)
        out = {"clip_frac": ((s2 < s1) & mask).sum(), "ratio_sum": torch.where(mask, ratio, 0.0).sum(),
               "logprob_sum": torch.where(mask, logp, 0.0).sum()}
        if entropy is not None:
            out["entropy"] = torch.where(mask, entropy.detach(), 0.0).sum()
        if self.kl_coef:
            out["kl_sum"] = torch.where(mask, self._kl(logp, x, mask)[0], 0.0).sum()
        if tis is not None:
            out["tis_weight_sum"] = torch.where(mask, tis, 0.0).sum()
            raw = torch.exp(torch.where(mask, old - x.rollout_logprobs.to(logp.dtype), 0.0))
            out["tis_clip_frac"] = ((raw > self.tis_cap) & mask).sum()
        if capped is not None:
            out["dual_clip_frac"] = (capped & mask).sum()
        return out

    # ---- aggregation -------------------------------------------------------------------------

    def token_weights(self, mask, n_tokens: int, n_samples: int | None = None,
                      sample_tokens=None) -> torch.Tensor:
        """Per-token weights w (float64, so fp64 references keep 1/n exact; 0 off the mask) with sum_t w_t loss_t the step's loss:
          token-mean           1 / n_tokens
          seq-mean-token-mean  1 / (n_samples * trained tokens of the token's sample)
          seq-mean-token-sum   1 / n_samples
        n_tokens and n_samples are GLOBAL: the trained tokens and the samples with at least one
        trained token of the whole step, over every rank and micro-batch (global_counts below),
        so the ranks' and micro-batches' sums add up to the global-batch loss. `sample_tokens`
        gives, per token, the trained tokens of its whole sample (sample_token_counts, taken
        before any split of a sample across ranks). A count of 0 (nothing trained) gives zero
        weights, not a division by zero."""
        m = mask.to(torch.float64)
        if self.loss_agg_mode == "token-mean":
            return m / max(int(n_tokens), 1)
        if n_samples is None or sample_tokens is None:
            raise ValueError(f"loss_agg_mode={self.loss_agg_mode} needs n_samples and sample_tokens")
        m = m / max(int(n_samples), 1)
        if self.loss_agg_mode == "seq-mean-token-sum":
            return m
        return m / sample_tokens.to(torch.float64).clamp(min=1)


def sample_token_counts(mask, sample_ids) -> torch.Tensor:
    """Per token, the number of trained tokens (`mask`) of its sample (int64, 0 where the
    sample id is negative: padding). Samples are told apart by id only, so ids must be unique
    within the tensor (e.g. a row index, or a packed micro-batch's sample ordinals); the tensor
    must hold every token of its samples (take it before a context-parallel split)."""
    ids = sample_ids.reshape(-1)
    valid = ids >= 0
    uniq, inv = torch.unique(torch.where(valid, ids, -1), return_inverse=True)
    counts = torch.zeros(uniq.numel(), dtype=torch.int64, device=ids.device)
    counts.index_add_(0, inv, (mask.reshape(-1) & valid).to(torch.int64))
    return torch.where(valid, counts[inv], 0).reshape(sample_ids.shape)


def local_counts(mask, sample_tokens) -> torch.Tensor:
    """[trained tokens, samples] of this tensor (float64) to be summed over ranks: a sample's
    tokens add 1 / its length each, so a sample split over ranks (context parallel) counts
    once in the sum, and one with nothing trained not at all."""
    m = mask.to(torch.float64)
    share = (m / sample_tokens.to(torch.float64).clamp(min=1)).sum()
    return torch.stack([m.sum(), share])


def counts_to_int(summed: torch.Tensor) -> tuple[int, int]:
    """(n_tokens, n_samples) from summed local_counts; the sample shares round to whole
    samples (their float64 sum is off by far less than 1/2)."""
    return int(round(float(summed[0]))), int(round(float(summed[1])))
