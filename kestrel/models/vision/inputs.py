"""Where a prompt's images go: each image owns one run of placeholder tokens, as long as its merged patches."""

from __future__ import annotations

import torch

from kestrel.models.vision.preprocess import ProcessedImage


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of `token_id` in `ids`."""
    runs, start = [], None
    for i, t in enumerate([*ids, None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def expand_placeholders(ids: list[int], images: list[ProcessedImage], token_id: int) -> list[int]:
    """The chat template writes one placeholder per image; the model reads one per merged patch."""
    singles = [i for i, t in enumerate(ids) if t == token_id]
    if len(singles) != len(images):
        raise ValueError(f"images: the prompt has {len(singles)} image placeholder(s) for {len(images)} image(s)")
    out, start = [], 0
    for i, image in zip(singles, images):
        out += ids[start:i] + [token_id] * image.num_tokens
        start = i + 1
    return out + ids[start:]


def image_offsets(ids: list[int], images: list[ProcessedImage], token_id: int) -> list[int]:
    """The first placeholder position of each image; ValueError when runs and images do not pair up exactly."""
    runs = placeholder_runs(ids, token_id)
    if len(runs) != len(images):
        raise ValueError(f"images: the prompt has {len(runs)} image placeholder run(s) for {len(images)} image(s)")
    for i, ((_, length), image) in enumerate(zip(runs, images)):
        if length != image.num_tokens:
            raise ValueError(f"images[{i}]: {image.num_tokens} placeholder tokens expected, the prompt has {length}")
    return [offset for offset, _ in runs]


def encode_images(model, images: list[ProcessedImage]) -> list[torch.Tensor]:
    """Each image's placeholder embeddings [num_tokens, hidden], from one tower forward over all of them."""
    if not images:
        return []
    pixels = torch.cat([im.pixel_values for im in images]).to(model.device)
    return model.encode_images(pixels, [im.grid for im in images])


def splice_rows(offsets: list[int], images: list[ProcessedImage], base: int = 0) -> list[int]:
    """Flat rows (from `base`) of every placeholder, image after image."""
    return [base + off + j for off, im in zip(offsets, images) for j in range(im.num_tokens)]
