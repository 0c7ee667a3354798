"""The gated delta rule (Gated DeltaNet's token mixer), per value head:

    S_t = exp(g_t) * S_{t-1}                       decay      (S: [dk, dv] state)
    u_t = beta_t * (v_t - S_t^T k_t)               delta      (what the state mispredicts)
    S_t = S_t + k_t u_t^T                          write
    o_t = S_t^T q_t                                read

q and k are L2-normalised per head and q is scaled by dk^-1/2. Key heads are shared by groups of
value heads (GQA-style). Packed rows pass `starts` [B, T] (True where a sample begins): the state
is zeroed before such a token's decay, so no sample reads another's writes; a start at t = 0
drops the initial state of that row. Legend: B batch, T tokens, Hk key heads, Hv value heads,
C chunk length.

Implementations (registry "gated_delta"):
  reference  one token at a time: the definition above (slow; tests only).
  chunked    chunks of C tokens: within a chunk the writes are solved at once with a unit-lower-
             triangular system (WY form), across chunks the state is carried by an affine
             recurrence with its own backward (AffineScan); all fp32. Runs
             everywhere and takes an initial state, which context parallelism needs.
  chunked_compiled
             the same with its batched pieces under torch.compile (GPUs): inductor fuses the
             elementwise chains between the GEMMs. At 64K tokens on an H200, fwd+bwd with TF32
             and the Triton scan takes 68.6 ms against the eager fp32 form's 193
             (`longmoe bench gated-delta`; causal SDPA of Qwen3.5's attention layer: 276 ms).
  chunked_triton
             the chunked form as fused Triton kernels of our own, forward and backward
             (ops/kernels/gated_delta_fwd.py, gated_delta_bwd.py, launched by
             gated_delta_chunk.py): per chunk the WY solve, w, u and the output on tensor cores
             in the inputs' dtype with fp32 accumulation; the state in fp32 registers of one
             sequential pass per (head, value-column block) each way; the backward reads
             what the forward made (gamma, Tinv, w, the chunk states, v_new); the q/k norms one
             fused row kernel each way (ops/kernels/l2norm_rows.py). GPUs with Triton, or
             CPU under TRITON_INTERPRET=1; power-of-two dk, dv >= 16. On an H200 at 32K / 64K
             tokens: forward 1.06x / 1.15x fla's, forward+backward 3.5x / 3.9x fla's forward
             (results/h200/gated_delta_triton.json).
  fla        flash-linear-attention's Triton kernel (`fla.ops.gated_delta_rule`) when the package
             is installed and the tensors are on a GPU.
"""

from __future__ import annotations

import torch

from longmoe.ops.compiled import compile_unavailable, compiled
from longmoe.ops.registry import Registry, trial_call

GATED_DELTA = Registry("gated_delta", renamed={"recurrent": "reference"})


class AffineScan(torch.autograd.Function):
    """S_{c+1} = M_c S_c + N_c for c = 0..n-1, returning all n+1 states [n+1, b, dk, dv].

    Where Triton runs, each direction is one kernel launch (ops/kernels/affine_scan.py: 8.9 ms
    for forward + adjoint at 64K tokens on an H200, against 31.4 ms for the loop); elsewhere one
    in-place baddbmm per step each way. Autograd of the plain loop would keep every step's state
    twice (the baddbmm's input and the stacked copy) and run ~3 kernels per step in the backward;
    here the forward writes the states into one buffer, the backward runs the adjoint recurrence
    dS_c = g_c + M_c^T dS_{c+1}, then gets every dM_c = dS_{c+1} S_c^T in one batched GEMM.
    Saved: M and the states."""

    @staticmethod
    def forward(ctx, trans, inject, s0):
        n = trans.shape[0]
        states = s0.new_empty((n + 1,) + tuple(s0.shape))
        states[0] = s0
        kernel = _scan_kernel(trans)
        if kernel:
            kernel(trans.contiguous(), inject.contiguous(), states, adjoint=False)
        else:
            states[1:] = inject  # one copy up front; each step then adds its product in place
            for c in range(n):
                states[c + 1].baddbmm_(trans[c], states[c])
        ctx.save_for_backward(trans, states)
        return states

    @staticmethod
    def backward(ctx, g):
        trans, states = ctx.saved_tensors
        n = trans.shape[0]
        kernel = _scan_kernel(trans)
        if kernel:
            g = g.contiguous()
            d = torch.empty_like(states)
            d[n] = g[n]
            kernel(trans.contiguous(), g, d, adjoint=True)
        else:
            d = g.clone(memory_format=torch.contiguous_format)
            trans_t = trans.transpose(-1, -2)
            for c in range(n - 1, -1, -1):
                d[c].baddbmm_(trans_t[c], d[c + 1])
        d_next = d[1:]
        d_trans = d_next @ states[:-1].transpose(-1, -2)
        return d_trans, d_next, d[0]


