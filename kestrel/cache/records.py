"""Rollout records: what each cached token was routed to (MoE experts) and attended to (DSA top-k positions).

They live on the host, one row per KV slot (`page * page_size + offset`, the KV pool's addressing), written by every
forward for every token it computes. A request reads the rows of its page table when it finishes, so tokens that
came from a prefix-cache hit report what they were routed to when they were first computed, and the HiCache tiers
carry the rows inside each packed page (`PoolIO`). Layout of a request's result, as SGLang returns it: one row per
token that went through the model (prompt + outputs but the last), [tokens, MoE layers, top-k] expert ids and
[tokens, DSA layers, index_topk] positions (ascending, -1 padded), int32.
"""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig


def record_bytes_per_token(cfg: ModelConfig, experts: bool, index_topk: bool) -> int:
    """Host bytes one token's records take (int32 per expert id and per selected position)."""
    moe = sum(kind == "moe" for kind in cfg.mlp_kinds) * cfg.num_experts_per_tok if experts else 0
    dsa = sum(kind == "dsa" for kind in cfg.layer_kinds) * cfg.index_topk if index_topk else 0
    return 4 * (moe + dsa)


class RolloutRecords:
    """Host tables [slots, layers, k] int32: routed experts (`experts`) and DSA top-k positions (`index_topk`)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, experts: bool, index_topk: bool) -> None:
        self.moe_layers = [i for i, kind in enumerate(cfg.mlp_kinds) if kind == "moe"]
        self.dsa_layers = [i for i, kind in enumerate(cfg.layer_kinds) if kind == "dsa"]
        if experts and not self.moe_layers:
            raise ValueError("enable_return_routed_experts: this model has no MoE layers")
        if index_topk and not self.dsa_layers:
            raise ValueError("enable_return_indexer_topk: this model has no DSA (indexer) layers")
        shape = (num_slots, len(self.moe_layers), cfg.num_experts_per_tok)
        self.experts = torch.zeros(shape, dtype=torch.int32) if experts else None
        shape = (num_slots, len(self.dsa_layers), cfg.index_topk)
        self.index_topk = torch.full(shape, -1, dtype=torch.int32) if index_topk else None

    def _tables(self) -> list[torch.Tensor]:
        return [t for t in (self.experts, self.index_topk) if t is not None]

    @property
    def bytes_per_token(self) -> int:
        return sum(t[0].numel() * 4 for t in self._tables())

    def write(
        self, slots: torch.Tensor, experts: dict[int, torch.Tensor] | None, index_topk: dict[int, torch.Tensor] | None
    ) -> None:
        """The rows of one forward's tokens (slots [T], batch order) from the layers' per-layer [T, k] tensors."""
        rows = slots.cpu()
        if self.experts is not None:
            self.experts[rows] = torch.stack([experts[layer] for layer in self.moe_layers], 1).to("cpu", torch.int32)
        if self.index_topk is not None:
            self.index_topk[rows] = torch.stack([index_topk[layer] for layer in self.dsa_layers], 1).to("cpu")

    def read(self, pages: list[int], page_size: int, num_tokens: int) -> tuple[torch.Tensor | None, ...]:
        """(experts, index top-k) of a request's tokens [0, num_tokens), through its page table (copies)."""
        pos = torch.arange(num_tokens)
        rows = torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size
        return tuple(None if t is None else t[rows] for t in (self.experts, self.index_topk))

    def gather_pages(self, pages: list[int], page_size: int) -> torch.Tensor:
        """[n_pages, page_size, width] int32: both tables' rows of the pages side by side (the host and disk tiers)."""
        rows = _page_rows(pages, page_size)
        return torch.cat([t[rows].flatten(1) for t in self._tables()], dim=1).view(len(pages), page_size, -1)

    def scatter_pages(self, pages: list[int], page_size: int, packed: torch.Tensor) -> None:
        rows, flat = _page_rows(pages, page_size), packed.reshape(len(pages) * page_size, -1)
        tables = self._tables()
        for t, part in zip(tables, flat.split([t[0].numel() for t in tables], dim=1)):
            t[rows] = part.view(-1, *t.shape[1:])

    @property
    def width(self) -> int:
        return sum(t[0].numel() for t in self._tables())


def _page_rows(pages: list[int], page_size: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.long)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
