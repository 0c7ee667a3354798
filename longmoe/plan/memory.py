"""Per-rank peak-memory estimate for a (TP, PP, EP, CP) layout of a ModelConfig.

The estimate is a sum of named terms, each a formula over the model's shapes, so a reader can
check any line against the code it models (longmoe.model, longmoe.parallel.fsdp) and against a
measured peak. Legend: T tokens on a rank in one micro-batch (seq_len * micro_batch / (CP * TP),
sequence-parallel under TP), H hidden, V vocab, E experts, K top-k, F expert FFN width, Fs shared
expert width, n*d query width, kv*d key/value width, L layers on the pipeline stage.

What is modelled (and why):
  static     parameters, gradients and AdamW state. FSDP2 shards all three over every rank of
             the stage (dense) or over the ranks holding the same experts (expert-data-parallel);
             Megatron's distributed optimizer ("dist_opt", ZeRO-1) keeps bf16 params and main
             grads whole and shards only the fp32 master + moments.
  stored     activations kept between forward and backward: full recompute keeps each layer's
             input; selective also keeps the attention side and recomputes the MoE (dispatch,
             expert FFN); none keeps everything. Under 1F1B the first stage holds PP micro-batches.
  working    the one layer being recomputed and differentiated: its saved set plus the gradient
             buffers alive together; attention is SDPA/flash, so there is no S^2 term.
  dispatch   routed-row buffers of the MoE (K rows per token, scaled by the expert load imbalance
             on the busiest rank): the rows saved for the expert FFN backward, and the all-to-all
             send/recv copies and their gradients, of which chunked EP keeps one chunk alive.
  logits     naive: fp32 [T, V/TP] logits and their gradient (plus fp32 copies of W and dW);
             linear CE (the in-place layout, the runtime's default): one fp32 [C, V/TP] chunk
             with its gradient written over it, dW and dH in the compute dtype.
  comm       FSDP2 all-gather/reduce-scatter buffers (current + prefetched unit), the LM head kept
             unsharded after forward, pipeline send/recv and CP key/value exchange buffers.
  margin     caching-allocator fragmentation, a fraction of the dynamic bytes.

The terms do not all peak together: FSDP2 gradients appear layer by layer while stored inputs
are freed, and the LM head's buffers are gone before the layers' backward starts. So each phase
(LM head, start and end of the layers' backward, embedding backward) is summed on its own, per
pipeline stage, and the largest is the estimate; the breakdown shows that phase's terms.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from longmoe.config import ModelConfig
from longmoe.errors import ConfigError

GiB = 2**30
RECOMPUTE = ("none", "selective", "full")
SHARDING = ("fsdp2", "dist_opt")


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def dp_cp(self) -> int:
        """Ranks of one pipeline stage holding the same dense shard (data x context)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: ranks that see different sequences."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Ranks of one stage holding the same experts (expert tensor parallel is 1)."""
        return self.gpus // (self.pp * self.ep)

    @property
    def label(self) -> str:
        return f"TP{self.tp}·PP{self.pp}·EP{self.ep}·CP{self.cp}"


