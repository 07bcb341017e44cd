"""The radix tree on its own: integer pages and slots, with a tensor-backed stand-in for the device pools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kestrel.cache.hicache import DiskStore, HiCache
from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import SlotAllocator

PS = 4  # page size


class FakeIO:
    """Pages hold [PS, 2] tensors and slots a one-entry state, so copies between tiers can be checked."""

    def __init__(self, num_pages: int, num_slots: int) -> None:
        self.kv = torch.zeros(num_pages, PS, 2)
        self.state = torch.zeros(num_slots, 3)

    def copy_state(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]

    def gather_pages(self, pages):
        return self.kv[pages].clone()

    def scatter_pages(self, pages, packed):
        self.kv[pages] = packed

    def gather_state(self, slot):
        return {"s": self.state[slot].clone()}

    def scatter_state(self, slot, state):
        self.state[slot] = state["s"]

    packed_bytes_per_token = 2 * 4


def _cache(num_pages=32, num_slots=16, interval=8, max_states=-1, hicache=None, with_state=True):
    pages = PageAllocator(num_pages, PS)
    slots = SlotAllocator(num_slots if with_state else 0)
    io = FakeIO(num_pages, num_slots)
    return RadixCache(pages, slots, io, interval, max_states, hicache), io


@dataclass
class Seq:
    """What the scheduler keeps per request, applied from the cache's results the way the scheduler does."""

    ids: list[int]
    pages: list[int] = field(default_factory=list)
    node: Any = None
    cached: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    slot: int | None = None


def _acquire(cache: RadixCache, seq: Seq) -> bool:
    got = cache.acquire(seq.ids, cache.match(seq.ids), seq.slot, len(seq.ids))
    if got is None:
        return False
    seq.pages, seq.node, seq.cached, seq.hits = got.pages, got.node, got.length, got.hits_by_tier
    return True


def _commit(cache: RadixCache, seq: Seq, length: int, checkpoint: int | None = None) -> None:
    got = cache.commit(seq.ids, seq.pages, length, seq.node, checkpoint)
    seq.pages, seq.node = got.pages, got.node


