"""Paged MLA latent + DSA index-key cache.

`PageAllocator` is the scheduler's side: plain integers, a free list with exact accounting. `KVStorage` is the
model runner's side: for every MLA/DSA layer one flat tensor per cached quantity, addressed by token slot
`page * page_size + offset`. One page table per request addresses all layers at once.
"""

from __future__ import annotations

import torch

from kestrel.cache.free_list import FreeList
from kestrel.config import ModelConfig


class PageAllocator(FreeList):
    """Page ids for the scheduler; a request's page table addresses every MLA/DSA layer at once."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        super().__init__(num_pages, "page")
        self.num_pages, self.page_size = num_pages, page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    alloc = FreeList.take
    free = FreeList.give_back


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token occupies across all MLA/DSA layers (latent + rope key + index key)."""
    per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for layer in cfg.attention_layers:
        total += per_layer + (cfg.index_head_dim if cfg.layer_kinds[layer] == "dsa" else 0)
    return total * size


class KVStorage:
    """Tensors of the paged cache: latent [slots, r], rope key [slots, dr], index key [slots, Di] per layer."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device) -> None:
        slots = num_pages * page_size
        self.latent: dict[int, torch.Tensor] = {}
        self.rope_key: dict[int, torch.Tensor] = {}
        self.index_key: dict[int, torch.Tensor | None] = {}
        for layer in cfg.attention_layers:
            self.latent[layer] = torch.zeros(slots, cfg.kv_lora_rank, dtype=dtype, device=device)
            self.rope_key[layer] = torch.zeros(slots, cfg.qk_rope_head_dim, dtype=dtype, device=device)
            dsa = cfg.layer_kinds[layer] == "dsa"
            self.index_key[layer] = torch.zeros(slots, cfg.index_head_dim, dtype=dtype, device=device) if dsa else None

    def _tensors(self) -> list[torch.Tensor]:
        """Every per-layer tensor, in a fixed order (the packed page layout follows it)."""
        out = []
        for layer in self.latent:
            out += [self.latent[layer], self.rope_key[layer]]
            if self.index_key[layer] is not None:
                out.append(self.index_key[layer])
        return out

    def gather_pages(self, pages: list[int], page_size: int) -> torch.Tensor:
        """The pages' contents packed as [n_pages, page_size, width] (all layers side by side), on the CPU.

        All cached quantities share one dtype, so one tensor per page carries every layer: that is the unit
        the host tier keeps and the disk tier writes.
        """
        slots = _page_slots(pages, page_size, self.latent[next(iter(self.latent))].device)
        packed = torch.cat([t[slots] for t in self._tensors()], dim=-1)
        return packed.view(len(pages), page_size, -1).to("cpu", copy=True)

    def scatter_pages(self, pages: list[int], page_size: int, packed: torch.Tensor) -> None:
        """Inverse of `gather_pages`: write packed contents into the given (fresh) pages."""
        tensors = self._tensors()
        slots = _page_slots(pages, page_size, tensors[0].device)
        flat = packed.reshape(len(pages) * page_size, -1).to(tensors[0].device)
        for t, part in zip(tensors, flat.split([t.shape[1] for t in tensors], dim=-1)):
            t.index_copy_(0, slots, part.to(t.dtype))

    @property
    def packed_width(self) -> int:
        return sum(t.shape[1] for t in self._tensors())


def _page_slots(pages: list[int], page_size: int, device) -> torch.Tensor:
    table = torch.tensor(pages, dtype=torch.long, device=device)
    return (table[:, None] * page_size + torch.arange(page_size, device=device)[None, :]).reshape(-1)
