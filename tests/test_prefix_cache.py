"""Prefix caching end to end: cache on == cache off, computed-token counters, eviction, HiCache L2 and L3."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.cache.prefix import NoPrefixCache
from kestrel.cache.radix import RadixCache

FAMILIES = ["kimi_linear", "deepseek_v32", "kimi_k3"]
PAGE = 16


def _tokens(n: int, seed: int, vocab: int = 250) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _converse(llm: LLM, sessions: int, turns: int, new_tokens, out_tokens: int, seed: int = 0):
    """Every turn extends each session's history by its last output and new user tokens; all sessions batched.

    Returns per turn the (prompt, output ids, cached tokens, computed prefill tokens) of each session.
    """
    histories: list[list[int]] = [[] for _ in range(sessions)]
    record = []
    for turn in range(turns):
        for s in range(sessions):
            histories[s] = histories[s] + _tokens(new_tokens(turn), seed=seed + 1000 * s + turn)
        before = llm.engine.scheduler.num_computed_tokens
        outs = llm.generate([list(h) for h in histories], _greedy(out_tokens), use_tqdm=False)
        computed = llm.engine.scheduler.num_computed_tokens - before
        rows = []
        for s, out in enumerate(outs):
            comp = out.outputs[0]
            rows.append((list(histories[s]), comp.token_ids, comp.cached_tokens))
            histories[s] = histories[s] + comp.token_ids
        # decode steps forward out_tokens - 1 tokens per session; the rest is prefill
        record.append((rows, computed - sessions * (out_tokens - 1)))
    return record


def _assert_idle_and_clear(llm: LLM) -> None:
    engine = llm.engine
    engine.cache.check_counters()
    stats = engine.stats()
    assert stats["pages_used"] == 0 and stats["slots_used"] == 0 and stats["running"] == 0
    engine.cache.clear()
    assert engine.pages.num_used == 0 and engine.slots.num_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_outputs_equal_cache_off(family, tiny_checkpoints):
    args = dict(max_total_tokens=4096, page_size=PAGE, chunked_prefill_size=48, state_track_interval=32)
    on = LLM(str(tiny_checkpoints[family]), **args)
    off = LLM(str(tiny_checkpoints[family]), enable_prefix_caching=False, **args)
    assert isinstance(on.engine.cache, RadixCache) and isinstance(off.engine.cache, NoPrefixCache)
    rec_on = _converse(on, sessions=2, turns=4, new_tokens=lambda t: 37 if t == 0 else 21, out_tokens=7)
    rec_off = _converse(off, sessions=2, turns=4, new_tokens=lambda t: 37 if t == 0 else 21, out_tokens=7)
    for turn, ((rows_on, computed_on), (rows_off, computed_off)) in enumerate(zip(rec_on, rec_off)):
        for (p_on, out_on, cached_on), (p_off, out_off, cached_off) in zip(rows_on, rows_off):
            assert p_on == p_off and out_on == out_off, f"turn {turn}: cached run diverged"
            assert cached_off == 0
            if turn > 0:
                assert cached_on > 0
        if turn > 0:
            assert computed_on < computed_off
    _assert_idle_and_clear(on)


def test_ten_turn_agent_computes_only_new_tokens(tiny_checkpoints):
    interval = 64
    llm = LLM(
        str(tiny_checkpoints["kimi_k3"]),
        max_total_tokens=8192,
        page_size=PAGE,
        chunked_prefill_size=128,
        state_track_interval=interval,
    )
    new = lambda t: 150 if t == 0 else 24 + 7 * t  # noqa: E731
    record = _converse(llm, sessions=1, turns=10, new_tokens=new, out_tokens=13)
    for turn, (rows, computed) in enumerate(record):
        (prompt, _, cached) = rows[0]
        assert computed == len(prompt) - cached
        if turn == 0:
            assert cached == 0
            continue
        assert computed <= new(turn) + interval, f"turn {turn}: {computed} tokens computed for {new(turn)} new"
        # The finish-time checkpoint sits at the last page boundary, so at most a page more than the new part.
        assert computed <= new(turn) + PAGE
    stats = llm.engine.stats()
    assert stats["prefix_cache_checkpoints_taken"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    _assert_idle_and_clear(llm)


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v32"])
def test_small_pool_evicts_and_stays_exact(family, tiny_checkpoints):
    args = dict(page_size=PAGE, chunked_prefill_size=64, state_track_interval=32, max_running_requests=4)
    small = LLM(str(tiny_checkpoints[family]), max_total_tokens=320, **args)
    off = LLM(str(tiny_checkpoints[family]), max_total_tokens=4096, enable_prefix_caching=False, **args)
    rec = _converse(small, sessions=3, turns=3, new_tokens=lambda t: 40, out_tokens=6, seed=7)
    ref = _converse(off, sessions=3, turns=3, new_tokens=lambda t: 40, out_tokens=6, seed=7)
    for (rows, _), (ref_rows, _) in zip(rec, ref):
        assert [r[1] for r in rows] == [r[1] for r in ref_rows]
    assert small.engine.stats()["prefix_cache_evicted_pages"] > 0
    _assert_idle_and_clear(small)


def test_hicache_host_tier_serves_evicted_prefixes(tiny_checkpoints):
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=PAGE, chunked_prefill_size=64, state_track_interval=32, max_running_requests=2)
    hi = LLM(path, max_total_tokens=256, hicache_size=0.05, hicache_write_policy="write_back", **args)
    off = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, **args)
    # Two sessions take turns, one at a time: each turn of one evicts the other from the device pool.
    histories = {0: _tokens(120, 1), 1: _tokens(120, 2)}
    for _ in range(3):
        for s in (0, 1):
            out = hi.generate([histories[s]], _greedy(5), use_tqdm=False)[0].outputs[0]
            ref = off.generate([histories[s]], _greedy(5), use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ref.token_ids
            histories[s] = histories[s] + out.token_ids + _tokens(20, 10 + s)
    stats = hi.engine.stats()
    assert stats["prefix_cache_evicted_pages"] > 0
    assert stats["prefix_cache_host_hit_tokens"] > 0 and stats["hicache_host_bytes"] > 0
    _assert_idle_and_clear(hi)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_disk_tier_survives_restart_and_skips_corrupt_files(policy, tiny_checkpoints, tmp_path):
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=PAGE, chunked_prefill_size=64, state_track_interval=32)
    prompt = _tokens(150, 5)
    off = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, **args)
    expected = off.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0].token_ids

    first = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), hicache_write_policy=policy, **args)
    first.generate([prompt], _greedy(6), use_tqdm=False)
    first.engine.close()  # write_back flushes here
    assert list(tmp_path.rglob("*.page")) and list(tmp_path.rglob("*.state"))

    second = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), **args)
    out = second.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert out.cached_tokens >= 128 and second.engine.stats()["prefix_cache_disk_hit_tokens"] == out.cached_tokens
    assert out.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": out.cached_tokens}

    # Damage the files: one truncated page, one flipped byte in a state. A fresh engine must notice, skip
    # them (recomputing from the last good checkpoint, if any) and still answer exactly.
    pages = sorted(tmp_path.rglob("*.page"))
    states = sorted(tmp_path.rglob("*.state"))
    pages[len(pages) // 2].write_bytes(pages[len(pages) // 2].read_bytes()[:100])
    for state in states:
        blob = bytearray(state.read_bytes())
        blob[-5] ^= 0x5A
        state.write_bytes(bytes(blob))
    third = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), **args)
    out = third.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert third.engine.stats()["prefix_cache_disk_corrupt_files"] >= 1
    assert out.cached_tokens == 0  # every checkpoint was damaged: nothing may be reused


def test_three_tiers_write_back_spills_device_to_host_to_disk(tiny_checkpoints, tmp_path):
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=PAGE, chunked_prefill_size=64, state_track_interval=32, max_running_requests=2)
    off = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, **args)
    tiers = dict(hicache_size=2e-4, hicache_storage_dir=str(tmp_path), hicache_write_policy="write_back")
    llm = LLM(path, max_total_tokens=256, **tiers, **args)  # 16 device pages, ~200 KB of host memory
    prompts = [_tokens(150, 20 + i) for i in range(4)]
    for p in prompts:  # each evicts the one before from the device, and host eviction spills to disk
        llm.generate([p], _greedy(4), use_tqdm=False)
    assert llm.engine.hicache.host_used <= 2e-4 * 1e9 and list(tmp_path.rglob("*.page"))
    for p in prompts:
        q = p + [5, 6, 7]
        out = llm.generate([q], _greedy(4), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == off.generate([q], _greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["prefix_cache_host_hit_tokens"] + stats["prefix_cache_disk_hit_tokens"] > 0
    assert stats["prefix_cache_disk_hit_tokens"] > 0
    _assert_idle_and_clear(llm)


def test_unreadable_disk_file_is_a_miss_not_an_error(tiny_checkpoints, tmp_path):
    """Guards issue 12 #2: an OS error on one disk-tier file (here a directory in place of a page file, a stand-in
    for EIO/EACCES) must not abort the step; the request completes exactly and the error is counted."""
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=PAGE, chunked_prefill_size=64, state_track_interval=32)
    prompt = _tokens(150, 5)
    off = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, **args)
    expected = off.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0].token_ids

    tiers = dict(hicache_storage_dir=str(tmp_path), hicache_write_policy="write_through")
    LLM(path, max_total_tokens=4096, **tiers, **args).generate([prompt], _greedy(6), use_tqdm=False)
    pages = sorted(tmp_path.rglob("*.page"))
    bad = pages[len(pages) // 2]
    bad.unlink()
    bad.mkdir()

    llm = LLM(path, max_total_tokens=4096, **tiers, **args)
    out = llm.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    stats = llm.engine.stats()
    assert stats["prefix_cache_disk_io_errors"] >= 1 and stats["prefix_cache_disk_corrupt_files"] == 0
    assert bad.is_dir()  # an unreadable file is left alone: it is not known to be corrupt
    _assert_idle_and_clear(llm)


def _disk_llm(path: str, tmp_path, **args) -> LLM:
    tiers = dict(hicache_storage_dir=str(tmp_path), hicache_write_policy="write_through")
    return LLM(path, max_total_tokens=4096, page_size=PAGE, chunked_prefill_size=64, **tiers, **args)


def test_disk_continuation_after_a_device_prefix_is_used(tiny_checkpoints, tmp_path):
    """Guards issue 12 #3: the device holds a long prefix, the disk the short rest. The disk hit's length counts
    from where the device match ends, so it must not be compared with the device match's length from the start."""
    path = str(tiny_checkpoints["kimi_k3"])
    off = LLM(path, max_total_tokens=4096, page_size=PAGE, chunked_prefill_size=64, enable_prefix_caching=False)
    prefix, rest = _tokens(97, 31), _tokens(60, 32)
    prompt = prefix + rest + [7, 8, 9]
    expected = off.generate([prompt], _greedy(6), use_tqdm=False)[0].outputs[0].token_ids

    llm = _disk_llm(path, tmp_path, state_track_interval=32)
    llm.generate([prefix], _greedy(1), use_tqdm=False)  # a checkpoint at 96 on the device
    llm.generate([prefix + rest], _greedy(1), use_tqdm=False)  # and one at 144, written through to disk
    cache = llm.engine.cache
    cache.evict_pages(1)  # the leaf after 96 leaves the device; the disk keeps it
    assert 0 < cache.device_pages() < 9
    out = llm.generate([prompt], _greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert out.cached_tokens_by_tier["disk"] > 0 and out.cached_tokens == 144
    _assert_idle_and_clear(llm)


def test_checkpoint_only_on_disk_is_used_when_the_device_covers_the_prompt(tiny_checkpoints, tmp_path):
    """Guards issue 12 #3: every page is on the device but no checkpoint is; the disk has the checkpoint of the
    deepest node, so the whole prefix is reused instead of nothing."""
    path = str(tiny_checkpoints["kimi_k3"])
    off = LLM(path, max_total_tokens=4096, page_size=PAGE, chunked_prefill_size=64, enable_prefix_caching=False)
    prompt = _tokens(150, 33)
    expected = off.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0].token_ids

    llm = _disk_llm(path, tmp_path, state_track_interval=64)
    llm.generate([prompt], _greedy(1), use_tqdm=False)
    cache = llm.engine.cache
    cache.evict_checkpoints(cache.device_checkpoints())
    assert cache.device_checkpoints() == 0 and cache.device_pages() == 9
    out = llm.generate([prompt + [7, 8, 9]], _greedy(6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert out.cached_tokens == 144 and out.cached_tokens_by_tier == {"device": 144, "host": 0, "disk": 0}
    _assert_idle_and_clear(llm)


def test_one_running_request_keeps_checkpoints_for_prompts_that_come_back(tiny_checkpoints):
    """Checkpoints are sized by memory (a share of the KV pool), not 2 per running request: with one running request
    the old budget of 2 was evicted before any of several alternating prompts came back, so nothing ever hit."""
    args = dict(max_running_requests=1, max_total_tokens=8192, page_size=PAGE, state_track_interval=32)
    prompts = [_tokens(40 + 9 * i, seed=50 + i) for i in range(5)]

    def two_rounds(llm: LLM) -> tuple[list, list, int]:
        first = llm.generate(prompts, _greedy(5), use_tqdm=False)
        second = llm.generate(prompts, _greedy(5), use_tqdm=False)
        return first, second, llm.engine.stats()["prefix_cache_hit_tokens"]

    sized = LLM(str(tiny_checkpoints["kimi_linear"]), **args)
    assert sized.engine.slots.num_slots > 2 + 2  # a running slot and its tail slot, then the checkpoints
    first, second, hits = two_rounds(sized)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
    assert all(o.outputs[0].cached_tokens > 0 for o in second), "a prompt seen before must hit"
    assert all(o.outputs[0].cached_tokens == 0 for o in first)
    _assert_idle_and_clear(sized)

    _, _, old_hits = two_rounds(LLM(str(tiny_checkpoints["kimi_linear"]), max_state_checkpoints=2, **args))
    assert old_hits < hits


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v32"])
def test_n_samples_compute_their_prompt_once_and_sample_what_they_would_alone(family, tiny_checkpoints):
    """A GRPO-style group (n = 4 seeded samples of two prompts) prefills each prompt once: the other samples wait a
    step and start from its checkpoint. In deterministic mode their tokens and logprobs are those of the engine
    without a prefix cache, bit for bit."""
    prompts = [_tokens(45, seed=7), _tokens(38, seed=8)]
    params = SamplingParams(temperature=1.0, max_tokens=6, n=4, seed=3, logprobs=0, ignore_eos=True)
    args = dict(max_total_tokens=4096, page_size=PAGE, deterministic_inference=True)

    def run(**extra):
        llm = LLM(str(tiny_checkpoints[family]), **args, **extra)
        outs = llm.generate(prompts, params, use_tqdm=False)
        samples = [(c.token_ids, c.logprobs, c.cached_tokens) for o in outs for c in o.outputs]
        return llm, samples

    shared, got = run()
    _, alone = run(enable_prefix_caching=False)
    assert [s[:2] for s in got] == [s[:2] for s in alone]
    # Per prompt: one sample computes it, three start from its last page boundary (45 -> 32 + 13, 38 -> 32 + 6).
    assert sorted(s[2] for s in got) == [0, 0] + [32] * 6
    prefill = shared.engine.scheduler.num_computed_tokens - len(got) * (params.max_tokens - 1)
    assert prefill == 45 + 38 + 3 * (13 + 6)
    _assert_idle_and_clear(shared)