@dataclass(frozen=True)
class Workload:
    seq_len: int                    # tokens of one sequence, shared by the CP x TP ranks
    micro_batch: int = 1            # sequences per micro-batch per data-parallel replica
    recompute: str = "full"         # none | selective | full
    sharding: str = "fsdp2"         # fsdp2 | dist_opt
    linear_ce: bool = True          # False: naive fp32 [T, V] logits
    ce_chunk_tokens: int = 0        # 0: the runtime's default (a 0.95 GiB fp32 logits chunk)
    ep_chunks: int = 0              # chunked EP; 0: longmoe.tuning.default_chunks(T)
    # With recompute full/selective: the last `keep_last` layers store their activations instead
    # (their backward runs first, so they are freed before any recomputed layer's working set).
    keep_last: int = 0
    # Full recompute keeps the attention kernel's tensors in full-attention layers
    # (parallel.keep_attention): activation_bytes "attn_kernel" a token on each.
    keep_attention: bool = False
    # Several micro-batches a step (token-budget rows, longmoe.train.step.accumulate): "step"
    # reduces gradients once per step, so FSDP2 keeps every gradient unsharded in fp32 until the
    # last micro-batch (the local model's size, on every rank); "micro_batch" reduce-scatters
    # after each one and only shards accumulate (no term beyond one micro-batch's).
    grad_sync: str = "micro_batch"

    @property
    def tokens_per_micro_batch(self) -> int:
        """The token budget of one micro-batch row set (data.max_tokens_per_micro_batch), shared
        by a CP x TP group; each of its GPUs holds 1/(CP x TP) of it."""
        return self.seq_len * self.micro_batch

    def __post_init__(self):
        if self.seq_len < 1 or self.micro_batch < 1:
            raise ConfigError("workload", "seq_len and micro_batch must be >= 1")
        if self.keep_last < 0:
            raise ConfigError("keep_last", f"must be >= 0, got {self.keep_last}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError("recompute", f"must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.sharding not in SHARDING:
            raise ConfigError("sharding", f"must be one of {SHARDING}, got {self.sharding!r}")
        if self.grad_sync not in ("micro_batch", "step"):
            raise ConfigError("grad_sync", f"must be micro_batch or step, got {self.grad_sync!r}")


@dataclass(frozen=True)
class Assumptions:
    """Byte widths and the few constants that are not shapes; each says where it comes from."""
    compute_bytes: int = 2          # bf16 activations and gathered params (param_dtype)
    master_bytes: int = 4           # fp32 sharded params (FSDP2) / master copy (dist_opt)
    grad_bytes: int = 4             # fp32 sharded grads (FSDP2 reduce_dtype) / Megatron main grads
    adam_bytes: int = 8             # AdamW exp_avg + exp_avg_sq in fp32
    # Busiest EP rank's routed rows over the mean. Real RL batches are not balanced (the seeds
    # saw rank-max memory rise with imbalance without quantifying it); 1.25 is our assumption.
    # With EP=1 one rank holds every expert and gets exactly top_k rows per token: 1.0 there.
    moe_imbalance: float = 1.25
    # Caching-allocator fragmentation over the dynamic bytes: variable-size MoE buffers leave
    # holes. 0.10 is a planning figure, not a measurement.
    fragmentation: float = 0.10
    # Per-rank memory the allocator never sees: CUDA/HIP context, NCCL/RCCL channels. Budgeted
    # by the planner, not counted in `peak`.
    context_gib: float = 3.0
    # dist_opt keeps its grad-reduce buckets; FSDP2 buffers are counted per unit instead.
    dist_opt_bucket_bytes: int = 512 * 2**20
    # What a Gated DeltaNet layer keeps for backward. "kernel": a fused GPU kernel (fla, the
    # seeds' stack, or our chunked_triton), assumed to keep about what attention keeps (bf16
    # inputs plus per-chunk states); +4% against the 40-layer H200 run with chunked_triton. "chunked": longmoe's portable fp32 core, counted tensor by tensor
    # (linear_attention_bytes; ~4x attention's saved set per token for Qwen3.5); "compiled":
    # the same core with its pieces compiled (`chunked_compiled`), counted the same way.
    linear_core: str = "kernel"


def param_split(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by where they live: per-layer dense/expert, embedding, head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out = cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1)
    attn = h * q_out + 2 * h * cfg.num_kv_heads * hd + cfg.num_heads * hd * h
    attn += 2 * hd if cfg.qk_norm else 0
    fs = cfg.shared_expert_ffn_size
    shared = 3 * h * fs + h if fs else 0
    # Hybrid models: the token mixer's parameters averaged over the layers (Gated DeltaNet and
    # full attention differ); the activation estimate below still assumes full attention.
    n_lin = sum(cfg.layer_type(i) == "linear_attention" for i in range(cfg.num_layers))
    if n_lin:
        attn = ((cfg.num_layers - n_lin) * attn + n_lin * cfg.linear_attention_params()) \
            / cfg.num_layers
    layer_dense = attn + shared + h * cfg.num_experts + 2 * h
    layer_experts = cfg.num_experts * 3 * h * cfg.moe_ffn_size
    return {"layer_dense": layer_dense, "layer_experts": layer_experts,
            "embed": cfg.vocab_size * h, "head": cfg.vocab_size * h + h}


def norm_bytes(cfg: ModelConfig, a: Assumptions = Assumptions()) -> dict[str, int]:
    """Bytes per token each kind of RMS norm keeps for backward on the default GPU path
    (impl.norm=auto on a GPU: the Triton kernels of longmoe/ops/kernels/norm_rows.py, which keep
    their input as it came and an fp32 1/rms a row, where the eager and compiled functions keep
    fp32 copies of it):
      rms    an H-wide norm (each layer's two, the head's): its input and 1/rms;
      qk     the q and k norms, RoPE fused in: q as q_proj's output holds it (with the output
             gate, that whole output: the saved view keeps the gate half alive), k, and 1/rms a
             head;
      gated  the Gated DeltaNet output norm: the core's output and z, 1/rms a value head.
    A norm's output is kept by the ops that read it and counted with them. tests/test_plan_norms.py
    checks each against what autograd keeps, the kernels run under TRITON_INTERPRET=1 on CPU."""
    b = a.compute_bytes
    q_out = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1)
    qk = b * (q_out + cfg.num_kv_heads * cfg.head_dim) + 4 * (cfg.num_heads + cfg.num_kv_heads)
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    return {"rms": b * cfg.hidden_size + 4, "qk": qk if cfg.qk_norm else 0,
            "gated": 2 * b * hv * dv + 4 * hv}