def _scan_kernel(trans):
    """The one-launch Triton scan where Triton runs (GPUs, or CPU under TRITON_INTERPRET=1), for
    fp32 states with a power-of-two dk >= 16 (Qwen3.5: 128); None means the baddbmm loop. Tiles
    and the fast fp32 dot (TF32 where the GPU has it) come from the backend's table; torch's
    "highest" fp32 matmul precision keeps IEEE fp32."""
    from longmoe.ops.kernels import triton_ready
    D = trans.shape[-1]
    if trans.dtype != torch.float32 or D < 16 or D & (D - 1) or triton_ready(trans.device):
        return None
    from longmoe.backends import active_backend
    from longmoe.ops.kernels.affine_scan import affine_scan
    cfg = active_backend().kernel_config("affine_scan")
    precision = ("ieee" if torch.get_float32_matmul_precision() == "highest"
                 else cfg.get("fp32_fast", "ieee"))
    return lambda t, a, out, adjoint: affine_scan(t, a, out, adjoint, cfg, precision)


def affine_scan_reference(trans, inject, s0):
    """The plain loop AffineScan is paired against."""
    out = [s0]
    for c in range(trans.shape[0]):
        out.append(trans[c] @ out[-1] + inject[c])
    return torch.stack(out)


L2_EPS = 1e-6


class L2Norm(torch.autograd.Function):
    """x * rsqrt(|x|^2 + eps) over the last dim, as transformers' Qwen3.5 and fla's in-kernel
    l2norm compute it (not F.normalize's x / max(|x|, eps): the two differ by ~eps/|x|^2, 5e-3 in
    the logits of a model at init_std 0.02, so the rollout engine's log-probs and ours would
    disagree). Saves x and the per-row scale only, as F.normalize's graph does."""

    @staticmethod
    def forward(ctx, x, eps: float = L2_EPS):
        r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r)
        return x * r

    @staticmethod
    def backward(ctx, dy):
        x, r = ctx.saved_tensors
        y = x * r
        return r * (dy - y * (dy * y).sum(-1, keepdim=True)), None


def _prep(q, k, v, g, beta):
    """fp32 [B, Hv, T, d] layouts, normalised q/k with key heads repeated per value head."""
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} are not a multiple of key heads {Hk}")
    q, k = (L2Norm.apply(x.float()) for x in (q, k))
    if Hv != Hk:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    tr = lambda x: x.transpose(1, 2).float()  # noqa: E731
    return tr(q), tr(k), tr(v), g.float().transpose(1, 2), beta.float().transpose(1, 2)


@GATED_DELTA.register("reference", priority=0, reference=True)
def _recurrent(q, k, v, g, beta, initial_state=None, starts=None):
    q, k, v, g, beta = _prep(q, k, v, g, beta)
    B, Hv, T, dk = k.shape
    S = (q.new_zeros(B, Hv, dk, v.shape[-1]) if initial_state is None
         else initial_state.float().clone())
    outs = []
    for t in range(T):
        if starts is not None:
            S = torch.where(starts[:, t, None, None, None], 0.0, S)
        S = S * g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(outs, 2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2), S


