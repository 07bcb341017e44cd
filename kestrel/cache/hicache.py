"""HiCache: the tiers below the device pool for the radix cache: host memory (L2) and a directory on disk (L3).

L2 keeps evicted pages and checkpoints in host tensors under a byte budget (`--hicache-size`). L3 is a store
of page files keyed by the chain hash of their token prefix (plus one file per checkpoint), written atomically
(temp file + rename) behind a SHA-256 checksum, so it survives restarts and a torn or corrupted file is detected
and skipped, never loaded. Write policies (`--hicache-write-policy`), as in SGLang:

- write_through: every page / checkpoint the tree takes is copied down at once; eviction is then free;
- write_through_selective: copied down once a node has been hit twice (only hot prefixes pay the copy);
- write_back: copied down only when evicted from the tier above (and on `flush`, at shutdown).

This module only stores: the radix tree decides what moves between tiers and when (copies are synchronous,
made before the step that needs the data).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kestrel.cache.keys import chain_hash

log = logging.getLogger(__name__)
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HIT_THRESHOLD = 2
_MAGIC = b"KESTRELL3v1\0"
_HEADER = struct.Struct("<12s32sQ")  # magic, sha256 of the payload, payload length


def tensor_bytes(t: dict[str, torch.Tensor] | torch.Tensor | None) -> int:
    if t is None:
        return 0
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(x.numel() * x.element_size() for x in t.values())


@dataclass
class HostCopy:
    """A node's L2 copy: its pages packed [n_pages, page_size, width] and maybe its checkpoint."""

    kv: torch.Tensor | None
    state: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.kv) + tensor_bytes(self.state)

    def split(self, n_pages: int) -> tuple[HostCopy | None, HostCopy | None]:
        """Upper part (first n_pages, no checkpoint) and lower part (the rest, keeps the checkpoint)."""
        if self.kv is None:
            return None, HostCopy(None, self.state)
        return HostCopy(self.kv[:n_pages]), HostCopy(self.kv[n_pages:], self.state)


@dataclass
class DiskHit:
    """Pages found on disk after a tree match: their chain hashes and tokens; `length` tokens are usable.

    `base` is the last page of the matched node when a checkpoint file for it is on disk (the node's own
    checkpoint being gone): then the hit is usable from the node's end even if no page after it is.
    """

    hashes: list[bytes]
    tokens: list[tuple[int, ...]]
    length: int
    page_size: int
    base: tuple[bytes, tuple[int, ...]] | None = None  # (chain hash, tokens) of the matched node's last page

    @property
    def num_pages(self) -> int:
        return self.length // self.page_size


