"""Disk keys of cached pages, shared by the radix tree (which names pages) and the disk tier (which stores them)."""

from __future__ import annotations

import hashlib


def root_hash(namespace: bytes) -> bytes:
    """Key of the empty prefix: the model fingerprint, so two models never share a disk file."""
    return hashlib.blake2b(namespace, digest_size=20).digest()


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Key of a page given the key of the page before it: a hash of the whole token prefix."""
    return hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=20).digest()


# Prefix-cache keys are 4-byte ints: token ids (shifted per LoRA adapter) stay below IMAGE_KEY_BASE, the keys of
# image placeholders above it, so no text ever matches an image's pages and an image only matches itself.
IMAGE_KEY_BASE = 1 << 31


def image_keys(content_hash: str, num_tokens: int, namespace: int = 0) -> list[int]:
    """The cache keys of an image's placeholder run: placeholder j of the image with this content hash (under an
    adapter's `namespace`) → an int in [2^31, 2^32); different images differ in every key, collisions aside."""
    seed = f"{content_hash}:{namespace}:".encode()
    keys = []
    for j in range(num_tokens):
        h = hashlib.blake2b(seed + j.to_bytes(4, "little"), digest_size=4).digest()
        keys.append(IMAGE_KEY_BASE | (int.from_bytes(h, "little") & (IMAGE_KEY_BASE - 1)))
    return keys


def multimodal_keys(ids: list[int], images: list[tuple[int, str, int]], namespace: int = 0) -> list[int]:
    """A prompt's cache keys: token ids shifted into `namespace`, with each image's placeholder run
    (offset, content hash, length) replaced by that image's content keys."""
    keys = [t + namespace for t in ids]
    for offset, content_hash, n in images:
        keys[offset : offset + n] = image_keys(content_hash, n, namespace)
    return keys