def _chunk_terms(q, k, v, g, beta, chunk: int, starts=None):
    """Everything of the chunked form that is batched over chunks, before the state recurrence:
    returns (trans M, inject N, read, attn, u_part), each chunk-major [n, B*Hv, ...] and
    contiguous, so each step of the recurrence reads one dense block and the output's GEMMs
    batch over n*B*Hv without a copy of the states (compiled, the layout comes with the
    kernels that write these tensors).

    With `starts`, a chunk is cut into the segments its sample starts delimit; every term below
    is the same sum restricted to one segment, so it stays exact: pairs (i, j) of different
    segments drop out of the decay matrix (no write or read crosses a start), only tokens before
    the chunk's first start see its start state, only the last segment's writes reach its end
    state, and a chunk holding a start carries nothing of its start state across (M's decay is
    zero, and the k_end^T W product vanishes since the two never share a segment)."""
    q, k, v, g, beta = _prep(q, k, v, g, beta)
    B, Hv, T, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:  # padded steps: g = 0 (no decay), beta = 0 (no write); their outputs are dropped
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
        if starts is not None:
            starts = torch.nn.functional.pad(starts, (0, pad))
    n = (T + pad) // chunk
    sh = lambda x: x.reshape(B, Hv, n, chunk, *x.shape[3:])  # noqa: E731
    q, k, v, g, beta = sh(q), sh(k), sh(v), sh(g), sh(beta)
    # Cumulative log decay in fp64: strong decay (g ~ -20 per token) drives gamma to ~-1e3 within
    # a chunk, and in fp32 the differences gamma_i - gamma_j of such numbers keep only ~4 digits,
    # which showed up as 3% errors in the gradient of g. The differences are exact enough in fp64.
    gam64 = g.double().cumsum(-1)                                 # [B, Hv, n, C]
    diff = (gam64[..., :, None] - gam64[..., None, :]).float()    # gamma_i - gamma_j
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    first = last = carry = None
    if starts is not None:
        seg = starts.view(B, 1, n, chunk).cumsum(-1)                 # segment within the chunk
        lower = lower & (seg[..., :, None] == seg[..., None, :])    # [B, 1, n, C, C]
        first = (seg == 0).float()                  # reads/overwrites the chunk's start state
        last = (seg == seg[..., -1:]).float()       # writes that reach the chunk's end state
        carry = (seg[..., -1] == 0).float()[..., None, None]    # no start: S_c carries across
    decay = torch.where(lower, diff, torch.full_like(diff, float("-inf"))).exp()  # j <= i
    kk = k @ k.transpose(-1, -2)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    # (I + L) with L_ij = beta_i exp(gamma_i - gamma_j) k_i.k_j for j < i
    system = beta[..., None] * kk * decay * strict + torch.eye(chunk, device=q.device)
    # (I + L)^-1 explicitly, then GEMMs: a triangular solve costs in proportion to its right-hand
    # columns, and the inverse has C of them where [beta v | beta e^gamma k] has dv + dk (4x at
    # C = 64, dk = dv = 128), in the forward and again in the backward. Unit lower-triangular
    # with |L_ij| <= 1, the system is as well conditioned as the solve it replaces.
    eye = torch.eye(chunk, device=q.device).expand_as(system)
    inv = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u_part = inv @ (beta[..., None] * v)                          # U = u_part - W @ S0
    gam_exp = gam64.exp().float()
    if first is not None:
        gam_exp = gam_exp * first
    w = inv @ ((beta * gam_exp)[..., None] * k)
    attn = (q @ k.transpose(-1, -2)) * decay                      # j <= i
    q_dec = q * gam_exp[..., None]
    to_end = (gam64[..., -1:] - gam64).float().exp()
    k_end = k * (to_end if last is None else to_end * last)[..., None]
    # Chunk c, from its start state S_c: U_c = u_part_c - W_c S_c,
    #   o_c     = q_dec_c S_c + attn_c U_c = (q_dec_c - attn_c W_c) S_c + attn_c u_part_c
    #   S_{c+1} = d_c S_c + k_end_c^T U_c  = (d_c I - k_end_c^T W_c) S_c + k_end_c^T u_part_c
    # Everything but the affine state recurrence S_{c+1} = M_c S_c + N_c is batched over chunks,
    # and that recurrence (AffineScan) is one baddbmm per chunk each way instead of ~8 small
    # kernels: at 32K tokens the loop's 512 steps of launches, not the GPU, set the layer's time.
    k_end_t = k_end.transpose(-1, -2)                             # [B, Hv, n, dk, C]
    step_decay = gam64[..., -1].exp().float()[..., None, None]    # [B, Hv, n, 1, 1]
    if carry is not None:
        step_decay = step_decay * carry
    trans = step_decay * torch.eye(dk, device=q.device) - k_end_t @ w        # M: [.., dk, dk]
    inject = k_end_t @ u_part                                               # N: [.., dk, dv]
    read = q_dec - attn @ w                                                 # [.., C, dk]
    cm = lambda x: x.flatten(0, 1).transpose(0, 1).contiguous()  # noqa: E731
    return cm(trans), cm(inject), cm(read), cm(attn), cm(u_part)


