"""The run config: a YAML file (plus `--set dotted.key=value` overrides) parsed into frozen
dataclasses. Unknown fields and impossible values are rejected by name before any process starts.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from longmoe.config import ModelConfig, model_config_from
from longmoe.errors import ConfigError

_DTYPES = ("float32", "bfloat16", "float16")
OVERLONG = ("error", "drop", "truncate")
SOURCES = ("synthetic", "jsonl", "parquet")


def _finite(field: str, value, low: float | None = None, strict: bool = False):
    """One line naming the field for NaN, +-inf and values under `low` (or at it, if strict)."""
    if not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value}")
    if low is not None and (value <= low if strict else value < low):
        raise ConfigError(field, f"must be {'>' if strict else '>='} {low:g}, got {value}")


@dataclass(frozen=True)
class ParallelConfig:
    ep: int = 1                     # expert-parallel group size (consecutive ranks)
    # chunked EP: token chunks per MoE layer, or "auto" (tuning cache, else formula; see
    # longmoe.tuning)
    chunks: int | str = 1
    # What a chunk is: "experts" (a range of each rank's local experts with every token's
    # assignments to them; chunks must not exceed the local experts) or "tokens" (a token
    # range). Experts: each chunk's GEMMs read only its experts' weights, with all their rows;
    # on 2xH200 (EP 2, NCCL) a 64K layer took 60.5 / 59.4 / 59.8 / 60.0 ms at C = 1/2/4/8, token
    # chunks 58.6 / 60.8 / 62.2 / 63.8 (results/h200x2/moe_layer*.json).
    chunk_by: str = "experts"
    # Expert all-to-all transport: auto | process_group | symmetric_memory (backends/transports.py)
    a2a_transport: str = "auto"
    fsdp: bool = True               # FSDP2 over all ranks (experts over the ranks left by EP)
    # none | selective | full, or one of those per layer (a list as long as model.num_layers)
    recompute: str | tuple = "none"
    # Under full recompute, full-attention layers keep their attention kernel's saved tensors and
    # output gate (q, k, v, output, log-sum-exp, gate: (3*N*D + 2*K*D) * 2 bytes a token, ~0.8
    # GiB a layer at 32K tokens of the Qwen3.5 shape) instead of running the kernel's forward
    # again in the backward (longmoe.ops.recompute).
    keep_attention: bool = False
    param_dtype: str = "float32"    # FSDP2 compute dtype (bfloat16 on GPUs)
    reduce_dtype: str = "float32"   # gradient reduction dtype
    reshard_after_forward: bool = True
    # FSDP2 CPU offload: sharded params, grads and AdamW state live in host memory; the
    # optimizer step runs on the CPU (frees ~12 bytes/param of device memory, costs PCIe time).
    cpu_offload: bool = False
    cp: int = 1                     # context parallel: ranks sharing each sequence (zigzag)
    # With several micro-batches a step: "step" reduces gradients once, in the last micro-batch's
    # backward (FSDP2 then keeps every gradient unsharded, in reduce_dtype, until then: the local
    # model's size in memory); "micro_batch" reduce-scatters after each one (sharded gradients
    # accumulate; one reduction per micro-batch). A single FSDP rank always does the latter: no
    # communication to save.
    grad_sync: str = "step"
    pp: int = 1                     # reserved: pipeline parallel
    tp: int = 1                     # reserved: tensor parallel

    def __post_init__(self):
        if self.ep < 1:
            raise ConfigError("parallel.ep", f"must be >= 1, got {self.ep}")
        if self.chunks != "auto" and (isinstance(self.chunks, bool) or
                                      not isinstance(self.chunks, int) or self.chunks < 1):
            raise ConfigError("parallel.chunks", f"must be an integer >= 1 or auto, "
                                                 f"got {self.chunks!r}")
        from longmoe.parallel.expert_parallel import CHUNK_BY
        if self.chunk_by not in CHUNK_BY:
            raise ConfigError("parallel.chunk_by", f"must be tokens or experts, got {self.chunk_by!r}")
        from longmoe.backends.collective import TRANSPORT_NAMES
        if self.a2a_transport not in ("auto",) + TRANSPORT_NAMES:
            raise ConfigError("parallel.a2a_transport",
                              f"must be auto, {', '.join(TRANSPORT_NAMES)}; got {self.a2a_transport!r}")
        policies = (self.recompute,) if isinstance(self.recompute, str) else tuple(self.recompute)
        for p in policies:
            if p not in ("none", "selective", "full"):
                raise ConfigError("parallel.recompute",
                                  f"must be none, selective or full (or a list of them), got {p!r}")
        if not isinstance(self.keep_attention, bool):
            raise ConfigError("parallel.keep_attention",
                              f"must be true or false, got {self.keep_attention!r}")
        for f in ("param_dtype", "reduce_dtype"):
            if getattr(self, f) not in _DTYPES:
                raise ConfigError(f"parallel.{f}", f"must be one of {_DTYPES}")
        if self.grad_sync not in ("step", "micro_batch"):
            raise ConfigError("parallel.grad_sync", f"must be step or micro_batch, got "
                                                    f"{self.grad_sync!r}")


@dataclass(frozen=True)
class ImplConfig:
    linear_ce: str = "auto"
    grouped_mm: str = "auto"
    gated_delta: str = "auto"       # Gated DeltaNet core: auto | fla | chunked_triton | chunked_compiled | chunked | reference
    recompute: str = "auto"
    # The policy objective (loss.*) inside the LM head with gradients in the forward (auto |
    # fused | fused_torch | reference), or "unfused": log-probs from linear_ce, then the loss.
    policy_loss: str = "auto"
    # The MoE layer's row work (combine, dispatch gradient, SwiGLU): auto | triton | reference.
    moe_rows: str = "auto"
    # The router's logits GEMM (ops/router_matmul.py): auto | mixed (one bf16 GEMM with fp32
    # output) | reference (fp32 casts). The backward is fp32 either way (impl.fp32_matmul).
    router_matmul: str = "auto"
    # The RMS norms (RMSNorm, the q/k norm with RoPE, the Gated DeltaNet's gated norm;
    # ops/norm.py): auto (triton on GPUs, the eager reference on CPU) | triton | compiled
    # (torch.compile) | reference.
    norm: str = "auto"
    ce_chunk_tokens: int = 0        # linear-CE token chunk; 0 sizes it from a byte budget
    # fp32 matmuls on GPUs (the chunked Gated DeltaNet core's): "high" lets them run on TF32
    # tensor cores (10-bit mantissa, finer than the bf16 inputs; on an H200 at 16K-64K tokens the
    # core's output moves by < 7e-4 of its largest entry, its bf16 input gradients by < 7e-3,
    # about twice their own rounding; fwd+bwd 9-23% faster), "highest" keeps fp32. CPU runs
    # always use fp32.
    fp32_matmul: str = "high"
    # Full attention: auto (packed rows: the fastest document-causal implementation that runs
    # here; one sample per row: SDPA in the order the device backend's kernels.json lists for its
    # arch, else torch's) | an SDPA backend: flash | cudnn | efficient | math | a document-causal
    # implementation, also used for unpacked rows: varlen | flex | reference.
    attention: str = "auto"

    def __post_init__(self):
        from longmoe.ops import GROUPED_MM, LINEAR_CE, POLICY_LOSS, RECOMPUTE
        from longmoe.ops.gated_delta import GATED_DELTA
        from longmoe.ops.moe_rows import MOE_ROWS
        from longmoe.ops.norm import NORM
        from longmoe.ops.router_matmul import ROUTER_MATMUL
        for field, reg, extra in (("linear_ce", LINEAR_CE, ()), ("grouped_mm", GROUPED_MM, ()),
                                  ("gated_delta", GATED_DELTA, ()), ("recompute", RECOMPUTE, ()), ("moe_rows", MOE_ROWS, ()),
                                  ("router_matmul", ROUTER_MATMUL, ()), ("norm", NORM, ()),
                                  ("policy_loss", POLICY_LOSS, ("unfused",))):
            reg.check_name(getattr(self, field), f"impl.{field}", extra)
        from longmoe.ops.attention import IMPL_NAMES
        if self.attention not in IMPL_NAMES:
            raise ConfigError("impl.attention", f"unknown implementation {self.attention!r}; "
                              f"valid: {', '.join(IMPL_NAMES)}")
        if self.fp32_matmul not in ("high", "highest"):
            raise ConfigError("impl.fp32_matmul", f"must be high or highest, got {self.fp32_matmul!r}")
        if self.ce_chunk_tokens < 0:
            raise ConfigError("impl.ce_chunk_tokens", f"must be >= 0, got {self.ce_chunk_tokens}")


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"       # synthetic (the learnable rule task) | jsonl | parquet
    path: str = ""                  # the file for source=jsonl or parquet
    # The global batch: samples per optimizer step summed over the data ranks (world // cp;
    # context-parallel ranks share samples). Without a token budget each data rank trains
    # batch_size / data ranks of them (so a run resumed on another number of ranks trains the
    # same batch); with one, the step plan deals them to ranks by cost (docs/packing.md).
    batch_size: int = 4
    # Tokens per padded row (one sample per row, no token budget). In full rows (synthetic
    # without response_len, JSONL; longmoe.data.rows) a sample trains prompt + response <=
    # seq_len + 1 tokens: the last response token is only ever a label, never an input.
    seq_len: int = 128
    prompt_len: int = 32            # synthetic prompts
    group_size: int = 4             # synthetic GRPO group: responses per prompt
    # Synthetic response lengths: fixed:N | uniform:MIN:MAX | lognormal:MEAN:MAX (longmoe.data.
    # lengths). Unset: responses fill data.seq_len (without a budget exactly as before; with one,
    # samples of seq_len tokens).
    response_len: str | int | None = None
    # Synthetic: a finite pool of this many samples, visited in epochs like a file (e.g. the
    # same global batch every step, for benchmarks whose shapes must repeat). Unset: endless.
    num_samples: int | None = None
    # The token budget of one micro-batch: a row of at most this many tokens, shared by a
    # context-parallel group (each CP rank holds budget / cp of them). Unset: one padded sample
    # per row of seq_len, all of a rank's rows in one forward (no accumulation).
    max_tokens_per_micro_batch: int | None = None
    # With a budget: true lays samples end to end in each row (document-causal attention); false
    # trains one sample per micro-batch, padded to the budget (the padded baseline).
    packing: bool = True
    # Packed rows are padded up to a multiple of this many tokens (and of 2 x parallel.cp): fewer
    # distinct row shapes for compiled kernels, at the cost of some padding.
    row_multiple: int = 1
    # File sources: each epoch visits every sample once in a permutation drawn from (train.seed,
    # epoch); false keeps file order. Synthetic data is endless (no epochs): no effect.
    shuffle: bool = False
    # A sample longer than the row (the budget, else seq_len): error (name the file and line),
    # drop it, or truncate its response; dropped and truncated samples are counted per step.
    overlong: str = "error"

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ConfigError("data.source", f"must be {', '.join(SOURCES)}; got {self.source!r}")
        if self.source != "synthetic" and not self.path:
            raise ConfigError("data.path", f"required when data.source={self.source}")
        for f in ("batch_size", "seq_len", "prompt_len", "group_size", "row_multiple"):
            if getattr(self, f) < 1:
                raise ConfigError(f"data.{f}", f"must be >= 1, got {getattr(self, f)}")
        if self.source == "synthetic" and self.response_len is None and \
                self.prompt_len >= self.seq_len:
            raise ConfigError("data.prompt_len", f"{self.prompt_len} leaves no room for a "
                                                 f"response in seq_len={self.seq_len}")
        if self.overlong not in OVERLONG:
            raise ConfigError("data.overlong", f"must be {', '.join(OVERLONG)}; got {self.overlong!r}")
        b = self.max_tokens_per_micro_batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ConfigError("data.max_tokens_per_micro_batch",
                              f"must be an integer >= 1 or null, got {b!r}")
        n = self.num_samples
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError("data.num_samples", f"must be an integer >= 1 or null, got {n!r}")
            if self.source != "synthetic":
                raise ConfigError("data.num_samples", f"applies to data.source=synthetic only "
                                                      f"(a file has its own; got {self.source})")
            if self.response_len is None and self.budget is None:
                raise ConfigError("data.num_samples", "needs data.response_len or "
                                                      "data.max_tokens_per_micro_batch (the "
                                                      "full-row synthetic batches are endless)")
        for f in ("packing", "shuffle"):
            if not isinstance(getattr(self, f), bool):
                raise ConfigError(f"data.{f}", f"expected true or false, got {getattr(self, f)!r}")
        if self.response_len is not None:
            if self.source != "synthetic":
                raise ConfigError("data.response_len", f"applies to data.source=synthetic only "
                                                       f"(got {self.source})")
            from longmoe.data.lengths import parse_length
            if parse_length(self.response_len, "data.response_len").lo < 1:
                raise ConfigError("data.response_len", "responses need at least 1 token")

    @property
    def budget(self) -> int | None:
        return self.max_tokens_per_micro_batch

    def per_rank(self, data_ranks: int) -> int:
        """Sequences each data rank trains per step (without a token budget)."""
        if self.batch_size % data_ranks:
            raise ConfigError("data.batch_size", f"{self.batch_size} sequences do not split "
                                                 f"evenly over {data_ranks} data ranks")
        return self.batch_size // data_ranks


@dataclass(frozen=True)
class LossConfig:
    """The policy objective's settings (longmoe/rl/objective.py and docs/rl_objective.md)."""
    type: str = "grpo"              # grpo (PPO clipped surrogate) | sft
    clip_low: float = 0.2
    clip_high: float = 0.28         # asymmetric upper clip ("clip-higher")
    entropy_coef: float = 0.0
    # KL to the reference policy as a loss term (needs ref_logprobs in the data); 0 off.
    kl_coef: float = 0.0
    kl_estimator: str = "k3"        # k1 | k2 | k3
    # Truncated importance sampling: the policy-gradient term times min(exp(old - rollout),
    # tis_cap), correcting the rollout engine's log-probs against the trainer's (needs
    # rollout_logprobs in the data); 0 off.
    tis_cap: float = 0.0
    dual_clip_c: float = 0.0        # dual-clip PPO: loss <= -c*A where A < 0 (e.g. 3); 0 off
    # token-mean (every trained token of the global batch alike) | seq-mean-token-mean |
    # seq-mean-token-sum (per sample mean / sum over its tokens, then mean over the samples)
    loss_agg_mode: str = "token-mean"

    def __post_init__(self):
        from longmoe.rl.objective import check_fields
        if self.type not in ("grpo", "sft"):
            raise ConfigError("loss.type", f"must be grpo or sft, got {self.type!r}")
        check_fields(self, "loss.")
        if self.type == "sft":
            for f in ("kl_coef", "tis_cap", "dual_clip_c"):
                if getattr(self, f):
                    raise ConfigError(f"loss.{f}", "applies to loss.type=grpo only (set it to 0)")

    def objective(self):
        """The rl Objective these settings describe (for sft: its entropy bonus and
        aggregation)."""
        from longmoe.rl.objective import Objective
        return Objective(**{f.name: getattr(self, f.name) for f in fields(Objective)})

    def required_logprobs(self) -> dict[str, str]:
        """Per-token data fields the loss needs (field -> why), checked when data loads."""
        return {k: f"loss.{v}" for k, v in self.objective().required_logprobs().items()}


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0          # max global gradient norm; 0 disables clipping
    warmup_steps: int = 0
    # AdamW kernel: auto (fused on GPUs, foreach on CPU), fused (one pass over the fp32 state
    # per step), foreach (multi-tensor kernels, ~6 passes: 86 ms for 3.2B parameters on an H200)
    # or loop (per parameter: 107 ms at the same size). DTensors of the dense and the expert
    # meshes in one optimizer are fine for all three (the equivalence matrix runs them).
    impl: str = "auto"

    def __post_init__(self):
        if self.impl not in ("auto", "foreach", "fused", "loop"):
            raise ConfigError("optim.impl", f"must be auto, foreach, fused or loop, got {self.impl!r}")
        # 0 is a valid rate: the control run that measures the rollout/trainer mismatch with
        # the policy held still (AdamW's step and its decoupled decay lr*wd are then 0).
        _finite("optim.lr", self.lr, 0.0)
        _finite("optim.eps", self.eps, 0.0, strict=True)
        _finite("optim.weight_decay", self.weight_decay, 0.0)
        _finite("optim.grad_clip", self.grad_clip, 0.0)
        if len(self.betas) != 2:
            raise ConfigError("optim.betas", "needs two values")
        for b in self.betas:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
                raise ConfigError("optim.betas", f"each must be a number in [0, 1), got {b!r}")
        if self.warmup_steps < 0:
            raise ConfigError("optim.warmup_steps", "must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10
    seed: int = 0
    nproc: int = 1
    device: str = "auto"            # auto | cpu | cuda | rocm (a backend name)
    checkpoint_every: int = 0       # 0: only at the end when a checkpoint dir is given
    # After each published save, keep the newest this many step directories (0: keep all).
    keep_checkpoints: int = 0
    # Steps with a non-finite loss or gradient norm are skipped (no update); this many in a row
    # stop the run (exit code 3) with the last good checkpoint kept as `latest`.
    max_bad_steps: int = 3
    # Hugging Face checkpoint directory to start from (each rank reads only its own slices);
    # ignored when resuming from a longmoe checkpoint.
    init_hf: str = ""
    # Write the trained model here as a Hugging Face checkpoint (published layout) at the end.
    export_hf: str = ""
    # A kernel manifest (longmoe.ops.kernels.precompile): at start on a GPU, the kernel variants
    # it lists compile in parallel processes into Triton's on-disk cache while the model is
    # built; the variants this run compiles or loads are added to it (made if missing). Empty:
    # off. The cache stays on its machine; the manifest can go wherever the runs go.
    kernel_manifest: str = ""

    def __post_init__(self):
        if self.steps < 0:
            raise ConfigError("train.steps", f"must be >= 0, got {self.steps}")
        if self.nproc < 1:
            raise ConfigError("train.nproc", f"must be >= 1, got {self.nproc}")
        if self.checkpoint_every < 0:
            raise ConfigError("train.checkpoint_every", f"must be >= 0 (0: only at the end), "
                                                        f"got {self.checkpoint_every}")
        k = self.keep_checkpoints
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError("train.keep_checkpoints", f"must be an integer >= 0 (0: keep all), "
                                                        f"got {k!r}")
        if self.max_bad_steps < 1:
            raise ConfigError("train.max_bad_steps", f"must be >= 1, got {self.max_bad_steps}")
        if self.device not in ("auto", "cpu", "cuda", "rocm"):
            raise ConfigError("train.device", f"must be auto, cpu, cuda or rocm, got {self.device!r}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    impl: ImplConfig = field(default_factory=ImplConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"parallel": ParallelConfig, "impl": ImplConfig, "data": DataConfig,
             "loss": LossConfig, "optim": OptimConfig, "train": TrainConfig}


def _section(cls, raw: Any, name: str):
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(name, f"expected a mapping, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    for k, v in raw.items():
        if k not in known:
            raise ConfigError(f"{name}.{k}", "unknown field")
        want = known[k].type
        if want in ("int", "float") and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ConfigError(f"{name}.{k}", f"expected a number, got {v!r}")
        if want == "int" and isinstance(v, float):
            raise ConfigError(f"{name}.{k}", f"expected an integer, got {v!r}")
        if want == "bool" and not isinstance(v, bool):
            raise ConfigError(f"{name}.{k}", f"expected true or false, got {v!r}")
        if k == "recompute" and isinstance(v, list):
            continue
        if want == "str" and not isinstance(v, str):
            raise ConfigError(f"{name}.{k}", f"expected a string, got {v!r}")
        if want.startswith("tuple") and not isinstance(v, (list, tuple)):
            raise ConfigError(f"{name}.{k}", f"expected a list, got {what_it_holds(v)}")
    # A whole number for a float field (`--set optim.lr=1`) is stored as the float it means.
    raw = {k: float(v) if known[k].type == "float" else v for k, v in raw.items()}
    if "betas" in raw:
        raw = {**raw, "betas": tuple(raw["betas"])}
    if isinstance(raw.get("recompute"), list):
        raw = {**raw, "recompute": tuple(raw["recompute"])}
    return cls(**raw)


def what_it_holds(value) -> str:
    """A YAML value's kind, for messages about a value of the wrong shape."""
    if value is None:
        return "nothing"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list ({len(value)} item{'s' if len(value) != 1 else ''})"
    if isinstance(value, bool):
        return f"a bool ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    text = str(value)
    kind = "a string" if isinstance(value, str) else f"a {type(value).__name__}"
    return f"{kind} ({text[:40]!r}{'...' if len(text) > 40 else ''})"


def from_dict(raw: dict) -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config", f"top level must be a mapping of sections, got "
                                    f"{what_it_holds(raw)}")
    for k in raw:
        if k != "model" and k not in _SECTIONS:
            raise ConfigError(k, f"unknown section; valid: model, {', '.join(_SECTIONS)}")
    parts = {k: _section(cls, raw.get(k), k) for k, cls in _SECTIONS.items()}
    if raw.get("model") is not None and not isinstance(raw["model"], dict):
        raise ConfigError("model", f"expected a mapping, got {what_it_holds(raw['model'])}")
    model = model_config_from(raw.get("model"))
    rc = parts["parallel"].recompute
    if not isinstance(rc, str) and len(rc) != model.num_layers:
        raise ConfigError("parallel.recompute", f"has {len(rc)} per-layer policies for "
                                                f"model.num_layers={model.num_layers}")
    return RunConfig(model=model, **parts)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`--set a.b=value`: the value is parsed as YAML (numbers, bools, lists)."""
    raw = dict(raw)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError("--set", f"expected dotted.key=value, got {item!r}")
        key, val = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not all(parts):
            raise ConfigError("--set", f"{item!r}: expected dotted.key=value")
        node = raw
        for i, p in enumerate(parts[:-1]):
            here = node.get(p)
            if here is not None and not isinstance(here, dict):
                raise ConfigError("--set", f"{item!r}: {'.'.join(parts[:i + 1])} holds "
                                           f"{what_it_holds(here)}, not a mapping")
            node[p] = dict(here or {})
            node = node[p]
        value = _parse_value(val)
        if len(parts) == 1 and value is not None and not isinstance(value, dict):
            # A whole section replaced by a scalar or a list: the run would fail later with
            # a message that does not name the --set that caused it.
            raise ConfigError("--set", f"{item!r}: {key} is a section and takes a mapping "
                                       f"({key}.field=value), got {what_it_holds(value)}")
        node[parts[-1]] = value
    return raw


def _parse_value(text: str):
    value = yaml.safe_load(text)
    # YAML 1.1 reads "1e-3" as a string; only digit-based literals become floats (not "nan").
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value.strip()):
        return float(value)
    return value


RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"


def resolve_config_path(name: str) -> Path:
    p = Path(name)
    if p.exists():
        return p
    shipped = RECIPE_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
    if shipped.exists():
        return shipped
    known = ", ".join(sorted(q.stem for q in RECIPE_DIR.glob("*.yaml")))
    raise ConfigError("--config", f"{name} not found (shipped recipes: {known})")


def load_run_config(path: str | None, overrides: list[str] | None = None) -> RunConfig:
    raw: dict = {}
    if path:
        p = resolve_config_path(path)
        try:
            raw = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError("--config", f"{p}{where}: not valid YAML") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError("--config", f"{p}: cannot be read ({e})") from None
        # An empty or truncated file would train the defaults: another experiment, silently.
        if raw is None:
            raise ConfigError("--config", f"{p}: holds no settings (empty or only comments); "
                                          f"a run of the defaults is a file with {{}}")
        if not isinstance(raw, dict):
            raise ConfigError("--config", f"{p}: the top level holds {what_it_holds(raw)}, "
                                          f"expected a mapping of sections (model, "
                                          f"{', '.join(_SECTIONS)})")
    return from_dict(apply_overrides(raw, overrides or []))
