"""Kestrel's model code against the transformers oracle, on tiny random checkpoints written by transformers."""

from __future__ import annotations

import pytest
import torch

from kestrel.models.loader import load_model
from kestrel.models.simple_cache import full_logits, greedy_generate

pytest.importorskip("transformers")

PROMPT_LEN = 48
FIXTURES = ["hf_kimi_linear", "hf_deepseek_v32", "hf_deepseek_v3", "hf_deepseek_v3_no_q_lora", "hf_kimi_k2"]


def _prompt(seed: int, vocab: int = 320) -> torch.Tensor:
    return torch.randint(3, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(hf, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(prompt[None], max_new_tokens=n, do_sample=False, min_new_tokens=n, use_cache=True)
    return out[0, prompt.shape[0] :].tolist()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_full_sequence_logits_match_transformers(fixture, request):
    hf, path = request.getfixturevalue(fixture)
    model, _ = load_model(path)
    prompt = _prompt(0)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    assert torch.allclose(full_logits(model, prompt), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_tokens_match_transformers_generate(fixture, request):
    hf, path = request.getfixturevalue(fixture)
    model, _ = load_model(path)
    prompt = _prompt(1)
    ours, _ = greedy_generate(model, prompt.tolist(), 32)
    assert ours == _hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_decode_with_cache_matches_full_forward(fixture, request):
    _, path = request.getfixturevalue(fixture)
    model, _ = load_model(path)
    prompt = _prompt(2).tolist()
    tokens, step_logits = greedy_generate(model, prompt, 16)
    full = full_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert torch.allclose(step_logits, full, atol=1e-4, rtol=0)


def test_dsa_selections_match_transformers_indexer(hf_deepseek_v32):
    """Top-k sets per query equal the reference's; rows whose k-th/(k+1)-th margin is a near tie are skipped."""
    hf, path = hf_deepseek_v32
    model, cfg = load_model(path)
    prompt = _prompt(3)
    ref: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, args, out: ref.append(out[0].long()))
        for layer in hf.model.layers
    ]
    with torch.no_grad():
        hf(prompt[None])
    for h in hooks:
        h.remove()
    recorded: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.self_attn.record_index_scores = recorded
    full_logits(model, prompt)
    assert len(recorded) == len(ref) == cfg.num_hidden_layers
    k = cfg.index_topk
    compared = 0
    for (_, scores), ref_idx in zip(recorded, ref):
        for t in range(k, PROMPT_LEN):  # rows with more candidates than k: the sparse ones
            row = scores[t, : t + 1]
            top = row.topk(k + 1).values
            if (top[k - 1] - top[k]).abs() < 1e-4:
                continue
            ours = set(row.topk(k).indices.tolist())
            assert ours == set(ref_idx[t].tolist()), f"query {t}"
            compared += 1
    assert compared > cfg.num_hidden_layers * (PROMPT_LEN - k) // 2
