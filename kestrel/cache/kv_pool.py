"""Paged MLA latent + DSA index-key cache.

`PageAllocator` is the scheduler's side: plain integers, a free list with exact accounting. `KVStorage` is the
model runner's side: for every MLA/DSA layer one flat tensor per cached quantity, addressed by token slot
`page * page_size + offset`. One page table per request addresses all layers at once.
"""

from __future__ import annotations

import torch

from kestrel.config import ModelConfig


class PageAllocator:
    """Free list of page ids. Invariant: free + allocated == num_pages, no page handed out twice."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._allocated:
                raise RuntimeError(f"page {page} freed twice or never allocated")
            self._allocated.remove(page)
            self._free.append(page)


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
