"""Rank 0's integers for attention DP: one scheduler, page and slot allocator and prefix cache per attention-DP
group, behind the single-scheduler interface the Engine uses. No tensors here (see `dp_attention` for those)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel.cache.prefix import CacheStats
from kestrel.engine.request import Request
from kestrel.engine.scheduler import SchedulePlan, Scheduler


class DPScheduler:
    """The Engine's scheduler over several attention-DP groups (the interface of one `Scheduler`)."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.groups = schedulers
        self._group_of: dict[int, int] = {}

    def add(self, req: Request) -> None:
        """To the group whose prefix cache holds the longest prefix of the prompt; the least loaded on a tie."""

        def rank(i: int) -> tuple[int, int]:
            s = self.groups[i]
            return -s.cache.match(req.all_ids).length, len(s.running) + len(s.waiting)

        g = min(range(len(self.groups)), key=rank)
        self._group_of[id(req)] = g
        self.groups[g].add(req)

    def schedule(self) -> SchedulePlan:
        """Every group's plan; the combined plan lists their chunks group after group (sampling order)."""
        plans = [s.schedule() for s in self.groups]
        combined = SchedulePlan(
            chunks=[c for p in plans for c in p.chunks],
            preempted=[r for p in plans for r in p.preempted],
            rejected=[r for p in plans for r in p.rejected],
        )
        combined.group_plans = plans  # type: ignore[attr-defined]
        return combined

    def advance(self, plan: SchedulePlan) -> None:
        for s, p in zip(self.groups, plan.group_plans):  # type: ignore[attr-defined]
            s.advance(p)

    def finish(self, req: Request, reason: str, *args) -> None:
        self.groups[self._group_of.pop(id(req))].finish(req, reason, *args)

    def abort(self, request_id: str) -> list[Request]:
        hit = [r for s in self.groups for r in s.abort(request_id)]
        for r in hit:
            self._group_of.pop(id(r), None)
        return hit

    def retract_all(self) -> list[Request]:
        """Each group's started requests back to that group's queue (`Scheduler.retract_all`)."""
        return [r for s in self.groups for r in s.retract_all()]

    @property
    def has_work(self) -> bool:
        return any(s.has_work for s in self.groups)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.groups for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.groups for r in s.waiting]

    @property
    def num_computed_tokens(self) -> int:
        return sum(s.num_computed_tokens for s in self.groups)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.groups)


@dataclass
class Totals:
    """Allocator counts summed over the groups (what `Engine.stats` reads)."""

    parts: list = field(default_factory=list)

    @property
    def num_used(self) -> int:
        return sum(p.num_used for p in self.parts)

    @property
    def num_pages(self) -> int:
        return sum(p.num_pages for p in self.parts)

    @property
    def page_size(self) -> int:
        return self.parts[0].page_size


class DPCache:
    """The groups' prefix caches as one (counts summed; clear, flush and checks run on each)."""

    def __init__(self, caches: list) -> None:
        self.caches = caches

    def __getattr__(self, name: str):
        attrs = [getattr(c, name) for c in self.caches]
        if callable(attrs[0]):
            if name in ("device_pages", "device_checkpoints", "evictable_pages"):
                return lambda: sum(a() for a in attrs)
            return lambda *args: [a(*args) for a in attrs][0]
        if name == "stats":
            total = CacheStats()
            for s in attrs:
                for k, v in vars(s).items():
                    setattr(total, k, getattr(total, k) + v)
            return total
        return attrs[0]


def dp_scheduling(engine, num_pages: int, num_slots: int) -> tuple[Totals, Totals, DPCache, DPScheduler]:
    """Allocators, prefix cache and scheduler for every attention-DP group; group 0 keeps the engine's own."""
    from kestrel.cache.kv_pool import PageAllocator
    from kestrel.cache.prefix import NoPrefixCache
    from kestrel.cache.radix import RadixCache
    from kestrel.cache.state_pool import SlotAllocator

    config, runner = engine.config, engine.runner
    pages, slots, caches, schedulers = [engine.pages], [engine.slots], [engine.cache], [engine.scheduler]
    for g in range(1, engine.groups.layout.dp_attn):
        pages.append(PageAllocator(num_pages, config.page_size))
        slots.append(SlotAllocator(num_slots))
        if isinstance(engine.cache, RadixCache):
            io = runner.pool_io(g)
            cache = RadixCache(pages[g], slots[g], io, config.state_track_interval, config.max_states_per_path)
            cache.root_hash = engine.cache.root_hash  # the same model: the same namespace
        else:
            cache = NoPrefixCache(pages[g], slots[g])
        caches.append(cache)
        schedulers.append(
            Scheduler(
                pages[g],
                slots[g],
                cache,
                config.max_running_requests,
                config.max_num_batched_tokens,
                config.chunked_prefill_size,
            )
        )
    return Totals(pages), Totals(slots), DPCache(caches), DPScheduler(schedulers)
