"""Kimi Delta Attention (KDA) math kernels in pure PyTorch.

KDA is a gated delta rule with a *per-channel* decay. With a state S of shape [K, V] per head, each token does

    S <- diag(exp(g_t)) S                       (per-channel forget)
    S <- S + beta_t * k_t (v_t - S^T k_t)^T     (delta-rule write)
    o_t = S^T q_t

`kda_recurrent` is that loop verbatim (the oracle, and the decode path). `kda_chunked` computes the same thing in the
chunked WY/UT form used by fla: everything inside a chunk is batched matmuls plus one unit-lower-triangular solve for
all chunks at once, and only a [K, K] x [K, V] affine state recurrence runs as a Python loop over chunks.

Both are device agnostic, compute in fp32 whatever the (lower-precision) input dtype and return fp32 (fp64 inputs stay
fp64, so float64 gradcheck is meaningful), and are plain autograd graphs (no in-place writes into tensors autograd
needs), so training can backprop through `kda_chunked`.

Layout convention (matches transformers / fla): q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
state: [B, H, K, V]. q and k must already be L2-normalised and q already scaled by K**-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kestrel.models.layers import kda_kernel
from kestrel.models.layers.constants import fp32_scalar


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs (the recurrent state is too rounding-sensitive for less); fp64 stays fp64."""
    dt = torch.float32
    for x in xs:
        dt = torch.promote_types(dt, x.dtype)
    return dt


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x*x, -1) + eps) — matches fla / transformers' l2norm exactly.

    `+ eps` inside the sqrt (not F.normalize's clamp) is what the fla Triton kernel does. Computed in fp32 (fla
    normalises after the fp32 cast; fp64 stays fp64) and returned in x's dtype, so fp32 inputs are bit-identical to
    transformers.
    """
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    eps_operand = fp32_scalar(eps) if xf.dtype == torch.float32 else eps  # see constants.py
    out = xf / torch.sqrt((xf * xf).sum(dim=-1, keepdim=True) + eps_operand)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _initial_state(state: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The given [B, H, K, V] state in the compute dtype, or zeros shaped from k: [B, T, H, K] and v: [B, T, H, V]."""
    if state is None:
        B, _, H, K = k.shape
        return torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=k.device)
    return state.to(dtype)


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA. q, k: [B, T, H, K] (already L2-normalised; q already scaled by K**-0.5);
    v: [B, T, H, V]; g: [B, T, H, K] per-channel log-decay (<= 0); beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros). Returns (o [B, T, H, V] fp32, final_state [B, H, K, V] fp32).
    Per token: S <- diag(exp(g_t)) S ; S <- S + beta_t * k_t (v_t - S^T k_t)^T ; o_t = S^T q_t."""
    dt = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    S = _initial_state(initial_state, k, v, dt)
    outs = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = S * g[:, t].exp().unsqueeze(-1)  # decay each key channel (row of S)
        kv_mem = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # S^T k_t: what the state currently recalls for k_t
        delta = beta[:, t].unsqueeze(-1) * (v_t - kv_mem)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)  # rank-1 write k_t delta^T
        outs.append((q_t.unsqueeze(-2) @ S).squeeze(-2))  # S^T q_t
    if not outs:
        return v.new_zeros(v.shape), S
    return torch.stack(outs, dim=1), S


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of `kda_recurrent` for a batch of sequences (the decode form), reading the state once.

    With e = exp(g): the decayed state's recall is (k⊙e)ᵀS, and the output of the updated state is
    (q⊙e)ᵀS + (q·k)·delta, so one batched matmul against the old S serves both and S is written once.
    q, k, g: [B, H, K] fp32; v: [B, H, V]; beta: [B, H]; state: [B, H, K, V] fp32. Returns (o [B, H, V], state);
    `in_place` updates the given state tensor (the same values: each element is decayed, then written, either way).
    On CPU in fp32 outside autograd the compiled loop (`kda_kernel`) does the same arithmetic.
    """
    if kda_kernel.applies(q, state):
        final = state if in_place else torch.empty_like(state)
        return kda_kernel.steps(q, k, v, g, beta, state, {}, final), final
    decay = g.exp()
    read = torch.matmul(torch.stack([k * decay, q * decay], dim=-2), state)  # [B, H, 2, V]
    delta = ((v if v.dtype == state.dtype else v.to(state.dtype)) - read[..., 0, :]) * beta.unsqueeze(-1)
    o = torch.addcmul(read[..., 1, :], (q * k).sum(-1, keepdim=True), delta)
    decayed = state.mul_(decay.unsqueeze(-1)) if in_place else state * decay.unsqueeze(-1)
    state = decayed.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))  # decay, + k deltaᵀ
    return o, state