def _chunk_output(read, S_starts, attn, u_part, B: int, T: int):
    """o for every chunk from its start state, chunk-major in, [B, T, Hv, dv] out."""
    n, BH, C, dv = u_part.shape
    o = read @ S_starts + attn @ u_part                           # [n, B*Hv, C, dv]
    o = o.view(n, B, BH // B, C, dv).permute(1, 0, 3, 2, 4)       # [B, n, C, Hv, dv]
    return o.reshape(B, n * C, BH // B, dv)[:, :T]


def _chunked_with(terms, output, q, k, v, g, beta, initial_state, chunk, starts=None):
    B, T, Hv, dv = v.shape
    dk = q.shape[-1]
    trans, inject, read, attn, u_part = terms(q, k, v, g, beta, chunk, starts)
    n = trans.shape[0]
    S0 = (read.new_zeros(B * Hv, dk, dv) if initial_state is None
          else initial_state.float().reshape(B * Hv, dk, dv))
    states = AffineScan.apply(trans, inject, S0)                  # [n + 1, B*Hv, dk, dv]
    o = output(read, states[:n], attn, u_part, B, T)
    return o, states[n].view(B, Hv, dk, dv)


@GATED_DELTA.register("chunked", priority=5)
def _chunked(q, k, v, g, beta, initial_state=None, chunk: int = 64, starts=None):
    return _chunked_with(_chunk_terms, _chunk_output, q, k, v, g, beta, initial_state, chunk,
                         starts)


def _compiled_check(q, k, v, g, beta, initial_state=None):
    return compile_unavailable(q.device)


@GATED_DELTA.register("chunked_compiled", priority=7, check=_compiled_check)
def _chunked_compiled(q, k, v, g, beta, initial_state=None, chunk: int = 64, starts=None):
    # The recurrence between the pieces stays eager: compiled, its loop of n steps would
    # unroll into n graph nodes.
    return _chunked_with(compiled(_chunk_terms), compiled(_chunk_output), q, k, v, g, beta,
                         initial_state, chunk, starts)


def _triton_check(q, k, v, g, beta, initial_state=None):
    from longmoe.ops.kernels import triton_ready
    why = triton_ready(q.device)
    if why:
        return why
    for name, d in (("dk", q.shape[-1]), ("dv", v.shape[-1])):
        if d < 16 or d & (d - 1):
            return f"{name} = {d}: the Triton core needs a power of two >= 16"
    if any(x.dtype not in (torch.float32, torch.bfloat16, torch.float16) for x in (q, k, v)):
        return "the Triton core takes fp32, bf16 or fp16 q/k/v"
    return None


@GATED_DELTA.register("chunked_triton", priority=8, check=_triton_check)
def _chunked_triton(q, k, v, g, beta, initial_state=None, starts=None, cu_seqlens=None,
                    out_dtype=None):
    # cu_seqlens: the same boundaries as starts, which the kernels read directly
    from longmoe.ops.kernels.gated_delta_chunk import chunked_gated_delta
    from longmoe.ops.kernels.l2norm_rows import l2norm_rows
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} are not a multiple of key heads {Hk}")
    # the dots run in the inputs' dtype (bf16 in training) with fp32 accumulation; the norms in
    # fp32, rounded once to that dtype, fused (L2Norm's eager chain cost ~1.5 ms of forward and
    # ~4.5 ms of forward+backward at 32K tokens on an H200, over a third of the core)
    dt = q.dtype if q.dtype == k.dtype == v.dtype else torch.float32
    qn = l2norm_rows(q, q.shape[-1] ** -0.5, dt, L2_EPS)
    kn = l2norm_rows(k, 1.0, dt, L2_EPS)
    return chunked_gated_delta(qn, kn, v.to(dt), g, beta, initial_state, starts,
                               out_dtype=out_dtype or torch.float32)


_FLA_TRIAL: dict[str, str | None] = {}


def _fla_check(q, k, v, g, beta, initial_state=None):
    if q.device.type == "cpu":
        return "fla's Triton kernels need a GPU"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"flash-linear-attention not importable ({type(e).__name__})"
    return _fla_trial(q.device)


def _fla_trial(device) -> str | None:
    """fla refuses some kernel paths on some GPU/Triton pairs at call time (e.g. its gated
    backward on Triton 3.4-3.7.0 for one architecture, fla issue #640): one tiny forward and
    backward per device decides, once, whether the fast path is usable here."""
    key = str(device)
    if key not in _FLA_TRIAL:
        try:
            with trial_call():
                t = [torch.randn(1, 64, 1, 16, device=device, requires_grad=True)
                     for _ in range(3)]
                g = torch.zeros(1, 64, 1, device=device, requires_grad=True)
                b = torch.full((1, 64, 1), 0.5, device=device, requires_grad=True)
                o, _ = _fla(t[0], t[1], t[2], g, b)
                o.sum().backward()
            _FLA_TRIAL[key] = None
        except Exception as e:  # noqa: BLE001 - any refusal means "use another implementation"
            _FLA_TRIAL[key] = f"flash-linear-attention refused a trial call: {str(e)[:160]}"
    return _FLA_TRIAL[key]


@GATED_DELTA.register("fla", priority=10, check=_fla_check)
def _fla(q, k, v, g, beta, initial_state=None, starts=None, cu_seqlens=None, out_dtype=None):
    # fla returns o in the inputs' dtype: kept as it is when the caller asks for that one
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    Hk, Hv = k.shape[2], v.shape[2]
    if Hv != Hk:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    if starts is None:
        o, S = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta,
                                      initial_state=initial_state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        return o.to(out_dtype or torch.float32), S
    o, S = _fla_packed(chunk_gated_delta_rule, q, k, v, g, beta, initial_state, starts,
                       cu_seqlens)
    return o.to(out_dtype or torch.float32), S


def _fla_packed(kernel, q, k, v, g, beta, initial_state, starts, cu_seqlens):
    """fla's variable-length form: the rows flattened into one, every segment (a run from one
    start, or a row's first token, to the next) its own sequence with its own initial state.
    A row's initial state seeds its first segment unless a sample starts right there; its final
    state is that of its last segment."""
    B, T = starts.shape
    bounds = starts.clone()
    bounds[:, 0] = True
    if cu_seqlens is None:
        first = bounds.reshape(-1).nonzero()[:, 0]
        cu_seqlens = torch.cat([first, first.new_full((1,), B * T)])
    cu_seqlens = cu_seqlens.long()
    per_row = bounds.sum(1)
    row_first = per_row.cumsum(0) - per_row                    # each row's first segment
    flat = lambda x: x.reshape((1, B * T) + tuple(x.shape[2:]))  # noqa: E731
    h0 = None
    if initial_state is not None:
        n, (Hv, dk, dv) = cu_seqlens.numel() - 1, initial_state.shape[1:]
        seed = initial_state.float() * (~starts[:, 0]).float()[:, None, None, None]
        h0 = seed.new_zeros(n, Hv, dk, dv).index_copy(0, row_first, seed)
    o, S = kernel(flat(q), flat(k), flat(v), g=flat(g.float()), beta=flat(beta),
                  initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=cu_seqlens)
    return o.view(v.shape), S[row_first + per_row - 1]


def gated_delta_rule(q, k, v, g, beta, initial_state=None, impl: str = "auto", starts=None,
                     cu_seqlens=None, out_dtype=None):
    """(o [B, T, Hv, dv] in out_dtype (default fp32), final state [B, Hv, dk, dv] fp32).
    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g (log decay, <= 0) and beta: [B, T, Hv].
    `starts` [B, T] bool: reset the state before these tokens (packed rows); `cu_seqlens`
    (optional, for fla): the flattened boundaries of the segments `starts` gives with every
    row's first token a boundary. `out_dtype`: o rounded once from fp32, as the layer's norm
    takes it (the Triton core writes it so directly: half the bytes of o, and of its gradient,
    through memory)."""
    fn = GATED_DELTA.select(impl, q, k, v, g, beta, initial_state).fn
    kw = {"out_dtype": out_dtype} if fn in (_chunked_triton, _fla) else {}
    if starts is not None:
        if starts.shape != q.shape[:2] or starts.dtype != torch.bool:
            raise ValueError(f"starts must be bool {tuple(q.shape[:2])}, got {starts.dtype} "
                             f"{tuple(starts.shape)}")
        kw.update(starts=starts, **({"cu_seqlens": cu_seqlens} if fn is _fla else {}))
    o, S = fn(q, k, v, g, beta, initial_state=initial_state, **kw)
    return (o if out_dtype is None else o.to(out_dtype)), S


def gated_delta_choice(device, impl: str = "auto") -> dict:
    """Which core `impl` runs on `device` and why the faster ones do not (a tiny input: on a GPU
    this may run fla's one trial call), the state scan it uses, and the memory assumption that
    plans for it (`longmoe recipe --linear-core`)."""
    q = torch.zeros(1, 64, 1, 16, device=device)
    g = torch.zeros(1, 64, 1, device=device)
    args = (q, q, q, g, g)
    skipped, name = {}, impl
    if impl == "auto":
        for name in GATED_DELTA.names():
            why = GATED_DELTA.why_not(name, *args)
            if why is None:
                break
            skipped[name] = why
    # the fused cores' saved set is planned as one (plan/memory.py's "kernel"; what ours keeps:
    # ops/kernels/gated_delta_chunk.py)
    core = {"fla": "kernel", "chunked_triton": "kernel", "chunked_compiled": "compiled"}.get(
        name, "chunked")
    scan = _scan_kernel(torch.zeros(1, 1, 16, 16, device=device))
    return {"asked": impl, "core": name, "skipped": skipped, "recipe_linear_core": core,
            "state_scan": "triton kernel" if scan else "loop of baddbmm steps"}
