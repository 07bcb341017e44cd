"""FP8 e4m3 (OCP `E4M3FN`: no infinities, one NaN code per sign, max 448) and E8M0 power-of-two scales.

Encoding is round-to-nearest-even with saturation: finite values beyond ±448 become ±448 and ±inf saturates as
well (the OCP "saturating" conversion); NaN stays NaN. Subnormals (magnitude < 2^-6, step 2^-9) are kept.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # S.1111.111: the only NaN encodings of E4M3FN
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float → uint8 e4m3 codes (RNE, saturating, NaN kept)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes → fp32."""
    return codes.view(torch.float8_e4m3fn).float()


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes → fp32 2^(code - 127); 0xFF is NaN."""
    value = torch.ldexp(torch.ones_like(codes, dtype=torch.float32), codes.to(torch.int32) - E8M0_BIAS)
    return value.masked_fill(codes == E8M0_NAN, float("nan"))


def finite_amax(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest finite magnitude along `dim`, and whether every value there is finite."""
    finite = torch.isfinite(x)
    return torch.where(finite, x.abs(), 0.0).amax(dim), finite.all(dim)


def fp8_quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] → e4m3 codes [..., n] and one fp32 scale per `group` values [..., n / group] (scale = amax / 448).

    The scale comes from the group's finite values, so an infinity saturates to ±448·scale and a NaN stays a NaN
    without spoiling its neighbours.
    """
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"fp8 groups: last dim {n} is not a multiple of the group size {group}")
    xf = x.float().reshape(*x.shape[:-1], n // group, group)
    amax, _ = finite_amax(xf)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    codes = e4m3_encode(xf / scale[..., None])
    return codes.reshape(x.shape), scale


def fp8_dequantize_groups(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `fp8_quantize_groups` (fp32)."""
    n, groups = codes.shape[-1], scale.shape[-1]
    values = e4m3_decode(codes).reshape(*codes.shape[:-1], groups, n // groups)
    return (values * scale[..., None]).reshape(codes.shape)
