"""Radix prefix cache for hybrid models: KV pages of MLA/DSA layers plus KDA state checkpoints.

The tree is keyed by token ids at page granularity: every edge holds whole pages. A node owns the device pages
of its edge (MLA latents, rope keys and DSA index keys of every full-attention layer, one page table for all)
and may own a *checkpoint*: a state-pool slot holding the conv + recurrent state of every KDA layer after the
node's last token. KV can be reused page by page, but a KDA layer can only resume from a saved state, so a
match ends at the deepest matched node that has a checkpoint (any matched node for models without KDA).

Running requests lock their path (lock counts run up to the root); eviction frees LRU unlocked leaves, and
checkpoints are evicted on their own when the state pool runs dry. With a `HiCache` attached, evicted pages
and checkpoints move to host memory / disk instead of being dropped, and a match continues into those tiers;
which node moves down, is dropped or is removed is decided here (the tiers only store). Everything here is
plain Python over integers; tensor traffic goes through `CacheIO`.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from kestrel.cache.hicache import DiskHit, HiCache, HostCopy, tensor_bytes
from kestrel.cache.keys import chain_hash, root_hash
from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.pool_io import CacheIO
from kestrel.cache.prefix import Acquired, CacheStats, Committed, PrefixMatch
from kestrel.cache.state_pool import SlotAllocator


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]  # the edge's tokens, a whole number of pages
    parent: RadixNode | None
    depth: int  # tokens from the root through the end of this edge
    pages: list[int] | None  # device pages; None once evicted to a lower tier
    hashes: list[bytes]  # chain hash of each page (disk keys)
    checkpoint: int | None = None  # device state slot: the KDA states after this node's last token
    host: HostCopy | None = None  # L2 copy of the pages (and maybe of the checkpoint)
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    hits: int = 0

    @property
    def num_pages(self) -> int:
        return len(self.hashes)

    @property
    def on_device(self) -> bool:
        return self.pages is not None

    @property
    def has_checkpoint(self) -> bool:
        return self.checkpoint is not None or (self.host is not None and self.host.state is not None)

    def path(self) -> list[RadixNode]:
        """Root's child → self."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class RadixCache:
    """The tree plus its allocators; takes and returns plain values (token ids, pages, slots), never requests."""

    shares_prefixes = True

    def __init__(
        self,
        pages: PageAllocator,
        slots: SlotAllocator,
        io: CacheIO,
        track_interval: int,
        max_states_per_path: int = -1,
        hicache: HiCache | None = None,
        namespace: bytes = b"kestrel",
    ) -> None:
        self.allocator, self.slots, self.io = pages, slots, io
        self.page_size = pages.page_size
        if track_interval % self.page_size:
            raise ValueError(f"state_track_interval {track_interval} must be a multiple of page_size {self.page_size}")
        self.track_interval = track_interval
        self.max_states_per_path = max_states_per_path
        # KDA layers: a match must end at a checkpoint, and the scheduler plans where checkpoints are taken.
        self.has_state = self.takes_checkpoints = slots.num_slots > 0
        self.hicache = hicache
        self.root_hash = root_hash(namespace)
        self.root = RadixNode((), None, 0, [], [])
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.stats = CacheStats()
        # Kept incrementally so that reporting them costs nothing per step (see `check_counters`).
        self.num_device_pages = 0
        self.num_locked_pages = 0  # device pages of nodes some running request locks
        self.num_checkpoints = 0

    # -- helpers ---------------------------------------------------------------------------------------
    def _tick(self, node: RadixNode) -> None:
        node.last_access = next(self._clock)

    def _page(self, ids: list[int] | tuple[int, ...], i: int) -> tuple[int, ...]:
        return tuple(ids[i * self.page_size : (i + 1) * self.page_size])

    def _last_hash(self, node: RadixNode) -> bytes:
        return node.hashes[-1] if node.hashes else self.root_hash

    def _matched_pages(self, node: RadixNode, ids, start_page: int, max_pages: int) -> int:
        n = 0
        while n < node.num_pages and start_page + n < max_pages:
            if self._page(node.key, n) != self._page(ids, start_page + n):
                break
            n += 1
        return n

    def _split(self, node: RadixNode, n_pages: int) -> RadixNode:
        """Cut `node` after n_pages; returns the new upper part. `node` keeps its end (and checkpoint)."""
        ps = self.page_size
        upper = RadixNode(
            node.key[: n_pages * ps],
            node.parent,
            node.depth - len(node.key) + n_pages * ps,
            node.pages[:n_pages] if node.pages is not None else None,
            node.hashes[:n_pages],
            lock_ref=node.lock_ref,
            last_access=node.last_access,
            hits=node.hits,
        )
        if node.host is not None:
            upper.host, node.host = node.host.split(n_pages)
        node.parent.children[upper.key[:ps]] = upper
        node.key = node.key[n_pages * ps :]
        node.pages = node.pages[n_pages:] if node.pages is not None else None
        node.hashes = node.hashes[n_pages:]
        node.parent = upper
        upper.children[node.key[:ps]] = node
        return upper

    def _new_child(self, parent: RadixNode, key: tuple[int, ...], pages: list[int] | None) -> RadixNode:
        hashes, h = [], self._last_hash(parent)
        for i in range(len(key) // self.page_size):
            h = chain_hash(h, self._page(key, i))
            hashes.append(h)
        node = RadixNode(key, parent, parent.depth + len(key), None, hashes)
        parent.children[key[: self.page_size]] = node
        self.set_pages(node, pages)
        self._tick(node)
        return node

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref += 1
            if node.lock_ref == 1 and node.on_device:
                self.num_locked_pages += node.num_pages
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix lock underflow"
            if node.lock_ref == 0 and node.on_device:
                self.num_locked_pages -= node.num_pages
            node = node.parent

    def set_pages(self, node: RadixNode, pages: list[int] | None) -> None:
        """Put a node's edge on the device (pages) or take it off (None), keeping the counters exact."""
        sign = (pages is not None) - node.on_device
        self.num_device_pages += sign * node.num_pages
        if node.lock_ref > 0:
            self.num_locked_pages += sign * node.num_pages
        node.pages = pages

    def set_checkpoint(self, node: RadixNode, slot: int | None) -> None:
        self.num_checkpoints += (slot is not None) - (node.checkpoint is not None)
        node.checkpoint = slot

    # -- matching --------------------------------------------------------------------------------------
    def match(self, ids: list[int], kv_only: bool = False) -> PrefixMatch:
        """Deepest reusable prefix of ids[:-1] (at least one token is always left to compute).

        `kv_only`: the caller brings the KDA states itself (a decode worker receives them with the request), so any
        matched node will do, checkpoint or not, and the lower tiers are not probed."""
        max_pages = (len(ids) - 1) // self.page_size
        node, i = self.root, 0
        best = PrefixMatch(self.root, 0)
        while i < max_pages:
            child = node.children.get(self._page(ids, i))
            if child is None:
                break
            m = self._matched_pages(child, ids, i, max_pages)
            if m < child.num_pages:
                child = self._split(child, m)
            node, i = child, i + m
            self._tick(node)
            if node.has_checkpoint or not self.has_state or kv_only:
                best = PrefixMatch(node, node.depth)
        if self.hicache is not None and not kv_only:
            pages = [self._page(ids, j) for j in range(i, max_pages)]
            # The tree's deepest node may have lost its checkpoint to the disk tier: a file there counts too.
            base = node.key[-self.page_size :] if node is not self.root and not node.has_checkpoint else None
            hit = self.hicache.probe_disk(self._last_hash(node), pages, self.has_state, self.page_size, base)
            # hit.length counts from the node's end, best.length from the prompt's start.
            if hit is not None and node.depth + hit.length > best.length:
                best = PrefixMatch(node, node.depth, hit)
        return best

    def acquire(
        self, ids: list[int], match: PrefixMatch, slot: int | None, prompt_len: int, kv_only: bool = False
    ) -> Acquired | None:
        """Bring the matched prefix onto the device, lock it, and seed the KDA `slot` from its checkpoint.

        Host-tier and disk-tier parts are loaded into fresh device pages first. Returns None (and holds nothing
        for the caller) when the device has no room for them even after eviction. `kv_only` (see `match`): the
        pages alone, no checkpoint needed and no slot seeded.
        """
        self.stats.queried_tokens += prompt_len
        node = match.node
        self.lock(node)
        from_host: set[int] = set()
        for step in node.path():
            if not step.on_device:
                got = self.alloc_pages(step.num_pages)
                if got is None:
                    self.unlock(node)
                    self.stats.queried_tokens -= prompt_len
                    return None
                self.io.scatter_pages(got, step.host.kv)
                self.set_pages(step, got)
                from_host.add(id(step))
        disk_state = None
        if match.disk is not None:
            disk_node, disk_state = self._load_disk(node, ids, match.disk)
            if disk_node is not None:
                self.lock(disk_node)
                self.unlock(node)
                node = disk_node
        if self.has_state and disk_state is None and not kv_only:
            # A checkpoint may have been evicted while room was made: fall back to the deepest one left.
            target = node
            while target is not self.root and not target.has_checkpoint:
                target = target.parent
            if target is not node:
                self.lock(target)
                self.unlock(node)
                node = target
        length = node.depth
        path = node.path()
        if self.has_state and slot is not None and length and not kv_only:
            if disk_state is not None and node.checkpoint is None:
                self.io.scatter_state(slot, disk_state)
            elif node.checkpoint is not None:
                self.io.copy_state(node.checkpoint, slot)
            else:
                self.io.scatter_state(slot, node.host.state)
        disk_tokens = length - match.node.depth if match.disk is not None and length > match.node.depth else 0
        host_tokens = sum(len(step.key) for step in path if id(step) in from_host)
        for step in path:
            step.hits += 1
            self._tick(step)
            if self.hicache is not None and self.hicache.copy_on_hit(step.hits):
                self._backup(step)
        self.stats.hit_tokens += length
        self.stats.disk_hit_tokens += disk_tokens
        self.stats.host_hit_tokens += host_tokens
        self.stats.device_hit_tokens += length - disk_tokens - host_tokens
        hits = {"device": length - disk_tokens - host_tokens, "host": host_tokens, "disk": disk_tokens}
        return Acquired(node, length, [p for step in path for p in step.pages], hits)

    def _load_disk(self, node: RadixNode, ids: list[int], hit: DiskHit):
        """Read, verify and insert a disk continuation under `node`: (new node, its state), (`node`, its state)
        when only its checkpoint came from disk, or (None, None).

        The state also goes into a checkpoint slot when one is free; it is returned so the caller can seed the
        request's slot either way.
        """
        pages_data, state = self.hicache.read_disk(hit, self.has_state)
        n = len(pages_data)
        if n == 0:
            if state is None:
                return None, None
            # Only the node's own checkpoint came from disk.
            if node.checkpoint is None:
                slot = self.alloc_slot()
                if slot is not None:
                    self.io.scatter_state(slot, state)
                    self.set_checkpoint(node, slot)
            return node, state
        got = self.alloc_pages(n)
        if got is None:
            return None, None
        self.io.scatter_pages(got, torch.stack(pages_data))
        key = tuple(ids[node.depth : node.depth + n * self.page_size])
        new = self._new_child(node, key, got)
        if state is not None:
            slot = self.alloc_slot()
            if slot is not None:
                self.io.scatter_state(slot, state)
                self.set_checkpoint(new, slot)
        return new, state

    # -- inserting -------------------------------------------------------------------------------------
    def commit(
        self, ids: list[int], pages: list[int], length: int, node: RadixNode | None, checkpoint: int | None = None
    ) -> Committed:
        """Hand the first `length` tokens of `ids` (page-aligned, computed into `pages`) to the tree; attach a
        checkpoint there. `node` is what the caller locks now (None: nothing).

        Pages the tree already holds replace the caller's duplicates (freed); the caller then locks the deepest
        node it reached. A checkpoint slot is owned by the tree afterwards (or freed if redundant).
        """
        ps = self.page_size
        assert length % ps == 0 and length <= len(ids)
        pages = list(pages)
        held_len = node.depth if node is not None else 0
        owned_from = held_len // ps  # the caller's own pages start here
        at, i, n_pages = self.root, 0, length // ps
        while i < n_pages:
            child = at.children.get(self._page(ids, i))
            if child is None:
                at = self._new_child(at, tuple(ids[i * ps : length]), pages[i:n_pages])
                if self.hicache is not None and self.hicache.copy_on_insert():
                    self._backup(at)
                i = n_pages
                break
            m = self._matched_pages(child, ids, i, n_pages)
            if m < child.num_pages:
                child = self._split(child, m)
            if child.pages is None:  # only on a lower tier: adopt the caller's fresh pages
                self.set_pages(child, pages[i : i + m])
            else:
                for j in range(m):
                    if pages[i + j] != child.pages[j]:
                        assert i + j >= owned_from, "a locked prefix page differs from the tree's"
                        self.allocator.free([pages[i + j]])
                        pages[i + j] = child.pages[j]
            at, i = child, i + m
            self._tick(at)
        if checkpoint is not None:
            self._attach_checkpoint(at, checkpoint)
        if length <= held_len:
            return Committed(node, held_len, pages)
        self.lock(at)
        if node is not None:
            self.unlock(node)
        return Committed(at, length, pages)

    def _attach_checkpoint(self, node: RadixNode, slot: int) -> None:
        if node is self.root or node.checkpoint is not None:
            self.slots.free(slot)
            return
        self.set_checkpoint(node, slot)
        self.stats.checkpoints_taken += 1
        if self.hicache is not None and self.hicache.copy_on_checkpoint(node.host is not None):
            self._backup(node)
        if self.max_states_per_path >= 0:
            holders = [n for n in node.path() if n.has_checkpoint]
            for victim in holders[: max(0, len(holders) - self.max_states_per_path)]:
                self._drop_checkpoint(victim)

    def _drop_checkpoint(self, node: RadixNode) -> None:
        if node.checkpoint is not None:
            self.slots.free(node.checkpoint)
            self.set_checkpoint(node, None)
        if node.host is not None and node.host.state is not None:
            self.hicache.drop_host_state(node.host)

    def release(self, pages: list[int], node: RadixNode | None) -> None:
        """The caller leaves (finished, preempted or aborted): unlock `node`, free the pages the tree does not own."""
        held_len = 0
        if node is not None:
            self.unlock(node)
            held_len = node.depth
        own = pages[held_len // self.page_size :]
        if own:
            self.allocator.free(own)

    # -- allocation with eviction ----------------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int] | None:
        got = self.allocator.alloc(n)
        if got is None:
            self.evict_pages(n - self.allocator.num_free)
            got = self.allocator.alloc(n)
        return got

    def alloc_slot(self) -> int | None:
        """A checkpoint's or snapshot's slot (the high end), evicting one checkpoint if none is free."""
        slot = self.slots.alloc()
        if slot is None and self.evict_checkpoints(1):
            slot = self.slots.alloc()
        return slot

    def alloc_request_slot(self) -> int | None:
        """A running request's own slot (the low end: see SlotAllocator)."""
        slot = self.slots.alloc_low()
        if slot is None and self.evict_checkpoints(1):
            slot = self.slots.alloc_low()
        return slot

    def evict_pages(self, n: int) -> int:
        """Free at least n device pages from LRU unlocked leaves (moved down a tier when one exists)."""
        heap = [(x.last_access, id(x), x) for x in self.nodes() if self._device_leaf(x)]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            _, _, node = heapq.heappop(heap)
            if not self._device_leaf(node):
                continue
            freed += node.num_pages
            self.stats.evicted_pages += node.num_pages
            kept = self.hicache is not None and self._save_for_eviction(node)
            self.allocator.free(node.pages)
            self.set_pages(node, None)
            if node.checkpoint is not None:
                self.slots.free(node.checkpoint)
                self.set_checkpoint(node, None)
            parent = node.parent
            if not kept:
                self.remove(node)
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_checkpoints(self, n: int) -> int:
        """Free n device state slots held by checkpoints, unlocked LRU first (moved to host when possible)."""
        holders = sorted(
            (x for x in self.nodes() if x.checkpoint is not None), key=lambda x: (x.lock_ref > 0, x.last_access)
        )
        for node in holders[:n]:
            if self.hicache is not None:
                self._save_state_for_eviction(node)
            self.slots.free(node.checkpoint)
            self.set_checkpoint(node, None)
            self.stats.evicted_checkpoints += 1
        return min(n, len(holders))

    def remove(self, node: RadixNode) -> None:
        """Delete a node and its subtree (none of it on the device), dropping lower-tier copies."""
        for child in list(node.children.values()):
            self.remove(child)
        assert node.lock_ref == 0 and node.pages is None, "removing a locked or device-resident node"
        if node.host is not None:
            self.hicache.drop_host(node.host)
            node.host = None
        del node.parent.children[node.key[: self.page_size]]

    def _device_leaf(self, node: RadixNode) -> bool:
        return (
            node is not self.root
            and node.on_device
            and node.lock_ref == 0
            and not any(c.on_device for c in node.children.values())
        )

    def nodes(self):
        """Every node but the root (depth-first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- lower tiers (HiCache): what moves down and when is decided here, the tiers only store --------
    def _backup(self, node: RadixNode) -> None:
        """Copy a device node down every tier (host, then disk)."""
        if self.hicache.has_host:
            self._backup_host(node)
        if self.hicache.disk is not None:
            self._write_disk(node)

    def _backup_host(self, node: RadixNode) -> bool:
        if node.host is None or node.host.kv is None:
            if not node.on_device:
                return False
            if not self._make_host_room(node.num_pages * self.page_size * self.io.packed_bytes_per_token, node):
                return False
            state = node.host.state if node.host is not None else None
            node.host = self.hicache.put_host(self.io.gather_pages(node.pages), state)
        if node.checkpoint is not None and node.host.state is None:
            self._put_host_state(node)
        return True

    def _put_host_state(self, node: RadixNode) -> bool:
        state = self.io.gather_state(node.checkpoint)
        if not self._make_host_room(tensor_bytes(state), node):
            return False
        self.hicache.put_host_state(node.host, state)
        return True

    def _make_host_room(self, nbytes: int, keep: RadixNode) -> bool:
        """Free host bytes, LRU first: backups of device nodes are dropped, host-only leaves leave the tree
        (written to disk first under write_back)."""
        hi = self.hicache
        if not hi.host_fits(nbytes):
            return False
        progress = True
        while progress and not hi.host_has_room(nbytes):
            progress = False
            candidates = sorted(
                (x for x in self.nodes() if x.host is not None and x is not keep and x.lock_ref == 0),
                key=lambda x: x.last_access,
            )
            for node in candidates:
                if hi.host_has_room(nbytes):
                    break
                if node.on_device:
                    hi.drop_host(node.host)
                    node.host = None
                    progress = True
                elif not node.children:
                    if hi.spill_to_disk():
                        self._write_disk(node)
                    self.remove(node)
                    progress = True
        return hi.host_has_room(nbytes)

    def _save_for_eviction(self, node: RadixNode) -> bool:
        """Before a node leaves the device: keep it on host (True) or at least on disk (False: node removed)."""
        if self.hicache.has_host and self._backup_host(node):
            return True
        if self.hicache.disk is not None:
            self._write_disk(node)
        return False

    def _save_state_for_eviction(self, node: RadixNode) -> None:
        if self.hicache.has_host and node.host is not None and self._put_host_state(node):
            return
        if self.hicache.disk is not None:
            self._write_disk(node)

    def _write_disk(self, node: RadixNode) -> None:
        """Write the node's pages (from device or host) and its checkpoint, skipping files already there."""
        disk, ps = self.hicache.disk, self.page_size
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

    def flush(self) -> None:
        """Write every node still held only in memory to disk (write_back at shutdown)."""
        if self.hicache is None or self.hicache.disk is None:
            return
        for node in list(self.nodes()):
            if node.on_device or node.host is not None:
                self._write_disk(node)

    # -- accounting ------------------------------------------------------------------------------------
    def device_pages(self) -> int:
        return self.num_device_pages

    def device_checkpoints(self) -> int:
        return self.num_checkpoints

    def evictable_pages(self) -> int:
        return self.num_device_pages - self.num_locked_pages

    def check_counters(self) -> None:
        """Recount everything from the tree (tests): the incremental counters must agree."""
        nodes = list(self.nodes())
        assert self.num_device_pages == sum(x.num_pages for x in nodes if x.on_device)
        assert self.num_locked_pages == sum(x.num_pages for x in nodes if x.on_device and x.lock_ref > 0)
        assert self.num_checkpoints == sum(1 for x in nodes if x.checkpoint is not None)

    def set_namespace(self, namespace: str) -> None:
        """Key pages under another model (reloaded weights): the old namespace's disk files are never matched again.
        Call it on an empty tree (`clear` with no request holding a lock)."""
        assert not self.root.children, "renaming the namespace of a tree that still holds nodes"
        self.root_hash = root_hash(namespace.encode())
        if self.hicache is not None:
            self.hicache.set_namespace(namespace)

    def clear(self) -> None:
        """Drop every unlocked node from every tier held in memory (disk files stay)."""
        self.evict_pages(self.num_device_pages)
        for node in list(self.root.children.values()):
            if node.lock_ref == 0 and not node.on_device:
                self.remove(node)
