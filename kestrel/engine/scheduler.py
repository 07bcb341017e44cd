"""Which requests run this step, which token ranges, and where their KV pages and state slots live.

Plain Python over integers: FCFS admission, a per-step token budget, chunked prefill mixed with decodes,
preemption of the newest running request (pages and slot freed, re-queued for recompute) when memory runs out.
What the sampled tokens mean (stop rules, text) is the engine's business; the scheduler only advances lengths
and hands computed prefixes to the cache.
With a radix cache, admission starts a request after its longest cached prefix, and the scheduler decides
where KDA state checkpoints are taken: at the last page boundary of every prefill chunk, at every
`state_track_interval` tokens, and (through the request's tail slot) at the last page boundary on finish.
With speculative decoding (`spec_block`), a decode-ready request gets a verify chunk of up to B tokens instead of
one; `commit_verify` records how many of them were kept.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.prefix import NoPrefixCache
from kestrel.cache.radix import RadixCache
from kestrel.cache.state_pool import SlotAllocator
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.shared_prefill import PrefillPartners


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `request.all_ids` go through the model this step."""

    request: Request
    start: int
    num_tokens: int
    # KDA state snapshots taken inside this chunk: (offset m in [1, num_tokens], state slot, committed now?)
    snapshots: list[tuple[int, int, bool]] = field(default_factory=list)
    # Speculative verify block: the request's last token + `draft` (filled in after scheduling); every row samples.
    verify: bool = False
    draft: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [len(draft), V] draft distributions of sampled requests

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row yields the next token."""
        return self.verify or self.start + self.num_tokens == self.request.num_tokens

    @property
    def num_sampled(self) -> int:
        """Rows whose logits are sampled: the whole block of a verify chunk, else the last row if it samples."""
        return self.num_tokens if self.verify else int(self.samples)

    @property
    def is_decode(self) -> bool:
        """One token that samples: a decode row (plans put these first)."""
        return self.num_tokens == 1 and self.samples


@dataclass
class SchedulePlan:
    """One step. Decode chunks (one token that samples) come first, `num_decode` of them, then prefill chunks,
    so the model runner can batch the decode rows as one block; sampled tokens come back in chunk order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    fresh_slots: list[int] = field(default_factory=list)  # slots of requests starting from token 0
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # can never fit: finished with an error
    num_decode: int = 0

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """`schedule()` plans a step, `advance(plan)` records it once computed, `finish(req, reason)` lets one go."""

    def __init__(
        self,
        pages: PageAllocator,
        slots: SlotAllocator,
        cache: RadixCache | NoPrefixCache,
        max_running_requests: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int,
        max_loras_per_batch: int | None = None,
    ) -> None:
        self.pages, self.slots, self.cache = pages, slots, cache
        self.max_running = max_running_requests
        self.budget = max_num_batched_tokens
        self.chunk_cap = math.inf if chunked_prefill_size == -1 else chunked_prefill_size
        self.max_loras = max_loras_per_batch  # distinct LoRA adapters among the running requests (None: no limit)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.capacity_tokens = pages.num_pages * pages.page_size
        self.num_preemptions = 0
        self.num_computed_tokens = 0  # tokens pushed through the model, all requests, all steps
        # Speculative decoding: tokens of the verify block of a decode-ready request (1 = plain decode).
        self.spec_block: Callable[[Request, int], int] | None = None

    # -- intake and removal ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Request]:
        """Abort every (sub-)request with this id; pages and slot are freed at once."""
        hit = [r for r in list(self.waiting) + self.running if r.request_id == request_id]
        for req in hit:
            self.finish(req, "abort", RequestStatus.ABORTED)
        return hit

    def _release(self, req: Request) -> None:
        self.cache.release(req.pages, req.cache_node)
        req.pages, req.cache_node, req.cache_len = [], None, 0
        for slot in (req.slot, req.tail_slot):
            if slot is not None:
                self.slots.free(slot)
        req.slot = req.tail_slot = None

    def _commit(self, req: Request, length: int, checkpoint: int | None = None) -> None:
        got = self.cache.commit(req.cache_ids, req.pages, length, req.cache_node, checkpoint)
        req.pages, req.cache_node, req.cache_len = got.pages, got.node, got.length

    def _commit_full_pages(self, req: Request) -> None:
        """Without KDA any page boundary is reusable: commit up to the last full computed page."""
        aligned = req.computed_len // self.pages.page_size * self.pages.page_size
        if aligned > req.cache_len:
            self._commit(req, aligned)

    def _commit_final(self, req: Request) -> None:
        """Give a leaving request's computed prefix to the cache: up to its tail checkpoint (KDA) or its last
        full page (attention-only models)."""
        if not self.cache.has_state:
            self._commit_full_pages(req)
        elif req.tail_slot is not None:
            if req.tail_len > req.cache_len:
                self._commit(req, req.tail_len, req.tail_slot)
            else:
                self.slots.free(req.tail_slot)
            req.tail_slot = None

    def finish(self, req: Request, reason: str, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """The request leaves: a finished one gives its computed prefix to the cache; pages and slots are freed."""
        if status is RequestStatus.FINISHED:
            self._commit_final(req)
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = status, reason

    def _preempt(self, req: Request) -> None:
        """Free everything and queue for recompute of prompt + outputs so far (ahead of newer arrivals).

        With a prefix cache the computed prefix is committed first, so the recompute mostly hits it.
        """
        self._commit_final(req)
        self._release(req)
        self.running.remove(req)
        req.computed_len = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        index = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(index, req)

    def retract_all(self) -> list[Request]:
        """Every request that computed anything goes back to the queue with nothing computed, pages and slots freed
        and no prefix committed (a weight sync is about to make that KV stale); queue order stays by arrival.

        Returns them (running ones and preempted ones holding outputs); the engine forgets their outputs."""
        hit = sorted(self.running + [r for r in self.waiting if r.output_ids], key=lambda r: r.arrival)
        for req in self.running:
            self._release(req)
            req.status = RequestStatus.WAITING
        fresh = [r for r in self.waiting if not r.output_ids]
        self.running = []
        self.waiting = collections.deque(sorted(hit + fresh, key=lambda r: r.arrival))
        for req in hit:
            req.computed_len = req.cached_tokens = 0
            req.cache_hits = {}
        return hit

    def _reserve(self, req: Request, total_tokens: int) -> bool:
        extra = self.pages.pages_for(total_tokens) - len(req.pages)
        if extra <= 0:
            return True
        got = self.cache.alloc_pages(extra)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    def _plan_snapshots(self, chunk: ScheduledChunk) -> None:
        """Where this chunk leaves KDA checkpoints: interval multiples, its last page boundary if it is a
        prefill chunk, and in decode the tail slot at each page boundary."""
        req, start = chunk.request, chunk.start
        end = start + chunk.num_tokens
        ps, interval = self.pages.page_size, self.cache.track_interval
        commit = set(range((start // interval + 1) * interval, end + 1, interval))
        if chunk.num_tokens > 1 or start < len(req.prompt_ids):
            last = end // ps * ps
            if last > max(start, req.cache_len):
                commit.add(last)
            # A match always leaves the last prompt token to compute, so a prompt ending on a page boundary
            # is only reusable as a whole (the same prompt again) through the checkpoint one page earlier.
            if chunk.samples and last == end and last - ps > max(start, req.cache_len):
                commit.add(last - ps)
        for pos in sorted(commit):
            slot = self.cache.alloc_slot()
            if slot is not None:
                chunk.snapshots.append((pos - start, slot, True))
        if chunk.num_tokens == 1 and end % ps == 0 and end not in commit and end > req.cache_len:
            if req.tail_slot is None:
                req.tail_slot = self.cache.alloc_slot()
            if req.tail_slot is not None:
                chunk.snapshots.append((1, req.tail_slot, False))

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self._schedule_running(plan)
        if not plan.preempted:  # memory ran out: no admissions this step
            self._admit_waiting(plan, budget)
        self._finalize(plan)
        return plan

    def _schedule_running(self, plan: SchedulePlan) -> int:
        """Next chunk of every running request, oldest first; preempts the newest when pages run out.
        Returns the token budget left."""
        budget = self.budget
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or budget <= 0:
                continue
            n = min(req.num_tokens - req.computed_len, self.chunk_cap, budget)
            if n == 1 and self.spec_block is not None and not req.in_prefill:
                n = int(min(self.spec_block(req, budget), self.chunk_cap))
            while not self._reserve(req, req.computed_len + n):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                plan.chunks.append(ScheduledChunk(req, req.computed_len, n, verify=n > 1 and not req.in_prefill))
                budget -= n
        if plan.preempted:
            plan.chunks = [c for c in plan.chunks if c.request in self.running]
        return budget

    def _admit_waiting(self, plan: SchedulePlan, budget: int) -> None:
        """FCFS: admit from the queue head while slots, pages and budget last (a prefix hit starts it later).

        A request whose prompt another request is prefilling right now is passed over until that prefill has left
        its checkpoint in the cache (`shared_prefill`): the n samples of a prompt compute it once."""
        partners = self._prefill_partners()
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_running:
            req = self.waiting[i]
            if req.num_tokens > self.capacity_tokens:
                del self.waiting[i]
                req.error = (
                    f"request needs {req.num_tokens} tokens of KV cache but the pool holds {self.capacity_tokens}"
                )
                self.finish(req, "abort", RequestStatus.ABORTED)
                plan.rejected.append(req)
                continue
            if budget <= 0:
                break
            if partners is not None and self._waits_for_partner(req, partners):
                i += 1
                continue
            if self.max_loras is not None and req.lora_name is not None:
                adapters = {r.lora_name for r in self.running if r.lora_name is not None}
                if req.lora_name not in adapters and len(adapters) >= self.max_loras:
                    break  # FCFS: wait until a running adapter's requests finish
            if self.cache.has_state:
                req.slot = self.cache.alloc_request_slot()
                if req.slot is None:
                    break
            # Prompt logprobs need every prompt row computed, so such requests skip the match (as in vLLM);
            # what they compute is still committed for the requests after them.
            if req.params.prompt_logprobs is None:
                ids = req.cache_ids
                got = self.cache.acquire(ids, self.cache.match(ids), req.slot, len(req.prompt_ids))
                if got is None:
                    self._unadmit(req)
                    break
                req.pages, req.cache_node, req.cache_len = got.pages, got.node, got.length
                req.computed_len = req.cached_tokens = got.length
                req.cache_hits = got.hits_by_tier
            need = req.num_tokens - req.computed_len
            n = min(need, self.chunk_cap, budget)
            if n < need and self.chunk_cap == math.inf:
                if plan.chunks:
                    self._unadmit(req)
                    break
                n = need  # chunking off: a lone prompt may exceed the step budget
            if not self._reserve(req, req.computed_len + n):
                self._unadmit(req)
                break
            del self.waiting[i]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.slot is not None and req.computed_len == 0:
                plan.fresh_slots.append(req.slot)
            plan.chunks.append(ScheduledChunk(req, req.computed_len, n))
            budget -= n
            if partners is not None:
                partners.add(req)

    def _prefill_partners(self) -> PrefillPartners | None:
        """The running requests that still prefill, for `_waits_for_partner` (None: nobody waits, or no prefix cache
        to share)."""
        if not self.waiting or not self.cache.shares_prefixes:
            return None
        partners = PrefillPartners(self.pages.page_size, self.cache.track_interval, self.cache.has_state)
        for req in self.running:
            partners.add(req)
        return partners

    def _waits_for_partner(self, req: Request, partners: PrefillPartners) -> bool:
        """A running prefill will soon leave at least a page more of this prompt in the cache than it holds now."""
        if req.params.prompt_logprobs is not None:
            return False  # it computes every prompt row anyway
        soon = partners.reusable_soon(req)
        return soon > 0 and soon - self.cache.match(req.cache_ids).length >= self.pages.page_size

    # -- requests whose prompt another worker computes (prefill/decode disaggregation) -------------------
    def reserve_prompt(self, req: Request) -> bool:
        """Decode side: pages for the whole prompt and a state slot, the pages of a cached prefix reused (KV only:
        the KDA states arrive with the request). False, and nothing held, when memory is short."""
        if self.cache.has_state:
            req.slot = self.cache.alloc_request_slot()
            if req.slot is None:
                return False
        ids, prompt_len = req.cache_ids, len(req.prompt_ids)
        got = self.cache.acquire(ids, self.cache.match(ids, kv_only=True), None, prompt_len, kv_only=True)
        if got is not None:
            req.pages, req.cache_node, req.cache_len = got.pages, got.node, got.length
            if self._reserve(req, prompt_len):
                return True
        self._unadmit(req)
        return False

    def join(self, req: Request) -> None:
        """Decode side: the prompt's KV and KDA states have arrived; the request decodes from here (its full prompt
        pages go to the prefix cache, so a later turn receives only its new suffix)."""
        req.computed_len = len(req.prompt_ids)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        aligned = req.computed_len // self.pages.page_size * self.pages.page_size
        if aligned > req.cache_len:
            self._commit(req, aligned)

    def hold(self, req: Request) -> None:
        """Prefill side: stop scheduling a request whose KV is being sent; it keeps its pages and slot until
        `finish`."""
        self.running.remove(req)

    def _unadmit(self, req: Request) -> None:
        """Undo a partial admission (prefix lock, pages, slot): the request stays first in the queue."""
        self._release(req)
        req.computed_len = req.cached_tokens = 0
        req.cache_hits = {}

    def _finalize(self, plan: SchedulePlan) -> None:
        plan.chunks.sort(key=lambda c: not c.is_decode)  # stable: decodes first, each group in its own order
        plan.num_decode = sum(c.is_decode for c in plan.chunks)
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            self.num_computed_tokens += chunk.num_tokens
            if self.cache.takes_checkpoints and not chunk.verify:
                self._plan_snapshots(chunk)

    def advance(self, plan: SchedulePlan) -> None:
        """After the forward: the chunks are computed; commit their checkpoints (or full pages) to the cache."""
        for chunk in plan.chunks:
            if not chunk.verify:  # a verify block is committed by `commit_verify`
                chunk.request.computed_len = chunk.start + chunk.num_tokens
                self._cache_chunk(chunk)

    def commit_verify(self, chunk: ScheduledChunk, accepted: int) -> None:
        """The first `accepted` tokens of a verify block are kept: they are computed; the pages that only held
        rejected positions go back to the free list at once."""
        req = chunk.request
        req.computed_len = chunk.start + accepted
        keep = max(self.pages.pages_for(req.computed_len), self.pages.pages_for(req.cache_len))
        if len(req.pages) > keep:
            self.pages.free(req.pages[keep:])
            del req.pages[keep:]

    def _cache_chunk(self, chunk: ScheduledChunk) -> None:
        """After a step: commit the chunk's checkpoints (or, without KDA, its full pages) to the cache."""
        req = chunk.request
        for offset, slot, commit in chunk.snapshots:
            if commit:
                self._commit(req, chunk.start + offset, slot)
            else:
                req.tail_len = chunk.start + offset
        if not self.cache.has_state and chunk.num_tokens > 1:
            self._commit_full_pages(req)
