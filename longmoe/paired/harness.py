"""The paired-test record: a candidate against its reference on the same fresh inputs.

Differences are relative to the reference's largest magnitude (max |a - b| / max |b|), so one
tolerance per dtype works across tensors of different scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Relative tolerances by candidate compute dtype. fp32 candidates are checked against fp64 (CPU)
# references; bf16/fp16 against fp32 references of the same inputs.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float | None = None) -> float:
    """max |a - b| over max |b|, or over `scale` when the reference is a sum whose terms cancel
    (a GRPO surrogate near zero): then the size of its terms is the meaningful denominator."""
    a, b = a.detach().to(torch.float64).cpu(), b.detach().to(torch.float64).cpu()
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    if b.numel() == 0:
        return 0.0
    scale = torch.tensor(scale if scale is not None else float(b.abs().max())).clamp(min=1e-12)
    return float((a - b).abs().max() / scale)


@dataclass
class PairedResult:
    primitive: str
    candidate: str
    reference: str
    tolerance: float
    errors: dict[str, float] = field(default_factory=dict)   # name -> relative error
    peak_bytes: dict[str, int] = field(default_factory=dict)  # candidate / reference
    time_ms: dict[str, float] = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    compared: dict[str, int] = field(default_factory=dict)   # name -> elements compared

    @property
    def max_error(self) -> float:
        # NaN first: a NaN difference is the worst result, and max() would skip past it.
        nan = [v for v in self.errors.values() if v != v]
        return nan[0] if nan else max(self.errors.values(), default=0.0)

    @property
    def nothing_compared(self) -> str | None:
        """Why this comparison proves nothing (no quantity, or only empty tensors), else None."""
        if not self.errors:
            return "nothing was compared"
        if not any(self.compared.get(k, 1) for k in self.errors):
            return f"every compared tensor is empty ({', '.join(self.errors)})"
        return None

    @property
    def ok(self) -> bool:
        return self.nothing_compared is None and all(v <= self.tolerance
                                                     for v in self.errors.values())

    def add(self, name: str, cand: torch.Tensor, ref: torch.Tensor, scale: float | None = None):
        self.errors[name] = rel_err(cand, ref, scale)
        self.compared[name] = int(ref.numel())

    def to_dict(self) -> dict:
        return {**asdict(self), "max_error": self.max_error, "ok": self.ok,
                "nothing_compared": self.nothing_compared}

    def failures(self) -> list[str]:
        out = [self.nothing_compared] if self.nothing_compared else []
        return out + [f"{k}: {v:.3e} > {self.tolerance:.1e}" for k, v in self.errors.items()
                      if not v <= self.tolerance]
