"""The eager fast paths' helpers: each one must be invisible in the numbers (bit for bit) and in autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kestrel.models.layers.constants import fp32_scalar
from kestrel.models.layers.derived import derived, weights_changed
from kestrel.models.layers.hookless import HooklessModule
from kestrel.models.layers.norm import RMSNorm, rms_norm_fp32


@pytest.mark.parametrize("rows,dim", [(1, 384), (3, 64), (32, 1024), (7, 100), (1, 8)])
def test_rms_norm_fp32_is_torch_rms_norm_bit_for_bit(rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    for scale in (1e-3, 1.0, 1e3):
        x, w = torch.randn(rows, dim, generator=gen) * scale, torch.randn(dim, generator=gen)
        with torch.no_grad():
            assert torch.equal(rms_norm_fp32(x, w, 1e-6), torch.rms_norm(x, (dim,), w, 1e-6))
            assert torch.equal(rms_norm_fp32(x, None, 1e-6), torch.rms_norm(x, (dim,), None, 1e-6))


def test_rms_norm_keeps_autograd():
    norm = RMSNorm(16)
    x = torch.randn(2, 16, requires_grad=True)
    norm(x).sum().backward()  # the in-place fast path would break this: grad mode takes torch.rms_norm
    assert x.grad is not None and norm.weight.grad is not None


def test_fp32_scalar_made_in_inference_mode_serves_autograd_later():
    with torch.inference_mode():
        value = fp32_scalar(0.123456)
    assert not value.is_inference() and value.dtype == torch.float32
    x = torch.randn(4, requires_grad=True)
    (x * fp32_scalar(0.123456)).sum().backward()
    assert torch.equal(x * fp32_scalar(0.123456), x * 0.123456)


def test_derived_follows_the_source_and_stays_out_of_autograd():
    owner, calls = nn.Module(), []
    owner.p = nn.Parameter(torch.ones(3))

    def make(t):
        calls.append(1)
        return t * 2

    with torch.no_grad():
        first = derived(owner, "double", owner.p, make)
        assert derived(owner, "double", owner.p, make) is first and len(calls) == 1
        owner.p.add_(1.0)  # new version
        assert torch.equal(derived(owner, "double", owner.p, make), torch.full((3,), 4.0)) and len(calls) == 2
    out = derived(owner, "double", owner.p, make)  # grad mode: fresh, differentiable
    assert out.requires_grad and len(calls) == 3
    with torch.no_grad():
        owner.p.data.copy_(torch.zeros(3))  # how checkpoint loaders write: `.data` keeps no version of the parameter
        weights_changed()  # ...so load_weights says so
        assert torch.equal(derived(owner, "double", owner.p, make), torch.zeros(3)) and len(calls) == 4


def test_hookless_module_calls_forward_and_refuses_hooks():
    class Double(HooklessModule):
        def forward(self, x):
            return 2 * x

    m = Double()
    assert torch.equal(m(torch.ones(2)), torch.full((2,), 2.0))
    with pytest.raises(TypeError, match="HooklessModule"):
        m.register_forward_hook(lambda *a: None)
