"""Multi-LoRA serving: a step mixing the base and several adapters gives each request what it gets alone."""

from __future__ import annotations

import pytest
import torch
from lora_fixtures import write_adapters

from kestrel import LLM, SamplingParams
from kestrel.config import ConfigError
from kestrel.models.simple_cache import greedy_generate

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    return write_adapters(tiny_checkpoints["kimi_k3"], tmp_path_factory.mktemp("adapters"))


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def _llm(tiny_checkpoints, adapters, **kw) -> LLM:
    paths = [f"{name}={path}" for name, path in adapters.items()]
    return LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=4096, lora_paths=paths, **kw)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 259, (40,), generator=gen).tolist()  # one prompt under every adapter (cache keys)
    return [shared, shared, shared] + [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (9, 33, 21)]


LORAS = [None, "a1", "a2", "a1", None, "a2"]


def test_mixed_adapter_batch_equals_each_request_alone(tiny_checkpoints, adapters):
    llm = _llm(tiny_checkpoints, adapters, chunked_prefill_size=16, max_num_batched_tokens=48)
    prompts = _prompts()
    alone = [llm.generate([p], _greedy(), use_tqdm=False, lora_name=lo)[0] for p, lo in zip(prompts, LORAS)]
    llm.engine.cache.clear()
    mixed = llm.generate(prompts, _greedy(), use_tqdm=False, lora_name=LORAS)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].logprobs == pytest.approx(a.outputs[0].logprobs, abs=1e-4)
    # Independent oracle: the plain single-request path with the adapter on every row.
    engine = llm.engine
    for p, lo, out in zip(prompts, LORAS, mixed):
        engine.lora.apply_to_all(engine.lora.slot_of(lo) if lo else None)
        tokens, _ = greedy_generate(engine.model, p, NEW_TOKENS)
        assert out.outputs[0].token_ids == tokens
    # The adapters matter: the shared prompt gives three different logprob sequences.
    lps = [tuple(out.outputs[0].logprobs) for out in mixed[:3]]
    assert len(set(lps)) == 3


def test_adapters_never_share_prefix_cache_entries(tiny_checkpoints, adapters):
    llm = _llm(tiny_checkpoints, adapters)
    shared = _prompts()[0]
    first = [llm.generate([shared], _greedy(), use_tqdm=False, lora_name=lo)[0] for lo in (None, "a1", "a2")]
    assert all(out.outputs[0].cached_tokens == 0 for out in first)  # another adapter's pages never match
    again = [llm.generate([shared], _greedy(), use_tqdm=False, lora_name=lo)[0] for lo in (None, "a1", "a2")]
    for a, b in zip(first, again):
        assert b.outputs[0].cached_tokens > 0  # its own pages do
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_max_loras_per_batch_bounds_adapters_per_step(tiny_checkpoints, adapters):
    llm = _llm(tiny_checkpoints, adapters, max_loras_per_batch=1)
    engine, prompts = llm.engine, _prompts()
    ids = [engine.add_request(p, _greedy(), lora_name=lo) for p, lo in zip(prompts, LORAS)]
    seen = set()
    while engine.has_unfinished:
        engine.step()
        running = {r.lora_name for r in engine.scheduler.running if r.lora_name}
        assert len(running) <= 1
        seen |= running
    assert seen == {"a1", "a2"} and not engine.requests(ids[0])


def test_unknown_adapter_and_bad_options_are_named(tiny_checkpoints, adapters, tmp_path):
    llm = _llm(tiny_checkpoints, adapters)
    with pytest.raises(ValueError, match="lora_path: adapter 'nope' is not loaded"):
        llm.engine.add_request([5, 6, 7], _greedy(), lora_name="nope")
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        llm.engine.load_lora_adapter("x", str(tmp_path))
    with pytest.raises(ValueError, match="max-lora-rank"):
        _llm(tiny_checkpoints, adapters, max_lora_rank=2)
    with pytest.raises(ConfigError, match="lora_paths"):
        LLM(str(tiny_checkpoints["kimi_k3"]), lora_paths=["no-equals-sign"])
    plain = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=1024)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.engine.add_request([5, 6, 7], _greedy(), lora_name="a1")
