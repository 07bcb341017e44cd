"""`--deterministic-inference`: the engine's rollout logprobs are bit-identical to a trainer's in batch-invariant mode
(batched with other requests, chunked prefill, decode, prefix-cache hits), on every family and over 20 LoRA RL steps
with the adapter pushed to the engine after each one; the normal mode differs, slightly."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from kestrel import LLM, SamplingParams
from kestrel.cli import add_engine_args
from kestrel.config import ConfigError
from kestrel.engine.config import EngineConfig
from kestrel.models.checkpoint import make_model
from kestrel.models.layers import batch_invariant as bi
from kestrel.models.loader import load_model
from kestrel.train.lora import attach_trainable, new_adapter, save_adapter
from kestrel.train.routing_replay import Rollout, logprob_mismatch, sequence_logprobs

FAMILIES = ["kimi_linear", "deepseek_v32", "kimi_k3"]
ENGINE = dict(dtype="float32", device="cpu", max_total_tokens=4096, page_size=4, chunked_prefill_size=16)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sampled(seeds, tokens: int = 6) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=tokens, temperature=1.0, seed=s, logprobs=0, ignore_eos=True) for s in seeds]


def _generate(llm: LLM, prompts: list[list[int]], seeds, lora: str | None = None) -> list[Rollout]:
    outs = llm.generate(prompts, _sampled(seeds), use_tqdm=False, lora_name=lora)
    return [Rollout.from_output(p, o.outputs[0]) for p, o in zip(prompts, outs)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deterministic")
    return {family: str(make_model(family, "tiny", root / family, seed=0)) for family in FAMILIES}


def _engine_vs_trainer(path: str, deterministic: bool) -> tuple[dict[str, float], int]:
    """Two waves of sampled rollouts (four prompts at once, chunked; then a prefix-cache hit beside a cold prompt)
    scored by a trainer packing all six into one forward."""
    llm = LLM(path, **ENGINE, deterministic_inference=deterministic)
    first = [_tokens(n, n) for n in (37, 5, 23, 50)]
    rollouts = _generate(llm, first, range(4))
    second = [first[0][:28] + _tokens(6, 99), _tokens(41, 98)]
    outs = llm.generate(second, _sampled((4, 5)), use_tqdm=False)
    cached = outs[0].outputs[0].cached_tokens
    rollouts += [Rollout.from_output(p, o.outputs[0]) for p, o in zip(second, outs)]
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    model.batch_invariant = deterministic
    model.train()  # the trainer's forward (DSA indexers take their detached training path)
    return logprob_mismatch(rollouts, sequence_logprobs(model, rollouts, replay=False)), cached


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_logprobs_equal_the_trainers_bit_for_bit(family, checkpoints):
    exact, cached = _engine_vs_trainer(checkpoints[family], deterministic=True)
    assert cached >= 16
    assert exact == {"max_abs": 0.0, "mean_abs": 0.0, "kl": 0.0}
    normal, _ = _engine_vs_trainer(checkpoints[family], deterministic=False)
    assert 0.0 < normal["max_abs"] < 1e-4, normal


def test_twenty_lora_steps_with_adapter_sync_keep_the_kl_exactly_zero(checkpoints, tmp_path):
    path = checkpoints["kimi_k3"]
    llm = LLM(path, **ENGINE, deterministic_inference=True, enable_lora=True)
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    model.batch_invariant = True
    model.train()
    # Attention projections, the dense / shared MLPs and the routed experts (per-expert A and B).
    adapter = new_adapter(model, ["q_proj", "o_proj", "gate_proj"], r=4, lora_alpha=8.0, name="policy", seed=0)
    _, params = attach_trainable(model, adapter)
    optimizer = torch.optim.Adam(params, lr=0.02)
    prompts = [_tokens(n, 100 + n) for n in (12, 20, 31, 9)]
    for step in range(20):
        name = f"policy-{step}"
        llm.engine.load_lora_adapter(name, str(save_adapter(adapter, tmp_path / name, cfg.model_type)))
        if step:
            llm.engine.unload_lora_adapter(f"policy-{step - 1}")
        rollouts = _generate(llm, prompts, [100 * step + i for i in range(len(prompts))], lora=name)
        if step == 0:
            first = rollouts
        trainer = sequence_logprobs(model, rollouts, replay=False)
        stats = logprob_mismatch(rollouts, trainer)
        assert stats["kl"] == 0.0 and stats["max_abs"] == 0.0, (step, stats)
        # REINFORCE with a mean baseline; reward: the share of even token ids.
        rewards = torch.tensor([sum(t % 2 == 0 for t in r.output_ids) / len(r.output_ids) for r in rollouts])
        advantages = rewards - rewards.mean()
        loss = -sum(a * lp.sum() for a, lp in zip(advantages, trainer)) / len(rollouts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # The policy did move: step 0's rollouts score differently now.
    with torch.no_grad():
        moved = logprob_mismatch(first, sequence_logprobs(model, first, replay=False))
    assert moved["max_abs"] > 1e-3


def test_fixed_order_kernels_give_a_row_the_same_bits_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 48, generator=gen), torch.randn(80, 48, generator=gen), torch.randn(80, generator=gen)
    full = bi.linear(x, w, b)
    assert all(torch.equal(bi.linear(x[i : i + 1], w, b)[0], full[i]) for i in (0, 5, 36))
    assert torch.allclose(full, F.linear(x, w, b), atol=1e-4)
    with bi.mode():
        assert bi.active() and torch.equal(F.linear(x, w, b), full)
    assert not bi.active()
    v = torch.randn(1000, generator=gen) * 6
    for fixed, ref in ((bi.sigmoid, torch.sigmoid), (bi.silu, F.silu), (bi.softplus, F.softplus)):
        out = fixed(v)
        assert all(torch.equal(fixed(v[i : i + 3]), out[i : i + 3]) for i in range(0, 990, 37))
        assert torch.allclose(out, ref(v), rtol=1e-6, atol=1e-7)


def test_deterministic_flag_takes_sglangs_name_and_refuses_what_it_cannot_keep():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--enable-deterministic-inference"]).deterministic_inference
    assert parser.parse_args(["--deterministic-inference"]).deterministic_inference
    for bad in (dict(compile=True), dict(kv_cache_dtype="fp8_e4m3"), dict(speculative_algorithm="dflash")):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineConfig(deterministic_inference=True, **bad)