def activation_bytes(cfg: ModelConfig, a: Assumptions = Assumptions()) -> dict[str, float]:
    """Bytes per token (dense parts) and per routed row (MoE dispatch), counted from what
    longmoe.model saves for backward: the norms as their Triton kernels, the default GPU path,
    keep them (norm_bytes); SDPA keeps q, k, v, out and an fp32 log-sum-exp per head. The
    attention's input norm keeps the layer input itself: that is "layer_input" (stored under
    recompute; stored_none adds it without), so "attn" and "input_norm" count only its 1/rms."""
    b = a.compute_bytes
    H, E, F, Fs = cfg.hidden_size, cfg.num_experts, cfg.moe_ffn_size, cfg.shared_expert_ffn_size
    nd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    nb = norm_bytes(cfg, a)
    input_norm = nb["rms"] - b * H                          # 1/rms; its input: layer_input
    gate = b * nd if cfg.attn_output_gate else 0            # sigmoid(gate)
    # q/k norms run RoPE in their kernel (their outputs are SDPA's q and k); without them RoPE
    # runs eagerly: its inputs and outputs
    rope = 0 if cfg.qk_norm else 2 * b * (nd + kd)
    attn = (input_norm + b * H + nb["qk"] + gate + rope     # the norm's output: q/k/v_proj's input
            + b * (nd + 2 * kd) + b * nd + 4 * cfg.num_heads  # SDPA: q, k, v, out, lse
            + 2 * b * nd)                                   # gated output, o_proj input
    # The router keeps its bf16 input (the same tensor the shared expert keeps) and fp32 probs,
    # no fp32 copy of the input (RouterLogits casts again in backward).
    moe_dense = (nb["rms"] + b * H + 4 * E                 # the norm and its output
                 + (5 * b * Fs + b * H if Fs else 0))       # shared expert FFN and its gate
    # Per routed row: the grouped-GEMM input, the [2F] up/gate output (all SwiGLU keeps), its
    # product (the down GEMM's input), and the expert output the combine keeps for the routing
    # weights' gradient. The one-pass SwiGLU keeps only its input, not silu.
    routed_saved = 2 * b * H + 3 * b * F
    # Alive only around the dispatch/combine: the all-to-all send/recv copies and, in backward,
    # their gradients (three H-wide copies and the FFN gradient at once).
    routed_transient = 3 * b * H + 2 * b * F
    # keep_attention: what a fully recomputed attention layer keeps of the kernel (q, k, v, out,
    # lse) and the output gate's sigmoid, beside its input.
    attn_kernel = b * (nd + 2 * kd) + b * nd + 4 * cfg.num_heads + (b * nd if cfg.attn_output_gate else 0)
    out = {"layer_input": b * H, "input_norm": input_norm, "attn": attn, "attn_kernel": attn_kernel,
           "moe_dense": moe_dense,
           "routed_saved": routed_saved, "routed_transient": routed_transient, "linear_attn": 0}
    if a.linear_core in ("chunked", "compiled") and any(cfg.layer_type(i) == "linear_attention"
                                          for i in range(cfg.num_layers)):
        out["linear_attn"] = linear_attention_bytes(cfg, a)
    return out


