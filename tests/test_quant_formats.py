"""FP8 / NVFP4 / MXFP4 against a reference quantizer written from the format specs (OCP FP8 and MX v1.0, NVFP4).

The reference enumerates every code's value from its bit fields and picks the nearest (ties: even code, i.e.
mantissa LSB 0) one element at a time in Python; block scales follow the spec formulas per block.
"""

from __future__ import annotations

import math

import pytest
import torch

from kestrel.quant.fp4 import (
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)
from kestrel.quant.fp8 import e4m3_decode, e4m3_encode, fp8_dequantize_groups, fp8_quantize_groups


def minifloat_values(exp_bits: int, man_bits: int, bias: int, reserved: set[int]) -> dict[int, float]:
    """Positive codes → value: subnormal when the exponent field is 0, else 2^(e − bias)·(1 + m/2^man_bits)."""
    out = {}
    for code in range(1 << (exp_bits + man_bits)):
        if code in reserved:
            continue
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        out[code] = (
            (m / (1 << man_bits)) * 2.0 ** (1 - bias) if e == 0 else (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        )
    return out


E4M3 = minifloat_values(4, 3, 7, reserved={0x7F})  # S.1111.111 is NaN; no infinities
E2M1 = minifloat_values(2, 1, 1, reserved=set())
SIGN = {"e4m3": 0x80, "e2m1": 0x8}


def ref_encode(v: float, table: dict[int, float], sign_bit: int) -> int:
    """Nearest representable, ties to the even code, saturating at the largest finite value."""
    if math.isnan(v):
        return 0x7F | (sign_bit if math.copysign(1, v) < 0 else 0)
    mag = min(abs(v), max(table.values()))
    best = min(table, key=lambda c: (abs(table[c] - mag), c & 1))
    return best | (sign_bit if math.copysign(1.0, v) < 0 else 0)


def interesting(n: int, seed: int) -> torch.Tensor:
    """Random values over many binades plus exact midpoints, zeros of both signs and tiny (subnormal) ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 10, (n,), generator=g).float())
    x[::7] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]).repeat(n)[: len(x[::7])] * 2.0
    x[3::11] = -0.0
    x[5::13] = 0.0
    return x


def test_e4m3_matches_spec_including_subnormals_saturation_and_nan():
    ties = [(a + b) / 2 for a, b in zip(sorted(E4M3.values()), sorted(E4M3.values())[1:])]
    x = torch.tensor(ties + [2.0**-9, 2.0**-10, 3 * 2.0**-10, 447.0, 460.0, 1e6, float("inf"), -float("inf"), -0.0])
    x = torch.cat([x, -x, interesting(2000, 0)])
    got = e4m3_encode(x).tolist()
    want = [ref_encode(v, E4M3, SIGN["e4m3"]) for v in x.tolist()]
    assert got == want
    assert math.isnan(e4m3_decode(e4m3_encode(torch.tensor([float("nan")]))).item())
    assert e4m3_decode(torch.tensor([1], dtype=torch.uint8)).item() == 2.0**-9  # smallest subnormal


def test_fp8_groups_round_trip_with_fp32_scales():
    x = interesting(4 * 256, 1).view(4, 256)
    x[1, 5], x[2, 200] = float("inf"), float("nan")
    codes, scale = fp8_quantize_groups(x, 128)
    assert codes.dtype == torch.uint8 and codes.shape == (4, 256) and scale.shape == (4, 2)
    for r in range(4):
        for gi in range(2):
            block = x[r, gi * 128 : (gi + 1) * 128].tolist()
            amax = max((abs(v) for v in block if math.isfinite(v)), default=0.0)
            s = amax / 448.0 if amax > 0 else 1.0
            assert scale[r, gi].item() == pytest.approx(s, rel=1e-7)
            want = [ref_encode(v / scale[r, gi].item(), E4M3, SIGN["e4m3"]) for v in block]
            assert codes[r, gi * 128 : (gi + 1) * 128].tolist() == want
    back = fp8_dequantize_groups(codes, scale)
    assert back[1, 5].item() == pytest.approx(448.0 * scale[1, 0].item(), rel=1e-6)  # +inf saturates
    assert math.isnan(back[2, 200].item())
    finite = torch.isfinite(x)
    # e4m3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normals, absolute ≤ 2^-10·scale below.
    err = (back - x).abs()[finite]
    bound = torch.maximum(x.abs() * 2.0**-4, scale.repeat_interleave(128, 1) * 2.0**-10)[finite]
    assert bool((err <= bound).all())


def ref_e2m1_block(block: list[float], scale: float) -> list[int]:
    return [ref_encode(v / scale, E2M1, SIGN["e2m1"]) for v in block]


def test_e2m1_pack_unpack_is_lossless():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 32) and (packed[:, 0] & 0x0F).tolist() == codes[:, 0].tolist()
    assert torch.equal(unpack_nibbles(packed), codes)


def test_mxfp4_matches_ocp_mx_reference():
    x = interesting(8 * 64, 2).view(8, 64)
    x[1] = 0.0  # all-zero block
    x[2, :32] = torch.linspace(-7.5, 7.5, 32)  # amax in [4, 8): the top saturates to 6
    x[3, 40] = float("nan")
    x[4, 3] = -float("inf")
    x[5, :32] *= 2.0**-130  # subnormal fp32 inputs: smallest scale
    packed, scales = mxfp4_quantize(x)
    assert packed.shape == (8, 32) and scales.shape == (8, 2) and scales.dtype == torch.uint8
    codes = unpack_nibbles(packed)
    for r in range(8):
        for b in range(2):
            block = x[r, b * 32 : (b + 1) * 32].tolist()
            if not all(math.isfinite(v) for v in block):
                assert scales[r, b].item() == 0xFF
                continue
            amax = max(abs(v) for v in block)
            shared = max(-127, min(127, math.floor(math.log2(amax)) - 2)) if amax > 0 else -127
            assert scales[r, b].item() == shared + 127
            assert codes[r, b * 32 : (b + 1) * 32].tolist() == ref_e2m1_block(block, 2.0**shared)
    back = mxfp4_dequantize(packed, scales)
    assert torch.isnan(back[3, 32:]).all() and torch.isnan(back[4, :32]).all()
    assert back[2, 31].item() == 6.0 and back[2, 0].item() == -6.0  # 7.5 saturates to 6·2^0
    assert bool((back[1] == 0).all())


def test_nvfp4_matches_reference_with_e4m3_block_scales():
    x = interesting(6 * 64, 3).view(6, 64)
    x[1, 16:32] = 0.0
    x[2, 7] = float("nan")
    g = nvfp4_global_scale(x[torch.isfinite(x)].abs().max())
    packed, scale_codes = nvfp4_quantize(x, g)
    assert packed.shape == (6, 32) and scale_codes.shape == (6, 4)
    codes = unpack_nibbles(packed)
    for r in range(6):
        for b in range(4):
            block = x[r, b * 16 : (b + 1) * 16].tolist()
            if not all(math.isfinite(v) for v in block):
                assert scale_codes[r, b].item() == 0x7F  # NaN scale: the block reads back as NaN
                continue
            amax = max(abs(v) for v in block)
            want_code = ref_encode(amax / 6.0 / g.item(), E4M3, SIGN["e4m3"])
            assert scale_codes[r, b].item() == want_code
            s = E4M3.get(want_code, 0.0) * g.item()
            want = ref_e2m1_block(block, s) if s > 0 else [0] * 16
            assert codes[r, b * 16 : (b + 1) * 16].tolist() == want
    back = nvfp4_dequantize(packed, scale_codes, g)
    assert torch.isnan(back[2, :16]).all() and bool((back[1, 16:32] == 0).all())
    # Values ≥ a quarter of their block's amax lie in e2m1's [1.5, 6]·scale, where half a step is ≤ 20% of the value.
    xb, bb = x.view(6, 4, 16), back.view(6, 4, 16)
    big = torch.isfinite(bb) & (xb.abs() > 0) & (xb.abs() >= xb.abs().amax(-1, keepdim=True) / 4)
    assert float(((bb - xb).abs() / xb.abs())[big].max()) <= 0.2 + 2**-4


def test_block_sizes_are_enforced():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        mxfp4_quantize(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        fp8_quantize_groups(torch.zeros(2, 200), 128)
