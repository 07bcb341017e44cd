"""Where a worker's pools live in memory, and which byte ranges move for a request.

Each pool tensor is a registered region of `rows` equal rows: the KV pool's per-layer tensors have one row per
token slot (latent, rope key and index key in the model dtype, or the FP8 / NVFP4 byte rows), the KDA state pool's
per-layer conv and recurrent tensors one row per state slot, and a DFlash draft context one row per (layer,
position). A page of the KV pool is `page_size` consecutive rows of every KV tensor, so a run of consecutive pages
on both sides is one range per tensor. Everything here is integers: the regions of the other side arrive as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.cache.kv_pool import KVStorage
from kestrel.cache.state_pool import StateStorage

Range = tuple[int, int, int]  # (source address, destination address, bytes)


@dataclass(frozen=True)
class Region:
    """`rows` rows of `row_bytes` bytes each, starting at `addr`."""

    addr: int
    row_bytes: int
    rows: int

    @classmethod
    def of(cls, t: torch.Tensor, rows_dim: int = 0) -> Region:
        """A contiguous tensor as rows along its first `rows_dim + 1` dims."""
        if not t.is_contiguous():
            raise ValueError("a transfer region must be a contiguous tensor")
        rows = 1
        for d in t.shape[: rows_dim + 1]:
            rows *= d
        return cls(t.data_ptr(), t.nbytes // max(rows, 1), rows)

    def row(self, i: int) -> int:
        if not 0 <= i < self.rows:
            raise ValueError(f"row {i} outside a region of {self.rows} rows")
        return self.addr + i * self.row_bytes

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.rows


@dataclass(frozen=True)
class PoolLayout:
    """A worker's registered pools: KV tensors (rows = token slots), KDA state tensors (rows = state slots)."""

    page_size: int
    kv: tuple[Region, ...]
    state: tuple[Region, ...]

    @classmethod
    def of(cls, kv: KVStorage, states: StateStorage | None, page_size: int) -> PoolLayout:
        return cls(page_size, tuple(Region.of(t) for t in pool_tensors(kv)), tuple(_state_regions(states)))

    @property
    def signature(self) -> dict:
        """What both sides must agree on for page p / slot s to mean the same bytes (addresses excluded)."""
        return {
            "page_size": self.page_size,
            "kv_row_bytes": [r.row_bytes for r in self.kv],
            "state_row_bytes": [r.row_bytes for r in self.state],
        }

    def to_json(self) -> dict:
        return {
            "page_size": self.page_size,
            "kv": [_region_json(r) for r in self.kv],
            "state": [_region_json(r) for r in self.state],
        }

    @classmethod
    def from_json(cls, data: dict) -> PoolLayout:
        return cls(
            int(data["page_size"]),
            tuple(Region(**r) for r in data["kv"]),
            tuple(Region(**r) for r in data["state"]),
        )

    def page_ranges(self, dst: PoolLayout, src_pages: list[int], dst_pages: list[int]) -> list[Range]:
        """Every KV tensor's rows of `src_pages` here → the same tensor's rows of `dst_pages` there."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
        ps, out = self.page_size, []
        for s_reg, d_reg in zip(self.kv, dst.kv, strict=True):
            for s, d, n in runs(src_pages, dst_pages):
                out.append((s_reg.row(s * ps), d_reg.row(d * ps), n * ps * s_reg.row_bytes))
                d_reg.row((d + n) * ps - 1)  # the destination run must lie inside the peer's pool
        return out

    def slot_ranges(self, dst: PoolLayout, src_slot: int, dst_slot: int) -> list[Range]:
        """One state slot of every KDA layer (conv, recurrent) here → the peer's slot."""
        return [(s.row(src_slot), d.row(dst_slot), s.row_bytes) for s, d in zip(self.state, dst.state, strict=True)]


@dataclass(frozen=True)
class DraftLayout:
    """A request's DFlash draft context (`DraftKV`): keys and values as rows (layer, ring position), valid flags."""

    capacity: int
    k: Region
    v: Region
    valid: Region

    @classmethod
    def of(cls, kv) -> DraftLayout:
        return cls(kv.capacity, Region.of(kv.k, rows_dim=1), Region.of(kv.v, rows_dim=1), Region.of(kv.valid))

    @property
    def layers(self) -> int:
        return self.k.rows // self.capacity

    def to_json(self) -> dict:
        return {
            "capacity": self.capacity,
            "k": _region_json(self.k),
            "v": _region_json(self.v),
            "valid": _region_json(self.valid),
        }

    @classmethod
    def from_json(cls, data: dict) -> DraftLayout:
        return cls(int(data["capacity"]), Region(**data["k"]), Region(**data["v"]), Region(**data["valid"]))

    def ranges(self, dst: DraftLayout, positions: list[int]) -> list[Range]:
        """The context of the given token positions (each at position % capacity of its own ring) → the peer's."""
        if (self.k.row_bytes, self.v.row_bytes, self.layers) != (dst.k.row_bytes, dst.v.row_bytes, dst.layers):
            raise ValueError("draft context shapes differ between prefill and decode (another draft model?)")
        src = [p % self.capacity for p in positions]
        dst_rows = [p % dst.capacity for p in positions]
        out = []
        for s, d, n in runs(src, dst_rows):
            for layer in range(self.layers):
                for a, b in ((self.k, dst.k), (self.v, dst.v)):
                    out.append((a.row(layer * self.capacity + s), b.row(layer * dst.capacity + d), n * a.row_bytes))
            out.append((self.valid.row(s), dst.valid.row(d), n * self.valid.row_bytes))
        return out


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both index lists advance by one together."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def pool_tensors(kv: KVStorage) -> list[torch.Tensor]:
    """The KV pool's tensors in their fixed per-layer order (latent, rope key, index key; quantized: two rows)."""
    return kv.tensors()


def state_tensors(states: StateStorage | None) -> list[torch.Tensor]:
    if states is None:
        return []
    return [t for layer in states.conv for t in (states.conv[layer], states.recurrent[layer])]


def _state_regions(states: StateStorage | None) -> list[Region]:
    return [Region.of(t) for t in state_tensors(states)]


def _region_json(r: Region) -> dict:
    return {"addr": r.addr, "row_bytes": r.row_bytes, "rows": r.rows}