def kda_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_after: list[int] | None = None,
    out: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`kda_step` over T tokens (short prefills, verify blocks): everything not touching S is computed for all
    tokens at once, so each token costs one matmul and three updates. Same layout and contract as kda_recurrent.

    keep_after: token indices after which the whole-batch state is also returned (in that order). out: token index
    -> a tensor (e.g. a view of a pool slot) the state after that token is written into instead of a new one; the
    arithmetic is the same. Returns (o [B, T, H, V], final state, kept states). On CPU in fp32 outside autograd the
    compiled loop (`kda_kernel`) does the same arithmetic.
    """
    into = out or {}
    if q.shape[1] and state is not None and kda_kernel.applies(q, state, *into.values()):
        return _kernel_steps(q, k, v, g, beta, state, keep_after or [], into)
    dt = _compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    state = _initial_state(state, k, v, dt)
    decay = g.exp()
    reads = torch.stack([k * decay, q * decay], dim=-2).unbind(1)  # per token [B, H, 2, K]
    vs, betas, ks, decays = v.unbind(1), beta.unsqueeze(-1).unbind(1), k.unsqueeze(-1).unbind(1), decay.unsqueeze(-1)
    decays = decays.unbind(1)
    wanted = set(keep_after or ())
    recalls, deltas, kept = [], [], {}
    for t in range(q.shape[1]):
        read = torch.matmul(reads[t], state)  # [B, H, 2, V]: the decayed state's recall of k_t, and of q_t
        delta = (vs[t] - read[..., 0, :]) * betas[t]
        recalls.append(read)
        deltas.append(delta)
        decayed = state * decays[t] if t not in into else torch.mul(state, decays[t], out=into[t])
        state = decayed.addcmul_(ks[t], delta.unsqueeze(-2))
        if t in wanted:
            kept[t] = state
    if not recalls:
        return v.new_zeros(v.shape), state, []
    # o_t = (q⊙e)ᵀS_{t-1} + (q·k) delta_t for all tokens at once (the same elementwise ops as per token)
    qk = (q * k).sum(-1, keepdim=True)
    o = torch.addcmul(torch.stack(recalls, dim=1)[..., 1, :], qk, torch.stack(deltas, dim=1))
    return o, state, [kept[t] for t in keep_after or ()]


def _kernel_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_after: list[int],
    out: dict[int, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`kda_steps` through the compiled loop: the same buffers (`out`'s, new ones for `keep_after`) receive the
    states, the last token's state goes straight into its `out` tensor when it has one."""
    last = q.shape[1] - 1
    into = dict(out)
    final = into.pop(last, None)
    if final is None:
        final = torch.empty_like(state)
    for t in keep_after:
        if t != last and t not in into:
            into[t] = torch.empty_like(state)
    o = kda_kernel.steps(q, k, v, g, beta, state, into, final)
    return o, final, [final if t == last else into[t] for t in keep_after]


