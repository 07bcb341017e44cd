"""The draft context of cached tokens, kept beside their KV slots, so a prefix-cache hit does not leave the draft blind.

A request's draft KV (`context.DraftKV`) is filled from the target hidden states of the tokens its own forwards
compute. Tokens that come from a prefix-cache hit are never computed, so without this pool the draft would see
holes where the cached prompt is (a whole system prompt, the earlier turns of a chat) and accept fewer tokens. Every
committed token's context features (the draft's `fc` → RMSNorm output, one [d] row) are written at its KV slot
(`page * page_size + offset`, the KV pool's addressing); a new request reads the rows of its cached positions
through its page table and turns them into draft keys/values.

Each row also records the token id and position it was computed for, and a row is used only when both match the
request's: a page that came back from the host tier into a reused device page (whose row belongs to whatever was
there before) stays a hole. The features only steer the draft's proposals, so a wrong row could cost acceptance,
never change an output.
"""

from __future__ import annotations

import torch


def bytes_per_slot(width: int, dtype: torch.dtype) -> int:
    """One row: `width` features in the draft's dtype and the (token id, position) key (the KV budget counts it)."""
    return width * dtype.itemsize + 2 * torch.long.itemsize


class DraftContextPool:
    """feats [slots, d] (the draft's dtype) and key [slots, 2] = (token id, position), -1 where nothing was written."""

    def __init__(self, num_slots: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.feats = torch.zeros(num_slots, width, dtype=dtype, device=device)
        self.key = torch.full((num_slots, 2), -1, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return self.feats.nbytes + self.key.nbytes

    def write(self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor) -> None:
        """Rows of committed tokens: their KV slots [T], token ids [T], positions [T] and context features [T, d]."""
        self.feats.index_copy_(0, slots, feats.to(self.feats.dtype))
        self.key.index_copy_(0, slots, torch.stack([tokens, positions], dim=1))

    def read(
        self, slots: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, positions) of the rows at `slots` holding these tokens at these positions (others: holes)."""
        key = self.key.index_select(0, slots)
        hit = (key[:, 0] == tokens) & (key[:, 1] == positions)
        rows = hit.nonzero().squeeze(1)
        return self.feats.index_select(0, slots.index_select(0, rows)), positions.index_select(0, rows)
