"""The scheduler on its own (integers only): the order contract of a mixed step."""

from __future__ import annotations

import pytest

from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.prefix import NoPrefixCache
from kestrel.cache.state_pool import SlotAllocator
from kestrel.engine.request import Request
from kestrel.engine.sampling_params import SamplingParams
from kestrel.engine.scheduler import Scheduler


def _scheduler(num_slots: int) -> Scheduler:
    pages, slots = PageAllocator(64, 4), SlotAllocator(num_slots)
    return Scheduler(pages, slots, NoPrefixCache(pages, slots), 8, 64, chunked_prefill_size=4)


def _complete(sched: Scheduler, plan) -> None:
    """'Compute' the plan and give every sampling chunk a token, as the engine would."""
    sampling = [c.request for c in plan.chunks if c.samples]
    sched.advance(plan)
    for req in sampling:
        req.output_ids.append(7)


def test_mixed_step_puts_decode_rows_first_in_stable_order():
    for num_slots in (0, 8):  # without and with KDA state slots
        sched = _scheduler(num_slots)
        params = SamplingParams(max_tokens=100)
        long_prompt = Request("long", list(range(3, 23)), params, arrival=0)  # chunked: 4 tokens a step
        short = [Request(f"s{i}", [5, 6, 7], params, arrival=1 + i) for i in range(2)]
        for req in [long_prompt, *short]:
            sched.add(req)
        first = sched.schedule()
        assert first.num_decode == 0 and [c.request for c in first.chunks] == [long_prompt, *short]
        _complete(sched, first)
        late = Request("late", [9], params, arrival=3)  # one prompt token: its first chunk is a decode row
        sched.add(late)
        plan = sched.schedule()
        assert [c.request for c in plan.chunks] == [*short, late, long_prompt]
        assert plan.num_decode == 3
        assert all(c.num_tokens == 1 and c.samples for c in plan.chunks[: plan.num_decode])
        assert plan.chunks[3].num_tokens == 4 and plan.chunks[3].start == 4


def test_slot_allocator_gives_requests_the_low_end_and_checkpoints_the_high_end():
    slots = SlotAllocator(6)
    assert [slots.alloc_low(), slots.alloc_low(), slots.alloc()] == [0, 1, 5]
    slots.free(1)
    slots.free(0)
    assert [slots.alloc_low() for _ in range(3)] == [0, 1, 2]  # freed out of order, handed out in order again
    assert slots.alloc() == 4 and slots.alloc_low() == 3 and slots.alloc_low() is None and slots.alloc() is None
    with pytest.raises(RuntimeError, match="freed twice"):
        slots.free(9)
    assert slots.num_used == 6 and slots.num_free == 0
