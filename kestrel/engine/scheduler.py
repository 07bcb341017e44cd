"""Which requests run this step, which token ranges, and where their KV pages and state slots live.

Plain Python over integers: FCFS admission, a per-step token budget, chunked prefill mixed with decodes,
preemption of the newest running request (pages and slot freed, re-queued for recompute) when memory runs out.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.state_pool import SlotAllocator
from kestrel.engine.request import Request, RequestStatus
from kestrel.engine.sampler import SamplerOutput


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of `request.all_ids` go through the model this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last row yields the next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulePlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    fresh_slots: list[int] = field(default_factory=list)  # slots of requests starting from token 0
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)  # can never fit: finished with an error

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        pages: PageAllocator,
        slots: SlotAllocator | None,
        max_running_requests: int,
        max_num_batched_tokens: int,
        chunked_prefill_size: int,
        eos_token_ids: list[int],
    ) -> None:
        self.pages, self.slots = pages, slots
        self.max_running = max_running_requests
        self.budget = max_num_batched_tokens
        self.chunk_cap = math.inf if chunked_prefill_size == -1 else chunked_prefill_size
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.capacity_tokens = pages.num_pages * pages.page_size
        self.num_preemptions = 0

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
            self._finish(req, "abort", RequestStatus.ABORTED)
        return hit

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot is not None and self.slots is not None:
            self.slots.free(req.slot)
        req.slot = None

    def _finish(self, req: Request, reason: str, status: RequestStatus = RequestStatus.FINISHED) -> None:
        self._release(req)
        if status is RequestStatus.FINISHED and req.detokenizer is not None and not req.detokenizer.stopped:
            req.output_text += req.detokenizer.flush()
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = status, reason

    def _preempt(self, req: Request) -> None:
        """Free everything and queue for recompute of prompt + outputs so far (ahead of newer arrivals)."""
        self._release(req)
        self.running.remove(req)
        req.computed_len = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        index = next((i for i, w in enumerate(self.waiting) if w.arrival > req.arrival), len(self.waiting))
        self.waiting.insert(index, req)

    def _reserve(self, req: Request, total_tokens: int) -> bool:
        extra = self.pages.pages_for(total_tokens) - len(req.pages)
        if extra <= 0:
            return True
        got = self.pages.alloc(extra)
        if got is None:
            return False
        req.pages.extend(got)
        return True

    # -- one step --------------------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        budget = self.budget
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or budget <= 0:
                continue
            n = min(req.num_tokens - req.computed_len, self.chunk_cap, budget)
            while not self._reserve(req, req.computed_len + n):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req in self.running:
                plan.chunks.append(ScheduledChunk(req, req.computed_len, n))
                budget -= n
        if plan.preempted:
            plan.chunks = [c for c in plan.chunks if c.request in self.running]
            return plan
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            need = req.num_tokens
            if need > self.capacity_tokens:
                self.waiting.popleft()
                req.error = f"request needs {need} tokens of KV cache but the pool holds {self.capacity_tokens}"
                self._finish(req, "abort", RequestStatus.ABORTED)
                plan.rejected.append(req)
                continue
            n = min(need, self.chunk_cap, budget)
            if n < need and self.chunk_cap == math.inf:
                if plan.chunks:
                    break
                n = need  # chunking off: a lone prompt may exceed the step budget
            if n <= 0:
                break
            slot = None
            if self.slots is not None:
                slot = self.slots.alloc()
                if slot is None:
                    break
            if not self._reserve(req, n):
                if slot is not None:
                    self.slots.free(slot)
                break
            self.waiting.popleft()
            req.slot, req.status = slot, RequestStatus.RUNNING
            self.running.append(req)
            if slot is not None:
                plan.fresh_slots.append(slot)
            plan.chunks.append(ScheduledChunk(req, 0, n))
            budget -= n
        return plan

    def update(self, plan: SchedulePlan, sampled: SamplerOutput) -> list[Request]:
        """Advance computed lengths, append sampled tokens, apply stop rules. Returns requests finished now."""
        finished = []
        sample_i = 0
        for chunk in plan.chunks:
            req = chunk.request
            req.computed_len = chunk.start + chunk.num_tokens
            if not chunk.samples:
                continue
            token = sampled.token_ids[sample_i]
            req.output_ids.append(token)
            if req.params.logprobs is not None:
                req.logprobs.append(sampled.logprobs[sample_i])
                req.top_logprobs.append(sampled.top_logprobs[sample_i])
            sample_i += 1
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _stop_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if req.detokenizer is not None:
            req.output_text += req.detokenizer.push(token)
            if req.detokenizer.stopped:
                return "stop"
        if len(req.output_ids) >= params.min_tokens:
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                return "stop"
        if len(req.output_ids) >= params.max_tokens:
            return "length"
        return None
