"""MoonViT, the Kimi K2.5 / K3 vision tower, with its 2x2 patch merger and the projector to the text width.

Per image (or clip of t frames) of h x w patches, in the checkpoint's own layout (`vision_tower.*`, `mm_projector.*`):

    x   = proj(patch)                                      14-px patches, one Conv2d
    x  += bicubic(pos_emb.weight → h x w) + time[frame]    learned 2-D table; a sinusoid per frame (0 for images)
    x  += wo(attn(norm0(x)))                               full attention within the image, 2-D rotary on q, k
    x  += fc1(gelu_tanh(fc0(norm1(x))))                    per encoder block
    m   = mean over frames of 2x2 neighbours of final_layernorm(x)    → [h/2 · w/2, 4, D]
    out = proj.2(gelu(proj.0(flatten(pre_norm(m)))))                  → [h/2 · w/2, text hidden]

The rotary embedding is the original complex form: head dims in pairs, pair i turning by the column angle (even i)
or the row angle (odd i) of frequency i // 2; q and k use the same pair layout, so Kestrel's interleaved rope
(which also permutes the pairs' outputs, identically for q and k) gives the same attention scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import VisionConfig
from kestrel.models.layers.rope import apply_rope_interleaved

Grid = tuple[int, int, int]  # (frames, patch rows, patch columns)


def time_table(frames: int, dim: int) -> torch.Tensor:
    """[frames + 1, dim]: row 0 zeros (single images get no temporal term), row f + 1 the sinusoid of frame f."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(frames, dtype=torch.float32), inv_freq)
    return torch.cat([torch.zeros(1, dim), torch.cat([freqs.sin(), freqs.cos()], dim=1)])


class PositionEmbedding(nn.Module):
    """The learned [H, W, D] table resized to each grid (bicubic, half-pixel), plus the per-frame sinusoid."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))
        self.register_buffer("time", time_table(cfg.pos_emb_time, cfg.hidden_size), persistent=False)

    def forward(self, grid: Grid) -> torch.Tensor:
        t, h, w = grid
        table = self.weight
        if (h, w) != tuple(table.shape[:2]):
            resized = F.interpolate(
                table.float().permute(2, 0, 1)[None], size=(h, w), mode="bicubic", align_corners=False
            )
            table = resized[0].permute(1, 2, 0)
        spatial = table.reshape(h * w, -1).float()
        if t == 1:
            return spatial
        if t > self.time.shape[0] - 1:
            raise ValueError(f"a clip of {t} frames is longer than the temporal table ({self.time.shape[0] - 1})")
        return (spatial[None] + self.time[1 : t + 1, None, :]).reshape(t * h * w, -1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)
        pos = torch.cat([self.pos_emb(g) for g in grids])
        return x + pos.to(x.dtype)


class Rope2D(nn.Module):
    """cos/sin [n, head_dim] per patch in `apply_rope_interleaved`'s layout: frequency i // 2 of the column
    (even i) or row (odd i) coordinate, over head_dim // 2 pairs."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        quarter = cfg.head_dim // 4
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, grid: Grid, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, w = grid
        rows = torch.arange(h, device=device).repeat_interleave(w).float()
        cols = torch.arange(w, device=device).repeat(h).float()
        angles = torch.stack([cols[:, None] * self.inv_freq, rows[:, None] * self.inv_freq], dim=-1).flatten(1)
        angles = torch.cat([angles, angles], dim=-1).repeat(t, 1)  # frames share their spatial angles
        return angles.cos(), angles.sin()


class MLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.norm0 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-5)
        self.mlp = MLP(cfg)

    def attention(self, x: torch.Tensor, lens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Bidirectional attention within each image's patches (`lens`), never across images."""
        q, k, v = self.wqkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        cos, sin = rope
        q = apply_rope_interleaved(q.float(), cos, sin).to(v.dtype)
        k = apply_rope_interleaved(k.float(), cos, sin).to(v.dtype)
        out = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lens), k.split(lens), v.split(lens))
        ]
        return self.wo(torch.cat(out).reshape(x.shape[0], -1))

    def forward(self, x: torch.Tensor, lens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), lens, rope)
        return x + self.mlp(self.norm1(x))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=1e-5)


class MoonViT(nn.Module):
    """Patches of several images → per-image groups of merged neighbours [Σ h·w / 4, 4, D]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)
        self.rope = Rope2D(cfg)

    def hidden_states(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """The encoder's output per patch [Σ t·h·w, D], after final_layernorm (before merging)."""
        x = self.patch_embed(pixel_values, grids)
        lens = [t * h * w for t, h, w in grids]
        if sum(lens) != x.shape[0]:
            raise ValueError(f"pixel_values holds {x.shape[0]} patches but the grids describe {sum(lens)}")
        cos, sin = (torch.cat(parts) for parts in zip(*(self.rope(g, x.device) for g in grids)))
        for block in self.encoder.blocks:
            x = block(x, lens, (cos, sin))
        return self.encoder.final_layernorm(x)

    def merge(self, x: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """kh x kw neighbours side by side (row-major within the kernel), averaged over a clip's frames."""
        kh, kw = self.cfg.merge_kernel
        out = []
        for xi, (t, h, w) in zip(x.split([t * h * w for t, h, w in grids]), grids):
            if h % kh or w % kw:
                raise ValueError(f"a {h}x{w} patch grid is not a multiple of the {kh}x{kw} merge kernel")
            blocks = xi.float().view(t, h // kh, kh, w // kw, kw, -1).permute(0, 1, 3, 2, 4, 5)
            out.append(blocks.mean(0).reshape((h // kh) * (w // kw), kh * kw, -1).to(x.dtype))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        return self.merge(self.hidden_states(pixel_values, grids), grids)


class Projector(nn.Module):
    """LayerNorm per patch, the kernel's patches concatenated, then Linear → GELU → Linear to the text width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        width = cfg.hidden_size * cfg.merge_area
        self.pre_norm = nn.LayerNorm(cfg.projection_hidden_size, eps=cfg.projection_eps)
        self.proj = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, cfg.text_hidden_size))

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pre_norm(merged).flatten(1))


def num_image_tokens(cfg: VisionConfig, grid: Grid) -> int:
    """Placeholders an image of this patch grid takes in the prompt: one per merged neighbourhood."""
    _, h, w = grid
    return (h // cfg.merge_kernel[0]) * (w // cfg.merge_kernel[1])
