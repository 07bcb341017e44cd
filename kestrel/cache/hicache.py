"""HiCache: the tiers below the device pool for the radix cache: host memory (L2) and a directory on disk (L3).

L2 keeps evicted pages and checkpoints in host tensors under a byte budget (`--hicache-size`). L3 is a store
of page files keyed by the chain hash of their token prefix (plus one file per checkpoint), written atomically
(temp file + rename) behind a SHA-256 checksum, so it survives restarts and a torn or corrupted file is detected
and skipped, never loaded. Write policies (`--hicache-write-policy`), as in SGLang:

- write_through: every page / checkpoint the tree takes is copied down at once; eviction is then free;
- write_through_selective: copied down once a node has been hit twice (only hot prefixes pay the copy);
- write_back: copied down only when evicted from the tier above (and on `flush`, at shutdown).

Copies are synchronous; the scheduler calls into this module before the step that needs the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

if TYPE_CHECKING:
    from kestrel.cache.radix import RadixCache, RadixNode

log = logging.getLogger(__name__)
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
SELECTIVE_HIT_THRESHOLD = 2
_MAGIC = b"KESTRELL3v1\0"
_HEADER = struct.Struct("<12s32sQ")  # magic, sha256 of the payload, payload length


def _nbytes(t: dict[str, torch.Tensor] | torch.Tensor | None) -> int:
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
        return _nbytes(self.kv) + _nbytes(self.state)

    def split(self, n_pages: int) -> tuple[HostCopy | None, HostCopy | None]:
        """Upper part (first n_pages, no checkpoint) and lower part (the rest, keeps the checkpoint)."""
        if self.kv is None:
            return None, HostCopy(None, self.state)
        return HostCopy(self.kv[:n_pages]), HostCopy(self.kv[n_pages:], self.state)


@dataclass
class DiskHit:
    """Pages found on disk after a tree match: their chain hashes and tokens; `length` tokens are usable."""

    hashes: list[bytes]
    tokens: list[tuple[int, ...]]
    length: int
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.length // self.page_size


class DiskStore:
    """Page and checkpoint files under `root/<namespace>/<xx>/<hash>.{page,state}`."""

    def __init__(self, root: str | Path, namespace: str) -> None:
        self.dir = Path(root) / namespace
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"hicache_storage_dir: cannot use {root} ({exc.strerror})") from exc
        self.corrupt = 0
        self.written = 0

    def path(self, key: bytes, kind: str) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.{kind}"

    def exists(self, key: bytes, kind: str) -> bool:
        return self.path(key, kind).exists()

    def write(self, key: bytes, kind: str, tensors: dict[str, torch.Tensor], tokens: tuple[int, ...]) -> None:
        target = self.path(key, kind)
        if target.exists():
            return
        payload = st_save({k: v.contiguous() for k, v in tensors.items()}, metadata={"tokens": json.dumps(tokens)})
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, hashlib.sha256(payload).digest(), len(payload)))
            f.write(payload)
        # Atomic: readers see the whole file or none. No fsync: after a power loss a file whose data never
        # reached the disk fails its checksum and is skipped like any other corrupt file; a cache needs no more.
        os.replace(tmp, target)
        self.written += 1

    def read(self, key: bytes, kind: str, tokens: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
        """The file's tensors, or None when missing; a bad file is counted, deleted and reported as None."""
        target = self.path(key, kind)
        try:
            blob = target.read_bytes()
        except FileNotFoundError:
            return None
        why = self._check(blob, tokens)
        if why is None:
            try:
                return st_load(blob[_HEADER.size :])
            except Exception as exc:  # checksum passed but the payload does not parse: still corrupt
                why = f"unreadable payload ({exc})"
        self.corrupt += 1
        log.warning("hicache: skipping corrupted %s (%s)", target, why)
        target.unlink(missing_ok=True)
        return None

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
    """L2 host pool and L3 disk store behind one radix cache; see the module docstring for the policies."""

    def __init__(self, host_bytes: int, storage_dir: str | Path | None, write_policy: str, namespace: str) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy: must be one of {', '.join(WRITE_POLICIES)}, got {write_policy!r}")
        self.host_budget = host_bytes
        self.host_used = 0
        self.policy = write_policy
        self.disk = DiskStore(storage_dir, namespace) if storage_dir else None
        self.radix: RadixCache | None = None

    def attach(self, radix: RadixCache) -> None:
        self.radix, self.io = radix, radix.io

    @property
    def has_host(self) -> bool:
        return self.host_budget > 0

    # -- tree events -----------------------------------------------------------------------------------
    def on_insert(self, node: RadixNode) -> None:
        if self.policy == "write_through":
            self.backup(node)

    def on_checkpoint(self, node: RadixNode) -> None:
        if self.policy == "write_through" or (self.policy == "write_through_selective" and node.host is not None):
            self.backup(node)

    def on_hit(self, node: RadixNode) -> None:
        if self.policy == "write_through_selective" and node.hits >= SELECTIVE_HIT_THRESHOLD:
            self.backup(node)

    def save_for_eviction(self, node: RadixNode) -> bool:
        """Before a node leaves the device: keep it on host (True) or at least on disk (False: node removed)."""
        if self.has_host and self.backup_host(node):
            return True
        if self.disk is not None:
            self.write_disk(node)
        return False

    def save_state_for_eviction(self, node: RadixNode) -> None:
        if self.has_host and node.host is not None and self._put_host_state(node):
            return
        if self.disk is not None:
            self.write_disk(node)

    def backup(self, node: RadixNode) -> None:
        """Copy a device node down every tier (host, then disk)."""
        if self.has_host:
            self.backup_host(node)
        if self.disk is not None:
            self.write_disk(node)

    # -- L2 --------------------------------------------------------------------------------------------
    def backup_host(self, node: RadixNode) -> bool:
        if node.host is None or node.host.kv is None:
            if not node.on_device:
                return False
            need = node.num_pages * self.radix.page_size * self.io.packed_bytes_per_token
            if not self._make_room(need, keep=node):
                return False
            state = node.host.state if node.host is not None else None
            node.host = HostCopy(self.io.gather_pages(node.pages), state)
            self.host_used += _nbytes(node.host.kv)
        if node.checkpoint is not None and node.host.state is None:
            self._put_host_state(node)
        return True

    def _put_host_state(self, node: RadixNode) -> bool:
        state = self.io.gather_state(node.checkpoint)
        if not self._make_room(_nbytes(state), keep=node):
            return False
        node.host.state = state
        self.host_used += _nbytes(state)
        return True

    def load_host(self, node: RadixNode, pages: list[int]) -> None:
        self.io.scatter_pages(pages, node.host.kv)
        self.radix.set_pages(node, pages)

    def drop_host(self, node: RadixNode) -> None:
        self.host_used -= node.host.nbytes
        node.host = None

    def drop_host_state(self, node: RadixNode) -> None:
        self.host_used -= _nbytes(node.host.state)
        node.host.state = None

    def _make_room(self, nbytes: int, keep: RadixNode) -> bool:
        """Free host bytes, LRU first: backups of device nodes are dropped, host-only leaves move to disk."""
        if nbytes > self.host_budget:
            return False
        if self.host_used + nbytes <= self.host_budget:
            return True
        radix = self.radix
        progress = True
        while progress and self.host_used + nbytes > self.host_budget:
            progress = False
            candidates = sorted(
                (x for x in radix.nodes() if x.host is not None and x is not keep and x.lock_ref == 0),
                key=lambda x: x.last_access,
            )
            for node in candidates:
                if self.host_used + nbytes <= self.host_budget:
                    break
                if node.on_device:
                    self.drop_host(node)
                    progress = True
                elif not node.children:
                    if self.disk is not None and self.policy == "write_back":
                        self.write_disk(node)
                    radix.remove(node)
                    progress = True
        return self.host_used + nbytes <= self.host_budget

    # -- L3 --------------------------------------------------------------------------------------------
    def write_disk(self, node: RadixNode) -> None:
        """Write the node's pages (from device or host) and its checkpoint, skipping files already there."""
        disk, ps = self.disk, self.radix.page_size
        missing = [i for i, h in enumerate(node.hashes) if not disk.exists(h, "page")]
        if missing:
            if node.on_device:
                packed = self.io.gather_pages([node.pages[i] for i in missing])
            elif node.host is not None and node.host.kv is not None:
                packed = node.host.kv[missing]
            else:
                packed = None
            if packed is not None:
                for j, i in enumerate(missing):
                    disk.write(node.hashes[i], "page", {"kv": packed[j]}, node.key[i * ps : (i + 1) * ps])
        last = node.hashes[-1] if node.hashes else None
        if last is not None and not disk.exists(last, "state"):
            state = None
            if node.checkpoint is not None:
                state = self.io.gather_state(node.checkpoint)
            elif node.host is not None and node.host.state is not None:
                state = node.host.state
            if state is not None:
                disk.write(last, "state", state, node.key[-ps:])

    def probe_disk(self, parent_hash: bytes, ids: list[int], start: int, max_pages: int, need_state: bool):
        """Pages present on disk after the tree's match (existence only; contents are verified on load)."""
        if self.disk is None:
            return None
        from kestrel.cache.radix import chain_hash

        ps = self.radix.page_size
        hashes, tokens, usable, h = [], [], 0, parent_hash
        for i in range(start, max_pages):
            page = tuple(ids[i * ps : (i + 1) * ps])
            h = chain_hash(h, page)
            if not self.disk.exists(h, "page"):
                break
            hashes.append(h)
            tokens.append(page)
            if not need_state or self.disk.exists(h, "state"):
                usable = len(hashes)
        if usable == 0:
            return None
        return DiskHit(hashes[:usable], tokens[:usable], usable * ps, ps)

    def read_disk(self, hit: DiskHit) -> tuple[list[torch.Tensor], dict[str, torch.Tensor] | None]:
        """Verified pages of a disk hit, cut back to the deepest page whose checkpoint also verified."""
        pages: list[torch.Tensor] = []
        for h, tokens in zip(hit.hashes, hit.tokens):
            data = self.disk.read(h, "page", tokens)
            if data is None:
                break
            pages.append(data["kv"])
        if self.radix.has_state:
            while pages:
                state = self.disk.read(hit.hashes[len(pages) - 1], "state", hit.tokens[len(pages) - 1])
                if state is not None:
                    return pages, state
                pages.pop()  # no usable checkpoint at this depth: a shorter prefix, or nothing
            return [], None
        return pages, None

    def flush(self) -> None:
        """Write every node still held only in memory to disk (write_back at shutdown)."""
        if self.disk is None:
            return
        for node in list(self.radix.nodes()):
            if node.on_device or node.host is not None:
                self.write_disk(node)
