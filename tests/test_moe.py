"""Routed experts: the grouped GEMM (CPU inference) and the per-expert loop (autograd) compute the same mixture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kestrel.models.layers.moe import expert_pairs, expert_segments


@pytest.mark.parametrize("act", ["silu", "situ"])
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_gemm_equals_per_expert_loop_and_the_formula(act, tokens):
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, k = 6, 16, 8, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])  # expert 5 unused
    weights = torch.rand(tokens, k, generator=gen)
    args = (x, ids, weights, gate_up, down, act, 4.0, 8.0)
    with torch.no_grad():
        grouped = expert_segments(*args)
    with torch.enable_grad():
        looped = expert_segments(*args)
    assert torch.allclose(grouped, looped, atol=1e-5)
    for t in range(tokens):  # the formula, pair by pair
        expected = torch.zeros(hidden)
        for j in range(k):
            g, u = (gate_up[ids[t, j]] @ x[t]).chunk(2)
            if act == "situ":
                h = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (8.0 * torch.tanh(u / 8.0))
            else:
                h = F.silu(g) * u
            expected += weights[t, j] * (down[ids[t, j]] @ h)
        assert torch.allclose(grouped[t], expected, atol=1e-4)


@pytest.mark.parametrize("act", ["silu", "situ"])
def test_one_token_per_expert_path_is_bit_identical_to_the_grouped_gemm(act):
    """Batch-1 decode runs one expert at a time; it must not change a single bit of the grouped result."""
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, k = 12, 384, 128, 4
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.05
    for trial in range(20):
        x = torch.randn(1, hidden, generator=gen)
        ids = torch.randperm(experts, generator=gen)[:k][None]  # unsorted: the pairs must be summed by expert id
        weights = torch.rand(1, k, generator=gen)
        args = (x, ids, weights, gate_up, down, act, 4.0, 8.0)
        with torch.no_grad():
            assert torch.equal(expert_pairs(*args), expert_segments(*args)), trial


def test_experts_module_reuses_its_views_until_the_weights_change(monkeypatch):
    """The batch-1 path reads cached per-expert views; a reload (new storage) or an in-place update is seen. (The
    PyTorch path: with the CPU kernels on, fp32 batch-1 rows take `expert_pairs_kernel`, tests/test_cpu_kernels.py.)"""
    from types import SimpleNamespace

    from kestrel.models.layers import cpu_kernels
    from kestrel.models.layers.moe import Experts

    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")

    cfg = SimpleNamespace(num_experts=4, moe_intermediate_size=8, hidden_act="silu", situ_beta=None)
    cfg.situ_linear_beta = None
    experts = Experts(cfg, 16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen))
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen))
    x, ids, w = torch.randn(1, 16, generator=gen), torch.tensor([[2, 0]]), torch.rand(1, 2, generator=gen)

    def reference():
        return expert_segments(x, ids, w, experts.gate_up_proj, experts.down_proj, "silu", 0.0, 0.0)

    with torch.inference_mode():
        assert torch.equal(experts(x, ids, w), reference())
        experts.down_proj.mul_(2.0)  # in place: the same storage, a new version
        assert torch.equal(experts(x, ids, w), reference())
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach() * 3.0)  # replaced (another storage)
    with torch.inference_mode():
        assert torch.equal(experts(x, ids, w), reference())
