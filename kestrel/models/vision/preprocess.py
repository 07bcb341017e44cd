"""Image bytes → the tower's input, as `Kimi_K25ImageProcessor` does it (Pillow + torch, no transformers).

decode (size-checked from the header, before any pixel is decoded) → RGB (transparency onto white) → NaViT resize
(at most `max_patches` 14-px patches, `max_patches_per_side` per side, never upscaled; bicubic, antialiased, on
uint8 like torchvision) → zero padding to a multiple of 28 px → (x - 255·mean) / (255·std) → 14x14 patches.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps, UnidentifiedImageError

from kestrel.config import VisionConfig
from kestrel.models.vision.moonvit import Grid, num_image_tokens


class ImageError(ValueError):
    """An image Kestrel will not process: not an image, truncated, or larger than the limits."""


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready for the tower; `content_hash` names its pixels (the encoder cache and prefix-cache key)."""

    pixel_values: torch.Tensor  # [h·w, 3, patch, patch] float32, row-major patches
    grid: Grid  # (1, h, w) in patches
    num_tokens: int  # prompt placeholders: merged patches
    content_hash: str


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode `data`, refusing images over `max_pixels` from their header alone (no decompression bomb is expanded)."""
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # Pillow's own header check (past 2 x Image.MAX_IMAGE_PIXELS)
        raise ImageError(f"image is larger than the {max_pixels} pixels accepted ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageError(f"not a decodable image ({type(exc).__name__})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, larger than the {max_pixels} accepted")
    try:
        image.load()
        return ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ImageError(f"image data is truncated or corrupt ({exc})") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' rule: anything with transparency is composited onto white, everything else converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def navit_size(
    height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(resized height, width), (padded height, width): the largest scale ≤ 1 within both patch budgets, then
    padding up to a multiple of merge·patch pixels."""
    patches_h, patches_w = max(1.0, height // patch), max(1.0, width // patch)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        max_side * patch / height,
        max_side * patch / width,
    )
    new_h = min(max(1, int(height * scale)), max_side * patch)
    new_w = min(max(1, int(width * scale)), max_side * patch)
    step = merge * patch
    return (new_h, new_w), (-(-new_h // step) * step, -(-new_w // step) * step)


def image_tokens(height: int, width: int, cfg: VisionConfig) -> int:
    """Placeholders an image of height x width pixels takes (without decoding it)."""
    p = cfg.patch_size
    _, (pad_h, pad_w) = navit_size(height, width, p, cfg.merge_kernel[0], cfg.max_patches, cfg.max_patches_per_side)
    return num_image_tokens(cfg, (1, pad_h // p, pad_w // p))


def preprocess_image(image: Image.Image, cfg: VisionConfig) -> ProcessedImage:
    """Resize, pad, normalise and patchify one decoded image for `cfg`'s tower."""
    pixels = torch.from_numpy(np.array(to_rgb(image))).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
    p = cfg.patch_size
    (new_h, new_w), (pad_h, pad_w) = navit_size(
        pixels.shape[1], pixels.shape[2], p, cfg.merge_kernel[0], cfg.max_patches, cfg.max_patches_per_side
    )
    if (new_h, new_w) != tuple(pixels.shape[1:]):
        # uint8 in, uint8 out: torch's antialiased bicubic kernel for bytes, the one torchvision calls on CPU.
        pixels = F.interpolate(pixels[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[
            0
        ]
    pixels = F.pad(pixels, (0, pad_w - new_w, 0, pad_h - new_h))
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((tuple(pixels.shape), cfg.image_mean, cfg.image_std, p)).encode())
    digest.update(pixels.numpy().tobytes())
    mean = torch.tensor([m * 255.0 for m in cfg.image_mean]).view(3, 1, 1)
    std = torch.tensor([s * 255.0 for s in cfg.image_std]).view(3, 1, 1)
    x = (pixels.float() - mean) / std
    h, w = pad_h // p, pad_w // p
    patches = x.view(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, p, p)
    grid = (1, h, w)
    return ProcessedImage(patches, grid, num_image_tokens(cfg, grid), digest.hexdigest())


def load_image(data: bytes, cfg: VisionConfig, max_pixels: int) -> ProcessedImage:
    """Bytes of an image file → `ProcessedImage` (ImageError for anything that is not an acceptable image)."""
    return preprocess_image(open_image(data, max_pixels), cfg)
