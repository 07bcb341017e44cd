"""Tensor traffic of the prefix cache: copy KDA states between slots, move pages and states to and from the host.

The radix tree and its lower tiers decide in integers; this is the one place they touch the device pools.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kestrel.cache.kv_pool import KVStorage
from kestrel.cache.records import RolloutRecords
from kestrel.cache.state_pool import StateStorage


class CacheIO(Protocol):
    """What the radix cache needs from the device pools (tests pass a small tensor-backed stand-in)."""

    def copy_state(self, src: int, dst: int) -> None: ...
    def gather_pages(self, pages: list[int]) -> torch.Tensor: ...
    def scatter_pages(self, pages: list[int], packed: torch.Tensor) -> None: ...
    def gather_state(self, slot: int) -> dict[str, torch.Tensor]: ...
    def scatter_state(self, slot: int, state: dict[str, torch.Tensor]) -> None: ...

    @property
    def packed_bytes_per_token(self) -> int: ...


class PoolIO:
    """`CacheIO` over the model runner's KV pool and KDA state pool (`states` is None without KDA layers).

    With rollout records, a packed page also carries its tokens' record rows (int32 bytes after the KV values), so a
    page that comes back from the host or disk tier still says what its tokens were routed to.
    """

    def __init__(
        self, kv: KVStorage, states: StateStorage | None, page_size: int, records: RolloutRecords | None = None
    ) -> None:
        self.kv, self.states, self.page_size, self.records = kv, states, page_size, records

    def copy_state(self, src: int, dst: int) -> None:
        self.states.copy(src, dst)

    def gather_pages(self, pages: list[int]) -> torch.Tensor:
        packed = self.kv.gather_pages(pages, self.page_size)
        if self.records is None:
            return packed
        return torch.cat([packed, self.records.gather_pages(pages, self.page_size).view(packed.dtype)], dim=-1)

    def scatter_pages(self, pages: list[int], packed: torch.Tensor) -> None:
        if self.records is not None:
            packed, rows = packed.split([self.kv.packed_width, packed.shape[-1] - self.kv.packed_width], dim=-1)
            self.records.scatter_pages(pages, self.page_size, rows.contiguous().view(torch.int32))
        self.kv.scatter_pages(pages, self.page_size, packed)

    def gather_state(self, slot: int) -> dict[str, torch.Tensor]:
        return self.states.gather(slot)

    def scatter_state(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        self.states.scatter(slot, state)

    @property
    def packed_bytes_per_token(self) -> int:
        return self.kv.packed_bytes_per_token + (self.records.bytes_per_token if self.records is not None else 0)
