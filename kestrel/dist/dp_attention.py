"""Attention data parallelism: each attention-DP group owns its requests, KV pages and KDA state slots.

Rank 0 keeps one `Scheduler` (with its page and slot allocators and prefix cache: plain integers) per group and
plans every group's step; each group's ranks hold only that group's pools and run only its batch. The MLP half
of every layer (and the embedding, and the LM head on the sampled rows) runs over all ranks on the rows of every
group (`DPGathered`: all-gather, run, keep own rows), so the MoE sees the union of the groups' tokens. A group with nothing to do runs one padding row on the scratch
page and slot, which the MLP gather drops: the collectives always match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kestrel.cache.prefix import CacheStats
from kestrel.dist import comm
from kestrel.dist.groups import Group, Groups
from kestrel.engine.request import Request
from kestrel.engine.scheduler import SchedulePlan, Scheduler


@dataclass
class DPStep:
    """Real (non-padding) token rows of every group this step, and this rank's group."""

    real_rows: list[int]
    group: int


_STEP: DPStep | None = None


def set_dp_step(step: DPStep | None) -> None:
    global _STEP
    _STEP = step


def gather_rows(x: torch.Tensor, step: DPStep, group: Group) -> torch.Tensor:
    """Every group's real rows of x, in group order (x's first rows are this group's real ones)."""
    width = max(max(step.real_rows), 1)
    padded = x.new_zeros((width, *x.shape[1:]))
    n = step.real_rows[step.group]
    padded[:n] = x[:n]
    everyone = comm.all_gather(padded, group)
    keep = [everyone[g * width : g * width + r] for g, r in enumerate(step.real_rows)]
    return torch.cat(keep)


def own_rows(y: torch.Tensor, step: DPStep, rows: int) -> torch.Tensor:
    """This group's rows of a gathered result, padded back with zeros to the group's `rows` physical rows."""
    start = sum(step.real_rows[: step.group])
    n = step.real_rows[step.group]
    out = y.new_zeros((rows, *y.shape[1:]))
    out[:n] = y[start : start + n]
    return out


class DPGathered(nn.Module):
    """A row-wise block (embedding, MLP, MoE) run over every attention-DP group's rows at once: the
    vocabulary-, tensor- and expert-parallel layers inside see the same rows on every rank.

    Dispatch is an all-gather of the groups' rows. Combine: when the block's last step is a sum over ranks (a
    dense MLP, a MoE without a latent projection) the block returns partial sums and they are reduce-scattered
    over all ranks, each group's rows landing on its ranks; otherwise the block reduces inside and each group
    keeps its rows.
    """

    def __init__(self, inner: nn.Module, groups: Groups) -> None:
        super().__init__()
        self.inner, self.dp, self.world, self.attn_tp = inner, groups.attn_dp, groups.world, groups.attn_tp
        self.partial = _defer_reduction(inner)

    def __getattr__(self, name: str):
        """What code reads of the wrapped block (e.g. the embedding's weight for the model's device and dtype)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def forward(self, x: torch.Tensor, *args):
        step = _STEP
        if args and args[0] is not None:
            raise ValueError("routing replay (forced experts) is not supported with attention DP")
        out = self.inner(gather_rows(x, step, self.dp), *args)
        ids = None
        if isinstance(out, tuple):  # MoE: (output, expert ids)
            out, ids = out
            ids = own_rows(ids, step, x.shape[0])
        out = self._reduce_scatter(out, step, x.shape[0]) if self.partial else own_rows(out, step, x.shape[0])
        return out if ids is None else (out, ids)

    def _reduce_scatter(self, partial: torch.Tensor, step: DPStep, rows: int) -> torch.Tensor:
        """Sum partial results over all ranks, each group receiving only its rows: reduce-scatter over the world
        (rank r = group g, attention-TP index j gets slice j of group g's rows), then all-gather within the group."""
        a = self.attn_tp.size
        width = -(-max(max(step.real_rows), 1) // a) * a
        padded = partial.new_zeros((len(step.real_rows) * width, *partial.shape[1:]))
        start = 0
        for g, n in enumerate(step.real_rows):
            padded[g * width : g * width + n] = partial[start : start + n]
            start += n
        mine = comm.all_gather(comm.reduce_scatter(padded, self.world), self.attn_tp)
        out = partial.new_zeros((rows, *partial.shape[1:]))
        n = step.real_rows[step.group]
        out[:n] = mine[:n]
        return out


def _defer_reduction(block: nn.Module) -> bool:
    """Switch a block's final cross-rank sums to partial results when the block ends in one; say if it did."""
    from kestrel.dist.moe import ParallelExperts
    from kestrel.dist.parallel import RowParallelLinear
    from kestrel.models.layers.moe import DenseMLP, MoE

    if isinstance(block, DenseMLP) and isinstance(block.down_proj, RowParallelLinear):
        block.down_proj.reduce = False
        return True
    if isinstance(block, MoE) and not block.latent and isinstance(block.experts, ParallelExperts):
        shared = block.shared_experts
        if shared is not None and not isinstance(shared.down_proj, RowParallelLinear):
            return False
        block.experts.reduce = False  # routed + shared: both partial, one reduce-scatter
        if shared is not None:
            shared.down_proj.reduce = False
        return True
    return False


# -- rank 0's integers: one scheduler per group, behind the single-scheduler interface the Engine uses -----
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
