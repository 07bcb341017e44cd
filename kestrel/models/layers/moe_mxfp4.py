"""Routed experts kept in MXFP4, as Hugging Face stores them (`*_blocks` [E, out, in/32, 16] e2m1 pairs,
`*_scales` [E, out, in/32] E8M0): about a quarter of bf16. Each GEMM dequantizes its expert's weight one tile
of output rows at a time, so no full-precision copy of the experts ever exists (plain torch ops: any device).

Kestrel's stacked gate|up keeps gate rows first, then up rows (gpt-oss interleaves them; its layout is the same
otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ModelConfig
from kestrel.quant.fp4 import MXFP4_BLOCK, mxfp4_dequantize_blocks, mxfp4_quantize

# Output rows dequantized at once: bounds the transient full-precision tile (512 × 7168 fp32 = 14 MiB).
TILE_ROWS = 512


class MXFP4Experts(nn.Module):
    """Stacked routed experts in MXFP4; same forward contract as `Experts` (x [T, D], ids / weights [T, k])."""

    def __init__(self, cfg: ModelConfig, hidden: int) -> None:
        super().__init__()
        n, inter = cfg.num_experts, cfg.moe_intermediate_size
        for name, (out, inp) in {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}.items():
            blocks = torch.zeros(n, out, inp // MXFP4_BLOCK, MXFP4_BLOCK // 2, dtype=torch.uint8)
            scales = torch.zeros(n, out, inp // MXFP4_BLOCK, dtype=torch.uint8)
            setattr(self, f"{name}_blocks", nn.Parameter(blocks, requires_grad=False))
            setattr(self, f"{name}_scales", nn.Parameter(scales, requires_grad=False))
        self.act_kind, self.beta, self.linear_beta = cfg.hidden_act, cfg.situ_beta or 0.0, cfg.situ_linear_beta or 0.0

    @torch.no_grad()
    def pack_(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Quantize dense stacked weights ([E, 2I, D] and [E, D, I]) into this module with Kestrel's quantizer."""
        for name, dense in (("gate_up_proj", gate_up), ("down_proj", down)):
            blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
            packed, s = mxfp4_quantize(dense.to(blocks.device))
            blocks.copy_(packed.view(blocks.shape))
            scales.copy_(s)

    def dense(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized stacked weights (tests and conversions; the forward never builds them)."""
        return tuple(
            mxfp4_dequantize_blocks(getattr(self, f"{n}_blocks"), getattr(self, f"{n}_scales"), dtype)
            for n in ("gate_up_proj", "down_proj")
        )

    def resident_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def bf16_bytes(self) -> int:
        """What the same experts take in bf16."""
        return sum(2 * p.numel() * 2 for n, p in self.named_parameters() if n.endswith("_blocks"))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        args = (
            x,
            ids,
            weights,
            self.gate_up_proj_blocks,
            self.gate_up_proj_scales,
            self.down_proj_blocks,
            self.down_proj_scales,
            self.act_kind,
            self.beta,
            self.linear_beta,
        )
        if torch.compiler.is_compiling():
            return torch.ops.kestrel.mxfp4_expert_segments(*args)
        return mxfp4_expert_segments(*args)


def expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(resident bytes of every MXFP4 expert module, what they would take in bf16)."""
    mods = [m for m in model.modules() if isinstance(m, MXFP4Experts)]
    return sum(m.resident_bytes() for m in mods), sum(m.bf16_bytes() for m in mods)


def tiled_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ W.T for W in MXFP4 ([out, in/32, 16] + [out, in/32]), dequantizing TILE_ROWS rows at a time."""
    outs = [
        F.linear(x, mxfp4_dequantize_blocks(blocks[lo : lo + TILE_ROWS], scales[lo : lo + TILE_ROWS], x.dtype))
        for lo in range(0, blocks.shape[0], TILE_ROWS)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def mxfp4_expert_segments(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    act: str,
    beta: float,
    linear_beta: float,
) -> torch.Tensor:
    """Σ_k weight·expert(x) with the pairs sorted by expert; only experts that got tokens are dequantized."""
    from kestrel.models.layers.moe import situ  # moe.py imports this module

    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up_blocks.shape[0]).tolist()
    token_of = order // ids.shape[1]
    xs = x[token_of]
    ys, start = [], 0
    for e, n in enumerate(counts):
        if n:
            gate, up = tiled_linear(xs[start : start + n], gate_up_blocks[e], gate_up_scales[e]).chunk(2, dim=-1)
            h = situ(gate, up, beta, linear_beta or None) if act == "situ" else F.silu(gate) * up
            ys.append(tiled_linear(h, down_blocks[e], down_scales[e]))
            start += n
    y = torch.cat(ys) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))


# Opaque to torch.compile (data-dependent loop over experts); the output has x's shape.
torch.library.custom_op("kestrel::mxfp4_expert_segments", mutates_args=())(mxfp4_expert_segments).register_fake(
    lambda x, *args: torch.empty_like(x)
)
