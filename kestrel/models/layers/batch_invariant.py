"""Batch-invariant mode (`--deterministic-inference`): every row of a forward computed in an order that depends only
on that row, so the engine (batched, chunked, decoding) and a trainer (whole sequences) get bit-identical logits.

Two kinds of change, both active only inside `mode()`:

- Kernels whose result for one row depends on the other rows are swapped for fixed-order ones by a torch function
  mode: `F.linear` becomes a GEMM over fixed-shape row tiles (a BLAS call's reduction order depends on its shape: at
  one or two rows MKL takes another kernel than at many); sigmoid, SiLU and softplus are composed from exp/log,
  whose vectorised and scalar paths agree (the fused kernels' scalar tail does not, so a value's bits depended on
  where it sat in the tensor); addcmul becomes a multiply then an add (no FMA on one path only).
- Layers whose prefill and decode forms differ call one form here when `active()`: MLA/DSA attention is the
  absorbed form for every query, over its key positions in blocks of `KEY_BLOCK` that depend only on absolute
  positions (`latent_attention`, `index_scores`); routed experts add each token's k terms in ascending expert id
  (`experts`); KDA runs its recurrent form everywhere (the layer's choice) with the conv as ordered multiply-adds.

Row reductions over the last dimension (RMSNorm, softmax, log-softmax, sums) are already row-invariant on CPU and
stay as they are. The guarantee is per device type and thread count; fp32 or bf16 alike, but the KV cache must hold
the model dtype (a quantized cache would differ from the trainer's unquantized keys).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_TILE = 8  # rows per GEMM tile: every tile is one [ROW_TILE, K] x [K, N] product, whatever the batch
KEY_BLOCK = 16  # keys per attention block: a query's blocks are positions [b*KEY_BLOCK, (b+1)*KEY_BLOCK)
QUERY_CHUNK = 64  # queries attended together (rows are independent; this only bounds memory)

_LOCAL = threading.local()


def active() -> bool:
    """Whether this thread is inside `mode()` (layers pick their batch-invariant forms)."""
    return getattr(_LOCAL, "on", False)


@contextlib.contextmanager
def mode() -> Iterator[None]:
    """Batch-invariant kernels and layer forms for the code inside (this thread only; re-entrant)."""
    if active():
        yield
        return
    _LOCAL.on = True
    try:
        with _FixedOrderKernels():
            yield
    finally:
        _LOCAL.on = False


# -- kernels ------------------------------------------------------------------------------------------------------
def row_tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [K, N] as one batched GEMM over [ROW_TILE, K] tiles (x zero-padded): a row's result never
    depends on M or on the other rows."""
    m, k = x.shape
    pad = -m % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    tiles = x.reshape(-1, ROW_TILE, k)
    return torch.bmm(tiles, w.expand(tiles.shape[0], *w.shape)).reshape(-1, w.shape[1])[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` over fixed-shape row tiles."""
    out = row_tiled_matmul(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per head h: x[:, h] [T, K] @ w[h] [K, N] → [T, H, N], in row tiles (the absorbed MLA projections)."""
    t, h, k = x.shape
    pad = -t % ROW_TILE
    xt = x.transpose(0, 1)
    if pad:
        xt = torch.cat([xt, xt.new_zeros(h, pad, k)], dim=1)
    tiles = xt.reshape(h, -1, ROW_TILE, k)
    out = torch.matmul(tiles, w[:, None])  # [H, tiles, ROW_TILE, N]: one [ROW_TILE, K] x [K, N] product each
    return out.reshape(h, -1, w.shape[-1])[:, :t].transpose(0, 1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(βx))/β, x above the threshold; log1p as log(u)·y/(u − 1) with u = 1 + y (exact for tiny y)."""
    xf = x.float() * beta
    y = torch.exp(xf.clamp(max=threshold))
    u = 1.0 + y
    small = u == 1.0
    log1p = torch.where(small, y, torch.log(u) * y / torch.where(small, 1.0, u - 1.0))
    return torch.where(xf > threshold, xf, log1p).div(beta).to(x.dtype)


def addcmul(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, *, value: float = 1.0) -> torch.Tensor:
    product = t1 * t2
    return x + (product if value == 1 else product * value)


def addcmul_(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, *, value: float = 1.0) -> torch.Tensor:
    product = t1 * t2
    return x.add_(product if value == 1 else product * value)


_SWAPS: dict[Callable, Callable] = {
    F.linear: linear,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
    F.silu: silu,
    F.softplus: softplus,
    torch.addcmul: addcmul,
    torch.Tensor.addcmul: addcmul,
    torch.Tensor.addcmul_: addcmul_,
}


class _FixedOrderKernels(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return _SWAPS.get(func, func)(*args, **(kwargs or {}))


# -- layer forms ----------------------------------------------------------------------------------------------------
def padded_keys(n: int) -> int:
    """Key slots for a history of n positions: whole blocks."""
    return -(-n // KEY_BLOCK) * KEY_BLOCK


def pad_rows(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """x zero-padded along `dim` to `rows` entries."""
    extra = rows - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _blocks(keys: torch.Tensor, n: int) -> torch.Tensor:
    """[n or 1, Kp, c] keys → [n * blocks, KEY_BLOCK, c], one matrix per (query, block)."""
    kp, c = keys.shape[1], keys.shape[2]
    return keys.expand(n, kp, c).reshape(n * (kp // KEY_BLOCK), KEY_BLOCK, c)


def latent_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention of each query q [n, H, c] over its own key slots: keys [n or 1, Kp, c], values
    [n or 1, Kp, r], valid [n, Kp] (Kp a multiple of KEY_BLOCK; invalid slots must hold finite values). → [n, H, r].

    Per (query, block) one fixed-shape product; the block sums and outputs are added in block order, and a block
    with no valid key adds exact zeros, so a query's result depends on its valid keys and their positions only.
    """
    outs = []
    for lo in range(0, q.shape[0], QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, q.shape[0])
        pick = slice(lo, hi) if keys.shape[0] > 1 else slice(0, 1)
        outs.append(_attend_chunk(q[lo:hi], keys[pick], values[pick], valid[lo:hi], scale))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], values.shape[-1])


def _attend_chunk(q, keys, values, valid, scale) -> torch.Tensor:
    n, h, c = q.shape
    nb = keys.shape[1] // KEY_BLOCK
    qb = q.float()[:, None].expand(n, nb, h, c).reshape(n * nb, h, c)
    s = torch.bmm(qb, _blocks(keys.float(), n).transpose(1, 2)).view(n, nb, h, KEY_BLOCK) * scale
    s = s.masked_fill(~valid.view(n, nb, 1, KEY_BLOCK), float("-inf"))
    e = torch.exp(s - s.amax(dim=(1, 3), keepdim=True))
    sums = e.sum(-1)  # [n, blocks, H]
    pv = torch.bmm(e.view(n * nb, h, KEY_BLOCK), _blocks(values.float(), n)).view(n, nb, h, -1)
    total, out = sums[:, 0], pv[:, 0]
    for b in range(1, nb):
        total, out = total + sums[:, b], out + pv[:, b]
    return (out / total[..., None]).to(q.dtype)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """DSA indexer scores Σ_h w_h·ReLU(q_h·k) of queries q [n, H, D] (weights w [n, H]) over key slots
    keys [n or 1, Kp, D] → [n, Kp] fp32, -inf where not valid; one fixed-shape product per (query, block)."""
    outs = []
    for lo in range(0, q.shape[0], QUERY_CHUNK):
        hi = min(lo + QUERY_CHUNK, q.shape[0])
        n, h, _ = q[lo:hi].shape
        nb = keys.shape[1] // KEY_BLOCK
        kb = _blocks((keys[lo:hi] if keys.shape[0] > 1 else keys).float(), n)
        s = torch.relu(torch.bmm(q[lo:hi].float()[:, None].expand(n, nb, h, -1).reshape(n * nb, h, -1), kb.mT))
        wb = w[lo:hi].float()[:, None, None].expand(n, nb, 1, h).reshape(n * nb, 1, h)
        outs.append(torch.bmm(wb, s).view(n, nb * KEY_BLOCK))
    scores = torch.cat(outs) if outs else q.new_zeros(0, keys.shape[1], dtype=torch.float32)
    return scores.masked_fill(~valid, float("-inf"))


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Σ_j weight_j·expert_{ids_j}(x) per token, its k terms added from zero in ascending expert id.

    `expert(e, xs, tokens)` maps the rows routed to expert e (tokens: their token indices) through it; with row-tiled
    GEMMs inside, a row's output does not depend on how many others share its expert.
    """
    t, k = ids.shape
    order = ids.argsort(dim=1, stable=True)
    ids_sorted, w_sorted = ids.gather(1, order), weights.gather(1, order)
    flat = ids_sorted.reshape(-1)
    ys = x.new_zeros(t * k, x.shape[-1])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // k
        ys = ys.index_put((pairs,), expert(e, x[tokens], tokens))
    terms = (ys.view(t, k, -1) * w_sorted[..., None]).to(x.dtype)
    out = torch.zeros_like(x)
    for j in range(k):
        out = out + terms[:, j]
    return out


def window_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise conv of one window per row: window [B, C, kernel], weight [C, kernel], as the multiply-adds the
    prefill form does (oldest input first), so decode and prefill agree bit for bit."""
    out = window[..., 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + window[..., j] * weight[:, j]
    return out


def mix(weights: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Σ_i weights[i, t]·candidates[i, t] added in candidate order (AttnRes), weights [N, T], candidates [N, T, D]."""
    out = weights[0, :, None] * candidates[0]
    for i in range(1, candidates.shape[0]):
        out = out + weights[i, :, None] * candidates[i]
    return out
