"""What the engine reports: prompt logprobs, stop strings and stop tokens, min_tokens, capacity accounting."""

from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.models.simple_cache import full_logits


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=2048, chunked_prefill_size=8, page_size=4)


@pytest.mark.parametrize("repeat", [1, 2])  # the second run finds the prompt in the prefix cache
def test_prompt_logprobs_across_chunks_match_full_forward(llm, repeat):
    prompt = torch.randint(3, 259, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.outputs[0].cached_tokens == 0  # prompt logprobs need every prompt row computed
    expected = torch.log_softmax(full_logits(llm.engine.model, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(expected[i - 1, prompt[i]]), abs=1e-4)
        assert [t for t, _ in entry.top] == expected[i - 1].topk(2).indices.tolist()


def test_stop_string_spanning_tokens_is_not_emitted(llm):
    prompt = "Hello there"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    tokens = base.outputs[0].token_ids
    # a stop string made of the bytes of tokens 3..5 spans several tokens (byte-level vocabulary)
    stop = llm.tokenizer.decode(tokens[3:6])
    if not stop or stop not in text:
        pytest.skip("continuation not byte-decodable into a clean stop string")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_min_tokens(llm):
    prompt = "abc"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    tokens = base.outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[2]]), use_tqdm=False)
    stopped = out[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[: tokens.index(tokens[2]) + 1]
    eos = llm.engine.model_config.eos_token_id[0]
    never_eos = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[t for t in range(259)])
    out = llm.generate(prompt, never_eos, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids


def test_pool_sizing_from_mem_fraction_logs_capacity(tiny_checkpoints, caplog):
    import logging

    caplog.set_level(logging.INFO)
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), mem_fraction=0.01, max_running_requests=4, max_model_len=256)
    stats = llm.engine.stats()
    assert stats["pages_total"] * llm.engine.config.page_size <= 4 * 256 + llm.engine.config.page_size
    assert any("capacity:" in r.message for r in caplog.records)


def test_state_checkpoints_take_their_memory_share_of_the_kv_pool(tiny_checkpoints, monkeypatch):
    """Checkpoints get `state_checkpoint_memory_ratio` of the KV pool's bytes (at least 2 per running request); under
    `mem_fraction` the KV pool, the running requests' slots and the checkpoints share the budget."""
    from kestrel.cache.state_pool import state_bytes_per_slot
    from kestrel.engine import capacity

    path = str(tiny_checkpoints["kimi_linear"])

    def sizes(**kw) -> tuple[int, int, int, int]:
        engine = LLM(path, max_running_requests=2, **kw).engine
        slot_bytes = state_bytes_per_slot(engine.model.cfg, torch.float32)
        kv_bytes = engine.pages.num_pages * engine.config.page_size * engine.kv_bytes_per_token
        return engine.slots.num_slots, kv_bytes, slot_bytes, engine.config.page_size

    reserved = 2 + 2  # a slot and a tail slot per running request
    slots, kv_bytes, slot_bytes, _ = sizes(max_total_tokens=8192)
    assert slots - reserved == max(4, int(0.25 * kv_bytes // slot_bytes)) > 4
    slots, kv_bytes, slot_bytes, _ = sizes(max_total_tokens=8192, state_checkpoint_memory_ratio=1.0)
    assert slots - reserved == int(kv_bytes // slot_bytes)
    assert sizes(max_total_tokens=8192, state_checkpoint_memory_ratio=0.0)[0] == reserved + 4
    assert sizes(max_total_tokens=8192, max_state_checkpoints=3)[0] == reserved + 3
    assert sizes(max_total_tokens=8192, enable_prefix_caching=False)[0] == 2

    budget = 4 << 20
    monkeypatch.setattr(capacity, "free_memory_bytes", lambda device: budget)
    slots, kv_bytes, slot_bytes, _ = sizes(mem_fraction=1.0, max_model_len=1 << 20)
    assert slots * slot_bytes + kv_bytes <= budget  # rollout records are off: KV bytes are all the pages hold
    assert (slots - reserved) * slot_bytes == pytest.approx(0.25 * kv_bytes, rel=0.01)


def test_the_dflash_context_pool_is_counted_in_the_kv_budget(monkeypatch):
    """With DFlash and a prefix cache every KV slot also holds a draft context row: the pages a memory budget buys
    shrink by exactly that row, and the pool the speculator builds is that many rows of that size."""
    from kestrel.engine import capacity
    from kestrel.engine.config import EngineConfig
    from kestrel.spec.context_pool import bytes_per_slot

    budget, kv = 64 << 20, 896
    monkeypatch.setattr(capacity, "free_memory_bytes", lambda device: budget)
    engine = LLM(None, max_total_tokens=4096, speculative_algorithm="dflash").engine
    cfg, cpu = engine.model_config, torch.device("cpu")
    row = bytes_per_slot(cfg.hidden_size, torch.float32)
    assert row == 256 * 4 + 16
    assert engine.spec.context_pool.nbytes == engine.runner.kv_slots * row

    def pages(**kw) -> int:
        return capacity.num_kv_pages(EngineConfig(mem_fraction=1.0, **kw), cfg, cpu, kv, 0, 1 << 20)

    assert pages(speculative_algorithm="dflash") == pytest.approx(pages() * kv / (kv + row), rel=0.01)
    assert pages(speculative_algorithm="dflash", enable_prefix_caching=False) == pages()  # no pool without a cache


def test_state_checkpoint_memory_ratio_must_not_be_negative():
    from kestrel.config import ConfigError
    from kestrel.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="state_checkpoint_memory_ratio"):
        EngineConfig(state_checkpoint_memory_ratio=-0.5)