def linear_attention_bytes(cfg: ModelConfig, a: Assumptions = Assumptions(), chunk: int = 64) -> int:
    """Bytes per token a Gated DeltaNet layer keeps for backward with our core
    (longmoe/ops/gated_delta.py), counted from its saved tensors, per value head in fp32:
      chunked   (eager) the [C, C] decay/attention/system/inverse matrices (7C), v-wide and
                k-wide chunk tensors (6 dv + 11 dk), the chunk states twice and the transitions
                (2 dk dv / C + dk^2 / C); per key head the normalised q/k (2 dk); in the compute
                dtype the conv input and output, the core's output and gate, and the norms.
      compiled  (`chunked_compiled`, what GPUs run) what inductor's partitioner keeps: 6C,
                3 dv + 7 dk, the states once and the transitions, ~6 per-token scalars; per key
                head 2 norms; in the compute dtype the layer input, the conv input and output,
                z, the core's output and the norm's output.
    tests/test_plan.py checks both against saved_tensors_hooks on CPU (the compiled one through
    the same partitioner inductor uses)."""
    b = a.compute_bytes
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, C = cfg.linear_key_head_dim, cfg.linear_value_head_dim, chunk
    conv_dim = 2 * hk * dk + hv * dv
    if a.linear_core == "compiled":
        fp32 = hv * (6 * C + 3 * dv + 7 * dk + dk * dv / C + dk * dk / C + 6) + 2 * hk
        return int(4 * fp32 + b * (2 * conv_dim + 3 * hv * dv + cfg.hidden_size))
    fp32 = hv * (7 * C + 6 * dv + 11 * dk + 2 * dk * dv / C + dk * dk / C) + 2 * hk * dk
    return int(4 * fp32 + b * (2 * conv_dim + 4 * hv * dv + 2 * cfg.hidden_size))


TERMS = ("params", "grads", "optimizer", "activations", "working", "dispatch", "logits", "comm",
         "margin")


@dataclass(frozen=True)
class MemoryBreakdown:
    """The terms alive together at the rank's peak moment (`phase`), so `peak` is their sum.
    FSDP2 gradients grow as backward proceeds while stored activations are freed, and the
    LM head's buffers are gone before the layers' backward starts: the phases differ."""
    layout: Layout
    workload: Workload
    stage: str                      # the pipeline stage that peaks: "only", "first" or "last"
    phase: str                      # "LM head", "layer backward", "embedding backward", "step"
    local_tokens: int               # T
    params: int
    grads: int
    optimizer: int
    activations: int                # stored between forward and backward
    working: int                    # the layer in backward (attention + MoE dense side)
    dispatch: int                   # MoE routed-row buffers
    logits: int
    comm: int
    margin: int
    notes: dict = field(default_factory=dict)

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def dynamic(self) -> int:
        return self.activations + self.working + self.dispatch + self.logits + self.comm

    @property
    def peak(self) -> int:
        return self.static + self.dynamic + self.margin

    def rows(self) -> list[tuple[str, int, str]]:
        n = self.notes
        return [
            ("params", self.params, n.get("params", "")),
            ("grads", self.grads, n.get("grads", "")),
            ("optimizer", self.optimizer, n.get("optimizer", "")),
            ("activations (stored)", self.activations, n.get("activations", "")),
            ("layer in backward", self.working, n.get("working", "")),
            ("MoE dispatch buffers", self.dispatch, n.get("dispatch", "")),
            ("logits / LM head", self.logits, n.get("logits", "")),
            ("communication buffers", self.comm, n.get("comm", "")),
            ("allocator margin", self.margin, n.get("margin", "")),
        ]

    def table(self) -> str:
        head = (f"per-rank memory, {self.layout.label}, {self.local_tokens:,} tokens/rank; "
                f"peak in the {self.stage} stage at {self.phase}")
        out = [head, f"  {'term':<24}{'GiB':>8}  how"]
        for name, v, note in self.rows():
            note = note if v or name == "grads" else f"not alive at this moment ({note})"
            out.append(f"  {name:<24}{v / GiB:>8.2f}  {note}")
        out.append(f"  {'peak':<24}{self.peak / GiB:>8.2f}  static {self.static / GiB:.2f} + "
                   f"dynamic {self.dynamic / GiB:.2f} + margin {self.margin / GiB:.2f}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "stage": self.stage, "phase": self.phase,
                "local_tokens": self.local_tokens,
                "terms_bytes": {k: getattr(self, k) for k in TERMS},
                "static_bytes": self.static, "dynamic_bytes": self.dynamic,
                "peak_bytes": self.peak}


