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
