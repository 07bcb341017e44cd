"""Byte layouts of one token of one MLA/DSA layer in the quantized KV formats (`--kv-cache-dtype`).

`fp8_e4m3` is FlashMLA's layout: latent as e4m3 with one fp32 scale per 128 values, then the rope key in bf16
(512 + 16 + 128 = 656 B at K3.1 widths); index key as e4m3 + one fp32 scale (128 + 4 = 132 B).
`nvfp4`: latent as e2m1 with an e4m3 scale per 16 values (the layer's fp32 scale lives beside the pool), rope key
in bf16 (256 + 32 + 128 = 416 B); index key as MXFP4, e2m1 with an E8M0 scale per 32 (64 + 4 = 68 B).
Each part is a row of bytes, so pools, page copies and host / disk tiers move exactly these bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.quant.fp4 import (
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)
from kestrel.quant.fp8 import fp8_dequantize_groups, fp8_quantize_groups

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "nvfp4")
FP8_GROUP = 128


def _bytes_as(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [start, stop) of every row, reinterpreted as `dtype` (native byte order, as they were written)."""
    return rows[..., start:stop].contiguous().view(dtype)


@dataclass(frozen=True)
class KVTokenLayout:
    """One layer's rows: latent row = quantized latent + scales + bf16 rope key; index row (DSA layers)."""

    fmt: str
    rank: int
    rope_dim: int
    index_dim: int  # 0: no index key (plain MLA layer)

    def __post_init__(self) -> None:
        if self.fmt not in KV_CACHE_DTYPES[1:]:
            raise ValueError(f"kv_cache_dtype: {self.fmt!r} is not one of {KV_CACHE_DTYPES}")
        latent_block = self.latent_group
        if self.rank % latent_block:
            raise ValueError(
                f"kv_cache_dtype {self.fmt}: kv_lora_rank {self.rank} must be a multiple of {latent_block}"
            )
        if self.index_dim and self.index_dim % (MXFP4_BLOCK if self.fmt == "nvfp4" else 1):
            raise ValueError(f"kv_cache_dtype nvfp4: index_head_dim {self.index_dim} must be a multiple of 32")

    @property
    def latent_group(self) -> int:
        return NVFP4_BLOCK if self.fmt == "nvfp4" else min(FP8_GROUP, self.rank)

    @property
    def _latent_split(self) -> tuple[int, int, int]:
        """Byte widths of (values, scales, rope key) in the latent row."""
        if self.fmt == "fp8_e4m3":
            return self.rank, 4 * (self.rank // self.latent_group), 2 * self.rope_dim
        return self.rank // 2, self.rank // NVFP4_BLOCK, 2 * self.rope_dim

    @property
    def latent_bytes(self) -> int:
        return sum(self._latent_split)

    @property
    def index_bytes(self) -> int:
        if not self.index_dim:
            return 0
        if self.fmt == "fp8_e4m3":
            return self.index_dim + 4
        return self.index_dim // 2 + self.index_dim // MXFP4_BLOCK

    @property
    def nbytes(self) -> int:
        """Bytes of one token in this layer."""
        return self.latent_bytes + self.index_bytes

    def encode_latent(self, latent: torch.Tensor, rope_key: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
        """Latent [T, r] + rope key [T, dr] → rows [T, latent_bytes] (uint8)."""
        if self.fmt == "fp8_e4m3":
            values, scales = fp8_quantize_groups(latent, self.latent_group)
        else:
            values, scales = nvfp4_quantize(latent, global_scale)
        rope = rope_key.to(torch.bfloat16).contiguous().view(torch.uint8)
        return torch.cat([values, scales.contiguous().view(torch.uint8), rope], dim=-1)

    def decode_latent(
        self, rows: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [..., latent_bytes] → latent [..., r] and rope key [..., dr] in `dtype`."""
        v, s, _ = self._latent_split
        if self.fmt == "fp8_e4m3":
            latent = fp8_dequantize_groups(rows[..., :v], _bytes_as(rows, v, v + s, torch.float32))
        else:
            latent = nvfp4_dequantize(rows[..., :v], rows[..., v : v + s], global_scale)
        rope = _bytes_as(rows, v + s, self.latent_bytes, torch.bfloat16)
        return latent.to(dtype), rope.to(dtype)

    def encode_index(self, index_key: torch.Tensor) -> torch.Tensor:
        """Index key [T, Di] → rows [T, index_bytes] (uint8)."""
        if self.fmt == "fp8_e4m3":
            values, scales = fp8_quantize_groups(index_key, self.index_dim)
        else:
            values, scales = mxfp4_quantize(index_key)
        return torch.cat([values, scales.contiguous().view(torch.uint8)], dim=-1)

    def decode_index(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [..., index_bytes] → index keys [..., Di] in `dtype`."""
        if self.fmt == "fp8_e4m3":
            keys = fp8_dequantize_groups(
                rows[..., : self.index_dim], _bytes_as(rows, self.index_dim, None, torch.float32)
            )
        else:
            keys = mxfp4_dequantize(rows[..., : self.index_dim // 2], rows[..., self.index_dim // 2 :])
        return keys.to(dtype)