def local_tokens(layout: Layout, w: Workload) -> int:
    return max(1, w.seq_len * w.micro_batch // (layout.cp * layout.tp))


def ep_chunks_for(w: Workload, tokens: int) -> int:
    if w.ep_chunks:
        return min(w.ep_chunks, tokens)
    from longmoe.tuning import default_chunks
    return default_chunks(tokens)


def _ce_chunk(w: Workload, tokens: int, vocab_local: int) -> int:
    if w.ce_chunk_tokens:
        return min(w.ce_chunk_tokens, tokens)
    # Same rule as longmoe.ops.linear_ce_chunks.engine_chunk_tokens for the default in-place
    # layout (not imported: that module needs torch, and the planner must answer in well under a
    # second): a 61 * 2^24-byte fp32 chunk, rounded down to a multiple of 128 tokens.
    c = 61 * 2**24 // (4 * vocab_local)
    if c >= 256:
        c -= c % 128
    return max(1, min(tokens, c))


def estimate(cfg: ModelConfig, layout: Layout, w: Workload,
             a: Assumptions = Assumptions()) -> MemoryBreakdown:
    """The peak over pipeline stages (first stage: most micro-batches in flight and the
    embedding; last stage: the LM head). Validity of the layout is checked by the planner."""
    stages = ["only"] if layout.pp == 1 else ["first", "last"]
    return max((estimate_stage(cfg, layout, w, a, s) for s in stages), key=lambda m: m.peak)


def moe_layer_bytes(cfg: ModelConfig, tokens: int, chunks: int, ep: int,
                    a: Assumptions = Assumptions()) -> int:
    """One MoE block's forward+backward alone (the seeds' single-layer experiment): its
    dense-side activations, routed-row buffers, this rank's experts in bf16 and their grads."""
    act = activation_bytes(cfg, a)
    rows = tokens * cfg.top_k * (a.moe_imbalance if ep > 1 else 1.0)
    dyn = tokens * (act["moe_dense"] + 2 * a.compute_bytes * cfg.hidden_size)
    dyn += rows * (act["routed_saved"] + act["routed_transient"] / max(1, chunks))
    weights = param_split(cfg)["layer_experts"] // ep * (a.compute_bytes + a.grad_bytes)
    return int(dyn * (1 + a.fragmentation) + weights)


def estimate_stage(cfg: ModelConfig, lay: Layout, w: Workload, a: Assumptions,
                   stage: str) -> MemoryBreakdown:
    """One pipeline stage ("only", "first" or "last"): every phase, the largest returned."""
    ps, act, b = param_split(cfg), activation_bytes(cfg, a), a.compute_bytes
    H, L = cfg.hidden_size, -(-cfg.num_layers // lay.pp)   # layers on the fullest stage
    first, last = stage in ("only", "first"), stage in ("only", "last")
    fsdp = w.sharding == "fsdp2"
    n: dict[str, str] = {}

    # ---- static: this rank's dense share (/TP) and experts (/EP, expert TP = 1)
    layers_dense, layers_exp = L * ps["layer_dense"] / lay.tp, L * ps["layer_experts"] / lay.ep
    embed = ps["embed"] / lay.tp if first else 0
    head = ps["head"] / lay.tp if last else 0
    dense = layers_dense + embed + head
    if fsdp:
        def shard(d, e):
            return d / lay.dp_cp + e / lay.edp

        params = a.master_bytes * shard(dense, layers_exp)
        optim = a.adam_bytes * shard(dense, layers_exp)
        g_head, g_embed = a.grad_bytes * shard(head, 0), a.grad_bytes * shard(embed, 0)
        g_layers = a.grad_bytes * shard(layers_dense, layers_exp)
        n["params"] = f"fp32 shards: dense over {lay.dp_cp} ranks, experts over {lay.edp} (FSDP2)"
        n["optimizer"] = "AdamW moments, fp32, sharded like the params"
    else:
        params = b * (dense + layers_exp)
        optim = (a.master_bytes + a.adam_bytes) * (dense / lay.dp_cp + layers_exp / lay.edp)
        n["params"] = "bf16, whole on every rank (distributed optimizer)"
        n["optimizer"] = (f"fp32 master + moments: dense over {lay.dp_cp} ranks, "
                          f"experts over {lay.edp}")

    # ---- activations
    T = local_tokens(lay, w)
    imbalance = a.moe_imbalance if lay.ep > 1 else 1.0     # EP=1: every row is this rank's
    rows = T * cfg.top_k * imbalance                       # routed rows on the busiest rank
    inflight = lay.pp if (first and lay.pp > 1) else 1     # 1F1B: stage 0 holds PP micro-batches
    routed = act["routed_saved"] * cfg.top_k * imbalance

    def stored_none(i: int) -> float:
        """What layer i keeps without recompute: its input (which its first norm keeps), its
        token mixer's saved set (a Gated DeltaNet layer keeps far more than attention with our
        core; linear_attn counts the first norm's output as its module's input), the MoE's dense
        part and rows."""
        linear = cfg.layer_type(i) == "linear_attention" and act["linear_attn"]
        mixer = act["linear_attn"] + act["input_norm"] if linear else act["attn"]
        return act["layer_input"] + mixer + act["moe_dense"] + routed

    keep = min(w.keep_last, L) if w.recompute != "none" else L
    if keep and w.recompute != "none" and lay.pp > 1:
        raise ConfigError("keep_last", "layers kept without recompute need PP=1")
    stored_tok = {"full": act["layer_input"],
                  "selective": act["layer_input"] + act["attn"], "none": 0}[w.recompute]
    kept_tok = sum(stored_none(i) for i in range(L - keep, L))   # per token, the kept layers
    attn_kept = 0
    if w.keep_attention and w.recompute == "full":
        attn_kept = act["attn_kernel"] * sum(cfg.layer_type(i) == "full_attention"
                                             for i in range(L - keep))
    per_mb = T * ((L - keep) * stored_tok + kept_tok + attn_kept)
    n["activations"] = (f"{w.recompute} recompute: {stored_tok / 1024:.1f} KiB/token/layer "
                        f"x {L - keep} layers" + (f" + the last {keep} kept: "
                                                  f"{kept_tok / 1024:.1f} KiB/token" if keep else "")
                        + (f" + attention kernels kept: {attn_kept / 1024:.1f} KiB/token"
                           if attn_kept else ""))
    working_none = T * 2 * b * max(H, cfg.num_heads * cfg.head_dim)   # gradient buffers only
    if w.recompute == "none":      # everything is stored; backward adds gradient buffers only
        working = working_none
    else:                          # the recomputed layer's saved set plus gradient buffers
        # the largest token mixer: a Gated DeltaNet layer's chunked core keeps far more per
        # token than attention does (activation_bytes: "linear_attn")
        mixer = max(act["attn"], act["linear_attn"] + act["input_norm"])
        side = act["moe_dense"] + (mixer if w.recompute == "full" else 0)
        working = T * (side + 2 * b * H)
    n["working"] = "recomputed layer's saved set + gradients" if w.recompute != "none" \
        else "gradient buffers"
    chunks = ep_chunks_for(w, T)
    saved_rows = 0 if w.recompute == "none" else act["routed_saved"]
    dispatch = rows * (saved_rows + act["routed_transient"] / chunks)
    n["dispatch"] = (f"{cfg.top_k} x {a.moe_imbalance} rows/token (top-k x imbalance); "
                     f"send/recv and their grads in {chunks} chunk(s)")

    # ---- LM head
    v_loc = -(-cfg.vocab_size // lay.tp)
    t_head = w.seq_len * w.micro_batch // lay.cp           # TP gathers the tokens for the head
    if w.linear_ce:
        c = _ce_chunk(w, t_head, v_loc)
        # The gradient is written over the chunk; dW and dH are the op's outputs in the compute
        # dtype (no fp32 accumulator): counted from the op's allocations (linear_ce_chunks.py).
        logits = c * v_loc * 4 + v_loc * H * b + t_head * H * b
        n["logits"] = f"linear CE: {c:,}-token fp32 chunk (gradient in place), dW and dH"
    else:
        # longmoe's naive path: fp32 copy of W, fp32 [T, V] logits and their gradient, fp32 dW.
        logits = t_head * v_loc * 8 + v_loc * H * 8 + t_head * H * 4
        n["logits"] = f"naive: fp32 [{t_head:,} x {v_loc:,}] logits + gradient, fp32 W and dW"

    # ---- communication
    p2p = 2 * T * H * b if lay.pp > 1 else 0
    ring = 4 * T * 2 * cfg.num_kv_heads * cfg.head_dim * b if lay.cp > 1 else 0
    unit = ps["layer_dense"] / lay.tp + ps["layer_experts"] / lay.ep
    # FSDP2 keeps the root (embedding) unsharded from forward to the end of backward, and the
    # head from its forward to its backward (longmoe.parallel.fsdp: reshard_after_forward=False).
    kept, kept_head = (embed * b, head * b) if fsdp else (0, 0)

    phases = []   # (phase, grads, activations, working, dispatch, logits, comm)
    if fsdp:
        # The unit being differentiated, gathered in bf16, and its fp32 grad for reduce-scatter;
        # at the start of backward the next unit is prefetched too (none is left at the end).
        unit_comm, unit_last = unit * (2 * b + 4), unit * (b + 4)
        # Backward walks the layers last to first: stored inputs are freed while sharded grads
        # appear, so their sum peaks at one end. With 1F1B micro-batches in flight (first stage)
        # the grads of earlier micro-batches are already there and the others' inputs are kept.
        lay_comm = unit_comm + kept + p2p + ring
        if inflight == 1 and 0 < keep < L:
            # By the first recomputed layer the kept layers' activations are gone and their
            # grads have appeared.
            phases.append(("layer backward (first recomputed)", g_head + g_layers * keep / L,
                           per_mb - T * kept_tok, working, dispatch, 0, lay_comm))
        if inflight == 1:
            # A kept layer goes first: gradient buffers only, its routed rows already stored.
            phases.append(("layer backward (start)", g_head, per_mb,
                           working_none if keep else working,
                           rows * act["routed_transient"] / chunks if keep else dispatch, 0,
                           lay_comm))
            phases.append(("layer backward (end)", g_head + g_layers * (L - 1) / L,
                           T * (stored_none(0) if keep >= L else stored_tok), working, dispatch,
                           0, unit_last + kept + p2p + ring))
        else:
            g_all = g_layers + g_head + g_embed
            phases.append(("layer backward", g_all, inflight * per_mb, working, dispatch, 0,
                           lay_comm))
        other = (inflight - 1) * per_mb
        if last:
            phases.append(("LM head", 0, per_mb, 0, 0, logits, kept + kept_head + p2p))
        if first:
            phases.append(("embedding backward", g_layers + g_head + g_embed, other, 0, 0, 0,
                           kept + embed * (b + 4)))
        n["comm"] = ("FSDP2: layer unit + prefetch (bf16), its fp32 grad for reduce-scatter, "
                     "embedding/head kept whole")
    else:
        g = a.grad_bytes * (dense + layers_exp)
        n["grads"] = f"main grads, {a.grad_bytes} B/param, whole"
        base = inflight * per_mb
        comm = a.dist_opt_bucket_bytes + p2p + ring
        phases.append(("layer backward", g, base, working, dispatch, 0, comm))
        if last:
            phases.append(("LM head", g, base, 0, 0, logits, comm))
        n["comm"] = "gradient reduce buckets, pipeline and CP buffers"
    n.setdefault("grads", "fp32 shards produced as backward proceeds (FSDP2)")
    n["margin"] = f"{a.fragmentation:.0%} of the dynamic bytes (allocator fragmentation)"

    if fsdp and w.grad_sync == "step" and lay.dp_cp * lay.pp > 1:
        # Deferred reduction: the unsharded fp32 gradient of every local parameter lives from
        # the first micro-batch's backward to the last one's (freed unit by unit there; counted
        # whole in every phase).
        whole = a.grad_bytes * (dense + layers_exp)
        phases = [(ph, g + whole, *rest) for ph, g, *rest in phases]
        n["grads"] = (f"fp32 shards + the unsharded fp32 gradients kept across micro-batches "
                      f"({whole / GiB:.1f} GiB, grad_sync=step)")
    best = None
    for phase, g, acts, wk, dsp, lg, cm in phases:
        parts = [int(x) for x in (params, g, optim, acts, wk, dsp, lg, cm)]
        margin = int(a.fragmentation * sum(parts[3:]))
        m = MemoryBreakdown(lay, w, stage, phase, T, *parts, margin, n)
        if best is None or m.peak > best.peak:
            best = m
    return best
