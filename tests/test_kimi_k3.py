"""kimi_k3 (K3.1-shaped): make-model → loader round trip, cached decode, and each K3 part against its formula."""

from __future__ import annotations

import math

import torch

from kestrel.config import load_model_config
from kestrel.models.layers.attnres import attn_res_mix
from kestrel.models.layers.moe import MoE, situ
from kestrel.models.loader import load_model
from kestrel.models.simple_cache import full_logits, greedy_generate


def test_k31_checkpoint_has_every_part(tiny_checkpoints):
    cfg = load_model_config(tiny_checkpoints["kimi_k3"])
    assert {"kda", "dsa"} <= set(cfg.layer_kinds)
    assert cfg.attn_res_block_size and cfg.hidden_act == "situ" and cfg.mla_use_output_gate
    assert cfg.routed_expert_hidden_size and cfg.kda_full_rank_gate and cfg.index_topk > 0 and not cfg.use_rope
    model, _ = load_model(tiny_checkpoints["kimi_k3"])
    names = dict(model.named_parameters())
    assert "model.layers.3.self_attn.indexer.wq_b.weight" in names
    assert "model.layers.1.mlp.routed_expert_down_proj.weight" in names
    assert "model.output_attn_res_proj.weight" in names


def test_k3_decode_with_cache_matches_full_forward(tiny_checkpoints):
    model, cfg = load_model(tiny_checkpoints["kimi_k3"])
    prompt = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, step_logits = greedy_generate(model, prompt, 12)
    full = full_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert torch.allclose(step_logits, full, atol=1e-4, rtol=0)


def test_k3_sparse_attention_is_active_and_changes_output(tiny_checkpoints):
    """With a prompt longer than index_topk, restricting attention must matter (the indexer is not a no-op)."""
    model, cfg = load_model(tiny_checkpoints["kimi_k3"])
    prompt = torch.randint(3, cfg.vocab_size, (3 * cfg.index_topk,), generator=torch.Generator().manual_seed(1))
    sparse = full_logits(model, prompt)
    for layer in model.model.layers:
        if layer.kind == "dsa":
            layer.self_attn.indexer.topk = 10**9
    dense = full_logits(model, prompt)
    assert torch.allclose(sparse[: cfg.index_topk], dense[: cfg.index_topk], atol=1e-5)
    assert not torch.allclose(sparse[-4:], dense[-4:], atol=1e-4)


def test_situ_matches_formula():
    gate, up = torch.randn(50), torch.randn(50) * 10
    beta, lin = 4.0, 8.0
    expected = [
        beta * math.tanh(g / beta) * (1 / (1 + math.exp(-g))) * (lin * math.tanh(u / lin))
        for g, u in zip(gate.tolist(), up.tolist())
    ]
    assert torch.allclose(situ(gate, up, beta, lin), torch.tensor(expected), atol=1e-5)
    assert torch.allclose(
        situ(gate, up, beta, None), torch.tensor(expected) / (lin * torch.tanh(up / lin)) * up, atol=1e-4
    )


def test_attn_res_mix_matches_formula():
    torch.manual_seed(0)
    d, eps = 8, 1e-6
    bank = [torch.randn(3, d) for _ in range(2)]
    partial = torch.randn(3, d)
    proj, norm = torch.randn(1, d), torch.randn(d)
    out = attn_res_mix(partial, bank, proj, norm, eps)
    for t in range(3):
        cands = [c[t] for c in bank] + [partial[t]]
        logits = []
        for c in cands:
            unit = c / math.sqrt(float((c * c).mean()) + eps)
            logits.append(float((unit * norm * proj[0]).sum()))
        weights = torch.softmax(torch.tensor(logits), dim=0)
        expected = sum(w * c for w, c in zip(weights, cands))
        assert torch.allclose(out[t], expected, atol=1e-5)


def test_latent_moe_matches_formula(tiny_checkpoints):
    model, cfg = load_model(tiny_checkpoints["kimi_k3"])
    moe: MoE = next(layer.mlp for layer in model.model.layers if layer.is_moe)
    x = torch.randn(5, cfg.hidden_size)
    out, ids = moe(x)
    for t in range(5):
        scores = torch.sigmoid(moe.gate.weight @ x[t])
        chosen = (scores + moe.gate.e_score_correction_bias).topk(cfg.num_experts_per_tok).indices
        assert set(chosen.tolist()) == set(ids[t].tolist())
        w = scores[chosen] / scores[chosen].sum() * cfg.routed_scaling_factor
        z = moe.routed_expert_down_proj.weight @ x[t]
        acc = torch.zeros_like(z)
        for weight, e in zip(w, chosen):
            gate_up = moe.experts.gate_up_proj[e] @ z
            g, u = gate_up.chunk(2)
            acc += weight * (moe.experts.down_proj[e] @ situ(g, u, cfg.situ_beta, cfg.situ_linear_beta))
        normed = acc / torch.sqrt((acc * acc).mean() + cfg.rms_norm_eps) * moe.routed_expert_norm.weight
        routed = moe.routed_expert_up_proj.weight @ normed
        sh = moe.shared_experts
        gate_w, up_w = sh.gate_up_proj.weight.chunk(2)  # gate_proj and up_proj, fused in memory
        shared = sh.down_proj.weight @ situ(gate_w @ x[t], up_w @ x[t], cfg.situ_beta, cfg.situ_linear_beta)
        assert torch.allclose(out[t], routed + shared, atol=1e-5)