def _intra_chunk_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """P[..., i, j] = sum_c x_i[c] k_j[c] exp(G_i[c] - G_j[c]) for j <= i (0 above the diagonal), per chunk.

    x: [..., n, C, K] (n stacked left operands, here k and q), k, G: [..., C, K] with G the in-chunk cumulative
    log-decay (non-increasing along C). Returns [..., n, C, C].

    exp(G_i - G_j) is only safe for i >= j (exponent <= 0); the one-matmul factorisation exp(G_i) * exp(-G_j)
    overflows for strong decays. Instead split the chunk recursively in halves: for i in the second half and j in the
    first half of a block, the last token r of the first half satisfies j <= r <= i, so
        exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j)
    is a product of two factors <= 1 and the whole off-diagonal block is one matmul (if a factor underflows, the exact
    value is smaller still). Only the leaves (size = odd part of C, i.e. 1 for power-of-two chunks) are formed
    elementwise, masking j > i to -inf *before* the exp. No positive exponent is ever evaluated.
    """
    *lead, n, C, K = x.shape
    leaf = C // (C & -C)  # odd part of C
    nl = C // leaf
    P = x.new_zeros(*lead, n, C, C)

    if leaf == 1:  # the diagonal itself: exp(G_i - G_i) = 1 exactly
        torch.diagonal(P, dim1=-2, dim2=-1).copy_((x * k.unsqueeze(-3)).sum(-1))
    else:  # leaves on the diagonal: [.., nl, i, j, K] decay, masked before exp
        Gl = G.reshape(*lead, nl, leaf, K)
        upper = torch.ones(leaf, leaf, dtype=torch.bool, device=x.device).triu(1)
        decay = (Gl.unsqueeze(-2) - Gl.unsqueeze(-3)).masked_fill(upper[:, :, None], float("-inf")).exp()
        leaves = (x.reshape(*lead, n, nl, leaf, 1, K) * (k.reshape(*lead, nl, 1, leaf, K) * decay).unsqueeze(-5)).sum(
            -1
        )
        # Write the blocks into P's block diagonal (a fresh buffer with disjoint writes: autograd-safe).
        torch.diagonal(P.view(*lead, n, nl, leaf, nl, leaf), dim1=-4, dim2=-2).copy_(leaves.movedim(-3, -1))

    s = leaf
    while s < C:  # merge pairs of size-s blocks into size-2s blocks: fill the lower-left s x s quadrant
        nb = C // (2 * s)
        Gb = G.reshape(*lead, nb, 2, s, K)
        G_r = Gb[..., 0, -1:, :]  # [.., nb, 1, K] at the last token of the first half
        left = x.reshape(*lead, n, nb, 2, s, K)[..., 1, :, :] * (Gb[..., 1, :, :] - G_r).exp().unsqueeze(-4)
        right = k.reshape(*lead, nb, 2, s, K)[..., 0, :, :] * (G_r - Gb[..., 0, :, :]).exp()
        cross = left @ right.unsqueeze(-4).transpose(-1, -2)  # [.., n, nb, s (i), s (j)]
        blocks = torch.diagonal(P.view(*lead, n, nb, 2, s, nb, 2, s), dim1=-6, dim2=-3)  # [.., n, 2, s, 2, s, nb]
        blocks[..., 1, :, 0, :, :].copy_(cross.movedim(-3, -1))
        s *= 2
    return P


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kda_recurrent, computed in the chunked WY/UT form (any T, padded internally).

    Inside a chunk with cumulative log-decay G (G_0 = g_0) and state S at the chunk start, the delta-rule writes
    u_t = beta_t (v_t - (decayed S)^T k_t) satisfy a unit-lower-triangular system
        (I + A) U = beta V - beta (exp(G) * K) S,   A_ij = beta_i k_i^T diag(exp(G_i - G_j)) k_j  (j < i)
    so U = U0 - W S with [U0 | W] = (I + A)^{-1} [beta V | beta exp(G) * K] (one batched triangular solve). Then
        o    = (exp(G) * Q) S + P U,                  P_ij = q_i^T diag(exp(G_i - G_j)) k_j  (j <= i)
        S'   = diag(exp(G_C)) S + (exp(G_C - G) * K)^T U
    Substituting U, everything that does not touch S is batched over all chunks, leaving the affine recurrence
        S' = M S + N,   M = diag(exp(G_C)) - Kd^T W,   N = Kd^T U0,   Kd = exp(G_C - G) * K
    as the only sequential part; outputs are o = P U0 + (exp(G) * Q - P W) S afterwards, again batched.
    Padding tokens have k = 0, beta = 0, g = 0, so they leave the state untouched.
    """
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    dt = _compute_dtype(q, k, v, g, beta)
    state = _initial_state(initial_state, k, v, dt)
    if T == 0:
        return v.new_zeros(B, 0, H, Vd, dtype=dt), state
    C = chunk_size
    pad = (-T) % C
    Nc = (T + pad) // C

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, D] -> [B, H, Nc, C, D] in the compute dtype, zero-padded along T
        x = F.pad(x.to(dt), (0, 0, 0, 0, 0, pad))
        return x.reshape(B, Nc, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4).contiguous()  # contiguous: cheap matmuls

    terms = _ChunkTerms(*(to_chunks(x) for x in (q, k, v, g, beta.unsqueeze(-1))))
    # The only sequential part: S_{n+1} = M_n S_n + N_n. Keep the chunk-start states for the batched output pass.
    starts = []
    for n in range(Nc):
        starts.append(state)
        state = terms.M[:, :, n] @ state + terms.N[:, :, n]
    o = terms.outputs(torch.stack(starts, dim=2))  # [B, H, Nc, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, Nc * C, H, Vd)[:, :T], state


def kda_chunked_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    first_chunks: list[int],
    segment_ends: list[int],
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_chunked` over several sequences packed end to end (varlen): no padding to the longest sequence.

    q, k, g: [P, H, K]; v: [P, H, V]; beta: [P, H], with P a multiple of chunk_size and every sequence starting on a
    chunk boundary (a sequence's last chunk is zero-padded: k = 0, β = 0, g = 0 leave the state unchanged).
    initial_states: [S, H, K, V], sequence s starting at chunk first_chunks[s] (increasing). segment_ends: sorted
    chunk indices after which the running state is wanted, repeats allowed (segments of one sequence follow each
    other, so a state snapshot mid-sequence is just a segment end). Returns (o [P, H, V], states
    [len(segment_ends), H, K, V]).
    """
    terms = packed_chunk_terms(q, k, v, g, beta, chunk_size)
    # Unbound once, not indexed per chunk: under autograd each index's backward would write a zero gradient the size
    # of all chunks (quadratic in the chunk count); unbind's backward stacks the pieces once.
    Ms, Ns = terms.M[0].unbind(1), terms.N[0].unbind(1)  # Nc x [H, K, K], Nc x [H, K, V]
    inits = initial_states.to(Ms[0].dtype).unbind(0)
    begins = dict(zip(first_chunks, range(len(first_chunks))))
    wanted = set(segment_ends)
    starts, ends, state = [], {}, inits[0]
    for n in range(len(Ms)):
        if n in begins:
            state = inits[begins[n]]
        starts.append(state)
        state = Ms[n] @ state + Ns[n]
        if n in wanted:
            ends[n] = state
    return packed_outputs(terms, torch.stack(starts, dim=1)), torch.stack([ends[n] for n in segment_ends])


