"""Disk keys of cached pages, shared by the radix tree (which names pages) and the disk tier (which stores them)."""

from __future__ import annotations

import hashlib


def root_hash(namespace: bytes) -> bytes:
    """Key of the empty prefix: the model fingerprint, so two models never share a disk file."""
    return hashlib.blake2b(namespace, digest_size=20).digest()


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Key of a page given the key of the page before it: a hash of the whole token prefix."""
    return hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=20).digest()
