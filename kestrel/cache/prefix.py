"""What the scheduler sees of a prefix cache: the result types and the no-op cache used when caching is off.

The cache returns results; the scheduler writes them onto its `Request`. Nothing here knows about requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.state_pool import SlotAllocator


@dataclass
class PrefixMatch:
    """The reusable prefix of a prompt: `node` ends at `length` tokens (a checkpoint there, if KDA)."""

    node: Any  # a radix node; None for the no-op cache
    length: int
    disk: Any = None  # a `DiskHit`: a continuation found only on disk (pages + the state at its end), or the
    # checkpoint of `node` itself


@dataclass
class Acquired:
    """A locked prefix to start from: tree pages for tokens [0, length), and where those tokens came from."""

    node: Any  # the node the request now locks (None: nothing locked)
    length: int
    pages: list[int]
    hits_by_tier: dict[str, int]  # device / host / disk tokens; empty when nothing was looked up


@dataclass
class Committed:
    """After a commit: the node the request locks, its depth, and the request's pages (duplicates swapped)."""

    node: Any
    length: int
    pages: list[int]


@dataclass
class CacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    evicted_pages: int = 0
    evicted_checkpoints: int = 0
    checkpoints_taken: int = 0


class NoPrefixCache:
    """Prefix caching off: nothing matches, nothing is kept, releases free at once. Same interface as `RadixCache`."""

    takes_checkpoints = False
    shares_prefixes = False  # nothing is ever reused, so no request waits for another's prefill

    def __init__(self, pages: PageAllocator, slots: SlotAllocator) -> None:
        self.allocator, self.slots = pages, slots
        self.page_size = pages.page_size
        self.has_state = slots.num_slots > 0
        self.stats = CacheStats()

    def match(self, ids: list[int], kv_only: bool = False) -> PrefixMatch:
        return PrefixMatch(None, 0)

    def acquire(
        self, ids: list[int], match: PrefixMatch, slot: int | None, prompt_len: int, kv_only: bool = False
    ) -> Acquired:
        return Acquired(None, 0, [], {})

    def commit(
        self, ids: list[int], pages: list[int], length: int, node: Any, checkpoint: int | None = None
    ) -> Committed:
        if checkpoint is not None:
            self.slots.free(checkpoint)
        return Committed(node, 0, pages)

    def release(self, pages: list[int], node: Any) -> None:
        if pages:
            self.allocator.free(pages)

    def alloc_pages(self, n: int) -> list[int] | None:
        return self.allocator.alloc(n)

    def alloc_slot(self) -> int | None:
        return self.slots.alloc()

    def alloc_request_slot(self) -> int | None:
        return self.slots.alloc_low()

    def device_pages(self) -> int:
        return 0

    def device_checkpoints(self) -> int:
        return 0

    def evictable_pages(self) -> int:
        return 0

    def check_counters(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def set_namespace(self, namespace: str) -> None:
        pass

    def flush(self) -> None:
        pass
