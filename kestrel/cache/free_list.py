"""Exact-accounting free list of integer ids: the one mechanism behind KV pages and KDA state slots."""

from __future__ import annotations


class FreeList:
    """Invariant: free + allocated == capacity, and no id is handed out twice or freed twice."""

    def __init__(self, capacity: int, what: str) -> None:
        self.capacity, self.what = capacity, what
        self._free = list(range(capacity - 1, -1, -1))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._allocated)

    def take(self, n: int) -> list[int] | None:
        """n ids, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(n)]
        self._allocated.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._allocated:
                raise RuntimeError(f"{self.what} {i} freed twice or never allocated")
            self._allocated.remove(i)
            self._free.append(i)
