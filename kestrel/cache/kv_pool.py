"""Paged MLA latent + DSA index-key cache.

`PageAllocator` is the scheduler's side: plain integers, a free list with exact accounting. `KVStorage` is the
model runner's side: for every MLA/DSA layer one flat tensor per cached quantity, addressed by token slot
`page * page_size + offset`. One page table per request addresses all layers at once.
`QuantizedKVStorage` keeps the same slots as rows of bytes in an FP8 / NVFP4 layout (`--kv-cache-dtype`):
quantized on write, dequantized on read, so layers see the same tensors either way.
"""

from __future__ import annotations

import torch

from kestrel.cache.free_list import FreeList
from kestrel.config import ModelConfig
from kestrel.models.layers.casts import cast
from kestrel.quant.fp4 import nvfp4_global_scale
from kestrel.quant.kv_formats import KVTokenLayout


def select_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """pool[slots] for a [slots, d] pool and any-shaped slot ids, as one `index_select` (row copies): on CPU the
    advanced-indexing kernel copies element by element, 2.7x slower for 512-wide latents, 14x for rope keys."""
    return pool.index_select(0, slots.reshape(-1)).view(*slots.shape, pool.shape[-1])


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


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes one token occupies across all MLA/DSA layers (latent + rope key + index key)."""
    if kv_cache_dtype != "auto":
        return sum(token_layout(cfg, layer, kv_cache_dtype).nbytes for layer in cfg.attention_layers)
    per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    size = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for layer in cfg.attention_layers:
        total += per_layer + (cfg.index_head_dim if cfg.layer_kinds[layer] == "dsa" else 0)
    return total * size


def token_layout(cfg: ModelConfig, layer: int, kv_cache_dtype: str) -> KVTokenLayout:
    index_dim = cfg.index_head_dim if cfg.layer_kinds[layer] == "dsa" else 0
    return KVTokenLayout(kv_cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, index_dim)


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

    def write(self, layer: int, slots: torch.Tensor, latent, rope_key, index_key) -> None:
        self.latent[layer].index_copy_(0, slots, cast(latent, self.latent[layer].dtype))
        self.rope_key[layer].index_copy_(0, slots, cast(rope_key, self.rope_key[layer].dtype))
        if index_key is not None:
            self.index_key[layer].index_copy_(0, slots, cast(index_key, self.index_key[layer].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [*slots.shape, r] and rope keys [*slots.shape, dr] at the given slots."""
        return select_rows(self.latent[layer], slots), select_rows(self.rope_key[layer], slots)

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        index = self.index_key[layer]
        return select_rows(index, slots) if index is not None else None

    def set_latent_amax(self, latent_amax: dict[int, float]) -> None:
        """Bounds on |latent| per layer (reloaded weights); only a quantized format keeps a scale from them."""

    @property
    def packed_bytes_per_token(self) -> int:
        return self.packed_width * next(iter(self.latent.values())).element_size()

    def tensors(self) -> list[torch.Tensor]:
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
        packed = torch.cat([t[slots] for t in self.tensors()], dim=-1)
        return packed.view(len(pages), page_size, -1).to("cpu", copy=True)

    def scatter_pages(self, pages: list[int], page_size: int, packed: torch.Tensor) -> None:
        """Inverse of `gather_pages`: write packed contents into the given (fresh) pages."""
        tensors = self.tensors()
        slots = _page_slots(pages, page_size, tensors[0].device)
        flat = packed.reshape(len(pages) * page_size, -1).to(tensors[0].device)
        for t, part in zip(tensors, flat.split([t.shape[1] for t in tensors], dim=-1)):
            t.index_copy_(0, slots, part.to(t.dtype))

    @property
    def packed_width(self) -> int:
        return sum(t.shape[1] for t in self.tensors())


class QuantizedKVStorage(KVStorage):
    """The pool in a quantized format: per layer a latent row [slots, latent_bytes] (values, scales, bf16 rope key)
    and, for DSA layers, an index row [slots, index_bytes], all uint8.

    Reads return `dtype` tensors. Every token is quantized on its own (per-token / per-block scales; NVFP4's
    per-layer fp32 scale is fixed at start from `latent_amax`), so stored bytes never depend on the batch.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        kv_cache_dtype: str,
        dtype: torch.dtype,
        device,
        latent_amax: dict[int, float] | None = None,
    ) -> None:
        slots = num_pages * page_size
        self.dtype = dtype
        self.layouts = {layer: token_layout(cfg, layer, kv_cache_dtype) for layer in cfg.attention_layers}
        # `latent` holds the latent rows, `index_key` the index rows: the packed page layout of the base class.
        self.latent = {
            layer: torch.zeros(slots, lay.latent_bytes, dtype=torch.uint8, device=device)
            for layer, lay in self.layouts.items()
        }
        self.index_key = {
            layer: torch.zeros(slots, lay.index_bytes, dtype=torch.uint8, device=device) if lay.index_dim else None
            for layer, lay in self.layouts.items()
        }
        amax = latent_amax or {}
        self.global_scale = {layer: nvfp4_global_scale(amax.get(layer, 0.0)).to(device) for layer in self.layouts}

    def set_latent_amax(self, latent_amax: dict[int, float]) -> None:
        """New bounds (reloaded weights; the pool holds nothing): rescaled in place, which compiled graphs read."""
        for layer, scale in self.global_scale.items():
            scale.copy_(nvfp4_global_scale(latent_amax.get(layer, 0.0)))

    def write(self, layer: int, slots: torch.Tensor, latent, rope_key, index_key) -> None:
        lay = self.layouts[layer]
        self.latent[layer].index_copy_(0, slots, lay.encode_latent(latent, rope_key, self.global_scale[layer]))
        if index_key is not None:
            self.index_key[layer].index_copy_(0, slots, lay.encode_index(index_key))

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = select_rows(self.latent[layer], slots)
        return self.layouts[layer].decode_latent(rows, self.global_scale[layer], self.dtype)

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        index = self.index_key[layer]
        return self.layouts[layer].decode_index(select_rows(index, slots), self.dtype) if index is not None else None

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for layer in self.latent:
            out.append(self.latent[layer])
            if self.index_key[layer] is not None:
                out.append(self.index_key[layer])
        return out


def make_kv_storage(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device,
    kv_cache_dtype: str = "auto",
    latent_amax: dict[int, float] | None = None,
) -> KVStorage:
    """The pool for a `--kv-cache-dtype`: `auto` stores the model dtype, the others quantized bytes."""
    if kv_cache_dtype == "auto":
        return KVStorage(cfg, num_pages, page_size, dtype, device)
    return QuantizedKVStorage(cfg, num_pages, page_size, kv_cache_dtype, dtype, device, latent_amax)


def _page_slots(pages: list[int], page_size: int, device) -> torch.Tensor:
    table = torch.tensor(pages, dtype=torch.long, device=device)
    return (table[:, None] * page_size + torch.arange(page_size, device=device)[None, :]).reshape(-1)