def packed_chunk_terms(q, k, v, g, beta, chunk_size: int = 64) -> _ChunkTerms:
    """The state-independent part of the chunked form over a packed run (`kda_chunked_packed`'s layout): per chunk n
    the affine map S ↦ M[:, n] S + N[:, n] of its tokens ([1, H, Nc, K, K], [1, H, Nc, K, V]) and the outputs for
    any chunk-start states (`packed_outputs`). Prefill context parallelism composes these maps across ranks."""
    P = k.shape[0]
    if P % chunk_size:
        raise ValueError(f"packed length {P} is not a multiple of chunk_size {chunk_size}")
    dt, nc = _compute_dtype(q, k, v, g, beta), P // chunk_size

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [P, H, D] -> [1, H, Nc, C, D]
        return x.to(dt).reshape(nc, chunk_size, x.shape[1], x.shape[-1]).permute(2, 0, 1, 3).unsqueeze(0).contiguous()

    return _ChunkTerms(*(to_chunks(x) for x in (q, k, v, g, beta.unsqueeze(-1))))


def packed_outputs(terms: _ChunkTerms, starts: torch.Tensor) -> torch.Tensor:
    """Outputs [P, H, V] of a packed run from its chunk-start states [H, Nc, K, V]."""
    o = terms.outputs(starts.unsqueeze(0))  # [1, H, Nc, C, V]
    h, nc, c, vd = o.shape[1:]
    return o[0].permute(1, 2, 0, 3).reshape(nc * c, h, vd)


class _ChunkTerms:
    """Everything of the chunked form that does not depend on the chunk-start states, for all chunks at once.

    Inputs are chunked [B, H, Nc, C, D] in the compute dtype (beta with D = 1). Exposes the affine recurrence
    S' = M S + N and `outputs(S0)` for the chunk-start states S0 [B, H, Nc, K, V].
    """

    def __init__(self, q, k, v, g, beta) -> None:
        C, Vd, dt = k.shape[-2], v.shape[-1], k.dtype
        G = g.cumsum(dim=-2)  # in-chunk cumulative log-decay, <= 0 and non-increasing
        G_last = G[..., -1:, :]  # [B, H, Nc, 1, K]
        eG = G.exp()

        # Intra-chunk pairwise scores for k (-> A) and q (-> P) in one pass.
        scores = _intra_chunk_scores(torch.stack([k, q], dim=-3), k, G)  # [B, H, Nc, 2, C, C]
        strict = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
        eye = torch.eye(C, dtype=dt, device=k.device)
        A = beta * scores[..., 0, :, :] * strict  # rows scaled by beta_i, strictly lower
        self.P = scores[..., 1, :, :]  # lower incl. diagonal

        # WY/UT: one unit-lower-triangular solve for every chunk (replaces the row-by-row forward substitution).
        rhs = torch.cat([beta * v, beta * k * eG], dim=-1)  # [.., C, V + K]
        self.Y = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)  # [U0 | W]

        Kd_T = (k * (G_last - G).exp()).transpose(-1, -2)  # [.., K, C]
        KdY = Kd_T @ self.Y  # [Kd^T U0 | Kd^T W]
        self.N = KdY[..., :Vd]  # [.., K, V]
        self.M = torch.diag_embed(G_last.squeeze(-2).exp()) - KdY[..., Vd:]  # [.., K, K]
        self.qG, self.Vd = q * eG, Vd

    def outputs(self, S0: torch.Tensor) -> torch.Tensor:
        """o = P U0 + (exp(G) * Q - P W) S0 per chunk: [B, H, Nc, C, V]."""
        PY = self.P @ self.Y  # [P U0 | P W]
        return PY[..., : self.Vd] + (self.qG - PY[..., self.Vd :]) @ S0
