"""The DSA selection order: higher index score first, then lower position, so "the top-k" is one set.

Every path that selects (single-rank prefill and decode, the DCP candidate merge and its fallback) uses it, so they
agree even on ties (ReLU makes exact-zero scores common). A (score, position) pair is one int64 key whose integer order
is that selection order: the float's bits mapped to an order-preserving int32 in the high half, (2^32 - 1 - position)
in the low half; one integer top-k then selects exactly.
"""

from __future__ import annotations

import torch

INVALID = torch.iinfo(torch.int64).min  # key of "no candidate": below every real (score, position)
_LOW = 0xFFFFFFFF


def pack_keys(scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (score desc, position asc) would be; INVALID where not `valid`."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0, so the two tie as floats do
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits → signed-int order
    keys = (ordered.to(torch.int64) << 32) | (_LOW - positions.to(torch.int64))
    return keys.masked_fill(~valid, INVALID)


def unpack_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32, positions int64) of keys; INVALID → (-inf, -1)."""
    invalid = keys == INVALID
    ordered = (keys >> 32).to(torch.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    scores = bits.view(torch.float32).masked_fill(invalid, float("-inf"))
    positions = (_LOW - (keys & _LOW)).masked_fill(invalid, -1)
    return scores, positions


def top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest keys of each row [B, M] → [B, k], descending, INVALID-padded when M < k."""
    got = keys.topk(min(k, keys.shape[-1]), dim=-1).values
    if got.shape[-1] < k:
        got = torch.cat([got, got.new_full((*got.shape[:-1], k - got.shape[-1]), INVALID)], dim=-1)
    return got


def exact_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-rank top-k of rows [B, L] over positions < length: (scores, positions) [B, k], -1 padded."""
    pos = torch.arange(scores.shape[-1], device=scores.device)
    valid = pos[None, :] < lengths[:, None]
    return unpack_keys(top_keys(pack_keys(scores, pos.expand_as(scores), valid), k))


def topk_positions(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best allowed entries of each row of scores [..., L], in selection order: (positions [..., k], selected
    [..., k]); where a row has fewer than k allowed entries, the rest are position 0 with selected False."""
    pos = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    keys = pack_keys(scores, pos, allowed).topk(k, dim=-1).values
    selected = keys != INVALID
    return (_LOW - (keys & _LOW)).masked_fill(~selected, 0), selected
