"""E2M1 (FP4) values with block scales: NVFP4 (e4m3 scale per 16 values, times a per-tensor fp32 scale) and
MXFP4 (OCP MX: E8M0 scale per 32 values). Two e2m1 codes per byte, the first value in the low nibble (the
layout of Hugging Face `*_blocks` tensors).

E2M1 has no infinity or NaN: it saturates at ±6, and a block holding a NaN or an infinity gets a NaN scale,
so the whole block reads back as NaN (the OCP MX rule). Rounding is to nearest, ties to even.
"""

from __future__ import annotations

import torch

from kestrel.quant.fp8 import E4M3_NAN, E8M0_BIAS, E8M0_NAN, e4m3_decode, e4m3_encode, e8m0_decode, finite_amax

E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest normal (6 = 1.5 · 2^2)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float → e2m1 codes (uint8 0..15), nearest-even with saturation at ±6 (NaN must be handled by the caller)."""
    mag = x.float().abs().clamp_max(E2M1_MAX)
    mid = torch.tensor(_MIDPOINTS, device=x.device)
    lo = torch.searchsorted(mid, mag, right=False)
    hi = torch.searchsorted(mid, mag, right=True)
    # On a midpoint lo != hi: of the two neighbours take the even code (the one whose mantissa bit is 0).
    idx = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)
    return (idx | (torch.signbit(x).to(torch.long) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) → fp32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes 0..15 → [..., n/2] bytes, element 2i in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes → [..., n] codes 0..15."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _blocks(x: torch.Tensor, block: int, name: str) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"{name}: last dim {n} is not a multiple of the block size {block}")
    return x.float().reshape(*x.shape[:-1], n // block, block)


# -- MXFP4 -----------------------------------------------------------------------------------------------


def mxfp4_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] → packed e2m1 [..., n/2] and E8M0 scales [..., n/32].

    OCP MX v1.0 §6.3: shared exponent = floor(log2(amax)) − emax(e2m1), clamped to E8M0's range; values divided by
    2^exponent, rounded to e2m1 (the top of [6, 8) saturates to 6). An all-zero block gets the smallest scale.
    """
    xb = _blocks(x, MXFP4_BLOCK, "mxfp4")
    amax, finite = finite_amax(xb)
    _, exp = torch.frexp(amax)  # amax = m · 2^exp with m in [0.5, 1): floor(log2(amax)) = exp − 1
    shared = torch.where(amax > 0, exp - 1 - E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(xb, -shared[..., None])
    codes = e2m1_encode(torch.where(finite[..., None], scaled, 0.0))
    scales = torch.where(finite, shared + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return pack_nibbles(codes.reshape(x.shape)), scales


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `mxfp4_quantize` (fp32 [..., n])."""
    values = e2m1_decode(unpack_nibbles(packed)).reshape(*scales.shape, MXFP4_BLOCK)
    return (values * e8m0_decode(scales)[..., None]).reshape(*scales.shape[:-1], -1)


def mxfp4_dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Hugging Face `*_blocks` [..., G, 16] + `*_scales` [..., G] → [..., G·32] in `dtype` (one byte-pair table
    lookup per byte, then the power-of-two scale)."""
    pairs = _byte_pairs(blocks.device)[blocks.long()]  # [..., G, 16, 2]
    values = pairs.reshape(*scales.shape, MXFP4_BLOCK) * e8m0_decode(scales)[..., None]
    return values.reshape(*scales.shape[:-1], -1).to(dtype)


_PAIRS: dict[torch.device, torch.Tensor] = {}


def _byte_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2]: the two e2m1 values of every byte, low nibble first."""
    if device not in _PAIRS:
        codes = torch.arange(256, dtype=torch.uint8, device=device)
        _PAIRS[device] = e2m1_decode(unpack_nibbles(codes[:, None]))
    return _PAIRS[device]


# -- NVFP4 -----------------------------------------------------------------------------------------------


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor fp32 scale that maps a tensor-wide |x| ≤ amax onto e4m3 block scales without overflow."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(amax > 0, amax / (E2M1_MAX * 448.0), 1.0)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] → packed e2m1 [..., n/2] and e4m3 block scales (codes) [..., n/16]; value = e2m1 · scale · global.

    Block scale = amax / 6 / global rounded to e4m3 (saturating); values are divided by the *rounded* scale, so
    what is stored is what dequantization multiplies by. A zero scale zeroes its block.
    """
    xb = _blocks(x, NVFP4_BLOCK, "nvfp4")
    amax, finite = finite_amax(xb)
    scale_codes = e4m3_encode(amax / (E2M1_MAX * global_scale))
    scale = e4m3_decode(scale_codes) * global_scale
    scaled = torch.where((scale > 0)[..., None] & finite[..., None], xb / scale.clamp_min(1e-45)[..., None], 0.0)
    codes = e2m1_encode(scaled)
    scale_codes = torch.where(finite, scale_codes, torch.tensor(E4M3_NAN, dtype=torch.uint8, device=x.device))
    return pack_nibbles(codes.reshape(x.shape)), scale_codes


def nvfp4_dequantize(packed: torch.Tensor, scale_codes: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `nvfp4_quantize` (fp32 [..., n])."""
    values = e2m1_decode(unpack_nibbles(packed)).reshape(*scale_codes.shape, NVFP4_BLOCK)
    scale = e4m3_decode(scale_codes) * global_scale
    return (values * scale[..., None]).reshape(*scale_codes.shape[:-1], -1)
