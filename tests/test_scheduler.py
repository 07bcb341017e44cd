"""The scheduler on its own (integers only): the order contract of a mixed step, and the samples of one prompt
sharing its prefill."""

from __future__ import annotations

import pytest

from kestrel.cache.kv_pool import PageAllocator
from kestrel.cache.prefix import NoPrefixCache
from kestrel.cache.radix import RadixCache
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


class _StateIO:
    """The one device call a radix cache without HiCache makes: copying a KDA state between slots."""

    def copy_state(self, src: int, dst: int) -> None:
        pass


def _radix_scheduler(with_state: bool, budget: int = 256, chunk: int = 64) -> Scheduler:
    pages, slots = PageAllocator(256, 4), SlotAllocator(64 if with_state else 0)
    cache = RadixCache(pages, slots, _StateIO(), 8)
    return Scheduler(pages, slots, cache, 32, budget, chunked_prefill_size=chunk)


@pytest.mark.parametrize("with_state", [True, False])
def test_samples_of_one_prompt_wait_for_its_prefill_and_start_from_its_checkpoint(with_state):
    """n samples of a 22-token prompt: the first prefills it, the others are passed over (a different prompt queued
    after them is not) and start the next step from the prefix the first left: 20 tokens (a page multiple)."""
    sched = _radix_scheduler(with_state)
    params = SamplingParams(max_tokens=8)
    prompt = list(range(3, 25))
    samples = [Request("group", prompt, params, arrival=i) for i in range(4)]
    other = Request("other", list(range(100, 110)), params, arrival=4)
    for req in [*samples, other]:
        sched.add(req)
    first = sched.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in first.chunks] == [(samples[0], 0, 22), (other, 0, 10)]
    _complete(sched, first)
    second = sched.schedule()
    started = {c.request: (c.start, c.num_tokens) for c in second.chunks if c.request in samples[1:]}
    assert started == {req: (20, 2) for req in samples[1:]}
    assert all(req.cached_tokens == 20 for req in samples[1:])
    assert sched.num_computed_tokens == 22 + 10 + 3 * 2 + 2  # + the two decode rows of the first step's prompts


def test_a_chunked_prefill_holds_its_samples_until_it_passes_the_shared_part():
    """With a 16-token chunk cap the 40-token prompt takes three steps; its samples start once it is computed, from
    the checkpoint a page before its end (a prompt ending on a page boundary)."""
    sched = _radix_scheduler(with_state=True, chunk=16)
    params = SamplingParams(max_tokens=4)
    samples = [Request("group", list(range(3, 43)), params, arrival=i) for i in range(3)]
    for req in samples:
        sched.add(req)
    for _ in range(3):
        plan = sched.schedule()
        assert [c.request for c in plan.chunks] == [samples[0]]
        _complete(sched, plan)
    plan = sched.schedule()
    assert {c.request: c.start for c in plan.chunks if c.request is not samples[0]} == {samples[1]: 36, samples[2]: 36}


def test_nothing_waits_without_a_prefix_cache_or_for_prompt_logprobs():
    for sched, params in (
        (_scheduler(8), SamplingParams(max_tokens=4)),
        (_radix_scheduler(with_state=True), SamplingParams(max_tokens=4, prompt_logprobs=0)),
    ):
        samples = [Request("group", list(range(3, 30)), params, arrival=i) for i in range(3)]
        for req in samples:
            sched.add(req)
        plan = sched.schedule()
        assert {c.request for c in plan.chunks if c.start == 0} == set(samples)