class DiskStore:
    """Page and checkpoint files under `root/<namespace>/<xx>/<hash>.{page,state}`."""

    def __init__(self, root: str | Path, namespace: str) -> None:
        self.root = Path(root)
        self.set_namespace(namespace)
        self.corrupt = 0
        self.written = 0
        self.io_errors = 0  # OS errors on any file: each is a miss or a skipped write, never an exception

    def set_namespace(self, namespace: str) -> None:
        self.dir = self.root / namespace
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"hicache_storage_dir: cannot use {self.root} ({exc.strerror})") from exc

    def path(self, key: bytes, kind: str) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.{kind}"

    def exists(self, key: bytes, kind: str) -> bool:
        target = self.path(key, kind)
        try:
            return target.exists()
        except OSError as exc:
            self._io_error("probe", target, exc)
            return False

    def write(self, key: bytes, kind: str, tensors: dict[str, torch.Tensor], tokens: tuple[int, ...]) -> None:
        """Store the file unless it is there; an OS error skips the write (a cache may always lose an entry)."""
        target = self.path(key, kind)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        try:
            if target.exists():
                return
            payload = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"tokens": json.dumps(tokens)})
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, hashlib.sha256(payload).digest(), len(payload)))
                f.write(payload)
            # Atomic: readers see the whole file or none. No fsync: after a power loss a file whose data never
            # reached the disk fails its checksum and is skipped like any other corrupt file; a cache needs no more.
            os.replace(tmp, target)
        except OSError as exc:
            self._io_error("write", target, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return
        self.written += 1

    def read(self, key: bytes, kind: str, tokens: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        """The file's tensors, or None when missing or unreadable; a corrupt file is counted, deleted, reported None."""
        target = self.path(key, kind)
        try:
            blob = target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # EIO, EACCES, a directory in its place: a miss, and the file is left alone
            self._io_error("read", target, exc)
            return None
        why = self._check(blob, tokens)
        if why is None:
            try:
                return st_load(blob[_HEADER.size :])
            except Exception as exc:  # checksum passed but the payload does not parse: still corrupt
                why = f"unreadable payload ({exc})"
        self.corrupt += 1
        log.warning("hicache: skipping corrupted %s (%s)", target, why)
        try:
            target.unlink(missing_ok=True)
        except OSError as exc:
            self._io_error("delete", target, exc)
        return None

    def _io_error(self, op: str, target: Path, exc: OSError) -> None:
        self.io_errors += 1
        log.warning("hicache: %s of %s failed, treated as a miss (%s)", op, target, exc)

    @staticmethod
    def _check(blob: bytes, tokens: tuple[int, ...]) -> str | None:
        if len(blob) < _HEADER.size:
            return "truncated header"
        magic, digest, length = _HEADER.unpack_from(blob)
        payload = blob[_HEADER.size :]
        if magic != _MAGIC:
            return "bad magic"
        if len(payload) != length:
            return f"truncated: {len(payload)} of {length} payload bytes"
        if hashlib.sha256(payload).digest() != digest:
            return "checksum mismatch"
        header_len = struct.unpack_from("<Q", payload)[0]
        meta = json.loads(payload[8 : 8 + header_len]).get("__metadata__", {})
        if tuple(json.loads(meta.get("tokens", "null")) or ()) != tuple(tokens):
            return "token mismatch"
        return None


class HiCache:
    """Storage below the device pool: the L2 byte budget, the L3 store and the write policy.

    It holds bytes and answers questions; which node moves where, and in which order, is the radix tree's call.
    """

    def __init__(self, host_bytes: int, storage_dir: str | Path | None, write_policy: str, namespace: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        self.host_budget = host_bytes
        self.host_used = 0
        self.policy = write_policy
        self.disk = DiskStore(storage_dir, namespace) if storage_dir else None

    def set_namespace(self, namespace: str) -> None:
        """Another model's files (reloaded weights); the host tier must already be empty."""
        if self.disk is not None:
            self.disk.set_namespace(namespace)

    # -- L2: a byte budget -----------------------------------------------------------------------------
    @property
    def has_host(self) -> bool:
        return self.host_budget > 0

    def host_fits(self, nbytes: int) -> bool:
        """Could nbytes ever be held (with everything else dropped)?"""
        return nbytes <= self.host_budget

    def host_has_room(self, nbytes: int) -> bool:
        return self.host_used + nbytes <= self.host_budget

    def put_host(self, kv: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> HostCopy:
        copy = HostCopy(kv, state)
        self.host_used += tensor_bytes(kv)
        return copy

    def put_host_state(self, copy: HostCopy, state: dict[str, torch.Tensor]) -> None:
        copy.state = state
        self.host_used += tensor_bytes(state)

    def drop_host(self, copy: HostCopy) -> None:
        self.host_used -= copy.nbytes

    def drop_host_state(self, copy: HostCopy) -> None:
        self.host_used -= tensor_bytes(copy.state)
        copy.state = None

    # -- write policy ----------------------------------------------------------------------------------
    def copy_on_insert(self) -> bool:
        return self.policy == "write_through"

    def copy_on_checkpoint(self, has_host_copy: bool) -> bool:
        return self.policy == "write_through" or (self.policy == "write_through_selective" and has_host_copy)

    def copy_on_hit(self, hits: int) -> bool:
        return self.policy == "write_through_selective" and hits >= SELECTIVE_HIT_THRESHOLD

    def spill_to_disk(self) -> bool:
        """Host-only data leaving L2 must be written to L3 first (nothing wrote it earlier)."""
        return self.disk is not None and self.policy == "write_back"

    # -- L3 --------------------------------------------------------------------------------------------
    def probe_disk(
        self,
        parent_hash: bytes,
        pages: list[tuple[int, ...]],
        need_state: bool,
        page_size: int,
        base_page: tuple[int, ...] | None = None,
    ) -> DiskHit | None:
        """Pages present on disk after the tree's match (existence only; contents are verified on load).

        With `base_page` (the matched node's last page, its checkpoint missing), a checkpoint file for the node
        alone is a hit of zero pages.
        """
        if self.disk is None:
            return None
        base = None
        if need_state and base_page is not None and self.disk.exists(parent_hash, "state"):
            base = (parent_hash, base_page)
        hashes, tokens, usable, h = [], [], 0, parent_hash
        for page in pages:
            h = chain_hash(h, page)
            if not self.disk.exists(h, "page"):
                break
            hashes.append(h)
            tokens.append(page)
            if not need_state or self.disk.exists(h, "state"):
                usable = len(hashes)
        if usable == 0 and base is None:
            return None
        return DiskHit(hashes[:usable], tokens[:usable], usable * page_size, page_size, base)

    def read_disk(self, hit: DiskHit, need_state: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor] | None]:
        """Verified pages of a disk hit, cut back to the deepest page whose checkpoint also verified (or to none,
        with the base checkpoint)."""
        pages: list[torch.Tensor] = []
        for h, tokens in zip(hit.hashes, hit.tokens):
            data = self.disk.read(h, "page", tokens)
            if data is None:
                break
            pages.append(data["kv"])
        if need_state:
            while pages:
                state = self.disk.read(hit.hashes[len(pages) - 1], "state", hit.tokens[len(pages) - 1])
                if state is not None:
                    return pages, state
                pages.pop()  # no usable checkpoint at this depth: a shorter prefix, or nothing
            if hit.base is not None:
                return [], self.disk.read(hit.base[0], "state", hit.base[1])
            return [], None
        return pages, None