def _run(cache: RadixCache, io: FakeIO, ids: list[int], checkpoints: list[int]) -> Seq:
    """Admit ids, 'compute' all of them (page content = token values), commit checkpoints, finish."""
    seq = Seq(ids)
    seq.slot = cache.alloc_slot() if cache.has_state else None
    assert _acquire(cache, seq)
    need = -(-len(ids) // PS) - len(seq.pages)
    seq.pages += cache.alloc_pages(need)
    for i, page in enumerate(seq.pages):
        chunk = ids[i * PS : (i + 1) * PS]
        io.kv[page, : len(chunk), 0] = torch.tensor(chunk, dtype=torch.float)
    if not cache.has_state:
        _commit(cache, seq, len(ids) // PS * PS)
    for pos in checkpoints:
        slot = cache.alloc_slot()
        io.state[slot] = pos  # the 'state after pos tokens'
        _commit(cache, seq, pos, slot)
    if seq.slot is not None:
        cache.slots.free(seq.slot)
        seq.slot = None
    cache.release(seq.pages, seq.node)
    cache.check_counters()
    return seq


def test_match_ends_at_deepest_checkpoint_and_restores_its_state():
    cache, io = _cache()
    ids = list(range(100, 124))  # 6 pages
    _run(cache, io, ids, [8, 16])
    again = Seq(ids + [1, 2, 3], slot=cache.alloc_slot())
    assert cache.match(again.ids).length == 16  # pages for 24 tokens exist, but the deepest checkpoint is at 16
    assert _acquire(cache, again)
    assert again.cached == 16 and len(again.pages) == 4
    assert io.state[again.slot][0] == 16
    # The reused pages carry the first request's content.
    assert io.kv[again.pages, :, 0].flatten().tolist() == [float(t) for t in ids[:16]]


def test_divergent_prompts_share_pages_and_split_nodes():
    cache, io = _cache(with_state=False)
    a = list(range(16)) + [50, 51, 52, 53]
    b = list(range(16)) + [60, 61, 62, 63, 64]
    _run(cache, io, a, [])
    assert cache.device_pages() == 5
    assert cache.match(b).length == 16  # shares four pages with a, the fifth differs
    _run(cache, io, b, [])
    assert cache.device_pages() == 6 == cache.allocator.num_used  # 4 shared + 1 for a + 1 for b
    assert cache.match(a + [0]).length == 20 and cache.match(b).length == 20


def test_commit_of_duplicate_pages_frees_the_copies():
    cache, io = _cache(with_state=False)
    ids = list(range(12))
    r1, r2 = Seq(ids + [99]), Seq(ids + [98])
    for r in (r1, r2):
        _acquire(cache, r)
        r.pages = cache.alloc_pages(4)
    _commit(cache, r1, 12)
    _commit(cache, r2, 12)  # computed concurrently: r2's first three pages are duplicates
    assert r2.pages[:3] == r1.pages[:3]
    cache.release(r1.pages, r1.node)
    cache.release(r2.pages, r2.node)
    assert cache.allocator.num_used == 3 == cache.device_pages()


def test_locked_path_survives_eviction_and_lru_goes_first():
    cache, io = _cache(num_pages=8, with_state=False)
    old, new = [1] * 8, [2] * 8
    _run(cache, io, old + [0], [])
    _run(cache, io, new + [0], [])
    holder = Seq(new + [5])
    _acquire(cache, holder)  # locks `new`
    assert cache.evict_pages(8) == 2  # only `old` may go
    assert cache.match(old + [0]).length == 0 and cache.match(new + [0]).length == 8
    cache.release(holder.pages, holder.node)
    assert cache.evict_pages(8) == 2 and cache.allocator.num_used == 0


def test_max_states_per_path_drops_the_shallowest():
    cache, io = _cache(max_states=2)
    ids = list(range(40))
    _run(cache, io, ids, [8, 16, 24])
    depths = sorted(n.depth for n in cache.nodes() if n.checkpoint is not None)
    assert depths == [16, 24]
    assert cache.slots.num_used == 2


def test_checkpoints_are_evicted_apart_from_kv():
    cache, io = _cache(num_slots=4)
    _run(cache, io, list(range(30)), [8, 16, 24])
    assert cache.slots.num_free == 1 and cache.alloc_slot() is not None
    assert cache.alloc_slot() is not None  # evicts the LRU checkpoint, keeps every page
    assert cache.device_checkpoints() == 2 and cache.device_pages() == 6
    assert cache.stats.evicted_checkpoints == 1


def test_host_tier_keeps_evicted_pages_and_loads_them_back():
    hi = HiCache(host_bytes=10_000, storage_dir=None, write_policy="write_back", namespace="t")
    cache, io = _cache(num_pages=6, hicache=hi)
    ids = list(range(200, 220))
    _run(cache, io, ids + [0], [8, 20])
    cache.evict_pages(6)
    assert cache.device_pages() == 0 and cache.allocator.num_used == 0 and hi.host_used > 0
    io.kv.zero_()
    req = Seq(ids + [0], slot=cache.alloc_slot())
    assert _acquire(cache, req)
    assert req.cached == 20 and req.hits["host"] == 20
    assert io.kv[req.pages, :, 0].flatten().tolist() == [float(t) for t in ids]
    assert io.state[req.slot][0] == 20


def test_disk_store_detects_truncation_and_corruption(tmp_path):
    store = DiskStore(tmp_path, "ns")
    key, tokens = b"k" * 20, (1, 2, 3, 4)
    store.write(key, "page", {"kv": torch.arange(8.0)}, tokens)
    assert torch.equal(store.read(key, "page", tokens)["kv"], torch.arange(8.0))
    assert store.read(key, "page", (1, 2, 3, 5)) is None  # tokens do not match: rejected and removed
    store.write(key, "page", {"kv": torch.arange(8.0)}, tokens)
    path = store.path(key, "page")
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF
    path.write_bytes(bytes(blob))
    assert store.read(key, "page", tokens) is None and not path.exists()
    store.write(key, "page", {"kv": torch.arange(8.0)}, tokens)
    path.write_bytes(path.read_bytes()[:-10])
    assert store.read(key, "page", tokens) is None
    assert store.corrupt == 3
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave no temp files behind


def test_write_policies_decide_when_pages_reach_the_host():
    ids = list(range(300, 316)) + [1]
    used = {}
    for policy in ("write_through", "write_through_selective", "write_back"):
        hi = HiCache(host_bytes=10_000, storage_dir=None, write_policy=policy, namespace="t")
        cache, io = _cache(hicache=hi)
        used[policy] = []
        for _ in range(3):
            _run(cache, io, ids, [16])
            used[policy].append(hi.host_used)
    assert used["write_through"][0] > 0  # copied as soon as the tree takes it
    assert used["write_through_selective"][:2] == [0, 0] and used["write_through_selective"][2] > 0  # 2nd hit
    assert used["write_back"] == [0, 0, 0]  # only eviction copies down


def test_disk_store_os_errors_are_misses_and_skipped_writes(tmp_path, monkeypatch):
    """Guards issue 12 #2: an OS error on the disk tier (write, probe or read) is counted, never raised."""
    store = DiskStore(tmp_path, "ns")
    key, tokens = b"k" * 20, (1, 2, 3, 4)
    store.path(key, "page").parent.write_bytes(b"")  # a file where the page's directory belongs: mkdir fails
    store.write(key, "page", {"kv": torch.arange(8.0)}, tokens)
    assert store.written == 0 and store.io_errors == 1
    assert not list(tmp_path.rglob("*.tmp"))

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr("pathlib.Path.exists", denied)
    assert store.exists(key, "state") is False
    monkeypatch.setattr("pathlib.Path.read_bytes", denied)
    assert store.read(key, "state", tokens) is None
    assert store.io_errors == 3 and store.corrupt == 0
