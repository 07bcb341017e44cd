"""Kestrel's compiled CPU kernels (KDA's token loop, small-batch routed experts, MLA decode over the KV pool) against
the PyTorch ops they replace, and their use by the engine."""

from __future__ import annotations

import sys

import pytest
import torch
from test_kda_layer import _layer, _prefill_case, _States
from test_kda_ops import make_inputs, max_diff, prepped

from kestrel import LLM, SamplingParams
from kestrel.models.forward_batch import SequenceStates
from kestrel.models.layers import batch_invariant, cpu_kernels, kda_kernel, moe
from kestrel.models.layers.kda import CHUNK_SIZE
from kestrel.models.layers.kda_ops import kda_step, kda_steps
from kestrel.models.layers.moe import expert_pairs_kernel, expert_segments, situ

ATOL = 1e-5


@pytest.fixture
def torch_ops(monkeypatch):
    """Run the block with the kernel switched off (the PyTorch ops)."""

    class Switch:
        def __enter__(self):
            monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")

        def __exit__(self, *exc):
            monkeypatch.delenv(cpu_kernels.ENV_SWITCH)

    return Switch()


def test_the_kernel_builds_on_this_machine() -> None:
    assert cpu_kernels.module() is not None


def test_each_python_environment_builds_its_own_kernels(monkeypatch) -> None:
    """Two checkouts' venvs must not share a build folder: torch rebuilds when the include paths differ, so each
    would rebuild the other's kernels at its next engine start."""
    here = cpu_kernels.build_name()
    assert here.isidentifier() and here == cpu_kernels.build_name()
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-another-checkout")
    assert cpu_kernels.build_name() != here


@pytest.mark.parametrize("T", [1, 7, 9])
@torch.no_grad()
def test_steps_match_the_torch_ops_with_kept_and_written_states(T: int, torch_ops) -> None:
    x = make_inputs(B=3, T=T, H=2, K=16, V=24, seed=T)
    q, k, v, g, beta = prepped(x)
    keep = sorted({0, T // 2, T - 1})
    slot = torch.empty_like(x["state"])  # a pool slot receiving the state after the first token
    with torch_ops:
        assert not kda_kernel.applies(q, x["state"])
        o_ref, s_ref, kept_ref = kda_steps(q, k, v, g, beta, x["state"], keep_after=keep)
    assert kda_kernel.applies(q, x["state"])
    o, s, kept = kda_steps(q, k, v, g, beta, x["state"], keep_after=keep, out={0: slot})
    assert max_diff(o, o_ref) < ATOL and max_diff(s, s_ref) < ATOL
    assert len(kept) == len(keep) and all(max_diff(a, b) < ATOL for a, b in zip(kept, kept_ref))
    assert torch.equal(slot, kept[0]) and kept[0].data_ptr() == slot.data_ptr()


@torch.no_grad()
def test_the_last_tokens_state_goes_into_its_out_tensor_even_when_that_is_the_input_state(torch_ops) -> None:
    x = make_inputs(B=1, T=7, H=4, K=16, V=16, seed=5)
    q, k, v, g, beta = prepped(x)
    with torch_ops:
        o_ref, s_ref, _ = kda_steps(q, k, v, g, beta, x["state"].clone())
    state = x["state"].clone()  # read slot == store slot (a request's own slot)
    o, s, _ = kda_steps(q, k, v, g, beta, state, out={6: state})
    assert s.data_ptr() == state.data_ptr()
    assert max_diff(o, o_ref) < ATOL and max_diff(state, s_ref) < ATOL


@pytest.mark.parametrize("in_place", [False, True])
@torch.no_grad()
def test_decode_step_matches_the_torch_ops_and_a_one_token_block(in_place: bool, torch_ops) -> None:
    x = make_inputs(B=4, T=1, H=2, K=16, V=16, seed=7)
    q, k, v, g, beta = (t[:, 0] for t in prepped(x))
    with torch_ops:
        o_ref, s_ref = kda_step(q, k, v, g, beta, x["state"].clone())
    state = x["state"].clone()
    o, s = kda_step(q, k, v, g, beta, state, in_place)
    assert max_diff(o, o_ref) < ATOL and max_diff(s, s_ref) < ATOL
    assert (s.data_ptr() == state.data_ptr()) == in_place
    o1, s1, _ = kda_steps(*(t[:, None] for t in (q, k, v, g, beta)), x["state"])
    assert torch.equal(o1[:, 0], o) and torch.equal(s1, s)  # decode and verify take the same arithmetic


@pytest.mark.parametrize(
    "lens, snapshots",
    [
        ([100, 7, 70], [[64], [], [16, 64]]),  # long prompts (the chunked form without the kernel) + checkpoints
        ([3, 40], [[3], [32, 40]]),  # snapshots at a sequence's last token: a repeated segment end
    ],
)
def test_packed_prefill_through_the_kernel_matches_the_torch_forms(lens, snapshots, torch_ops) -> None:
    layer = _layer()
    x, conv0, rec0, batch = _prefill_case(layer, lens, snapshots, seed=sum(lens))
    layout = batch.packed_prefill(CHUNK_SIZE, layer.kernel - 1)
    with torch.inference_mode():
        mixed, g, beta, _ = layer.project(x)
        with torch_ops:
            want_cache = _States(conv0, rec0)
            want = layer.prefill_packed(mixed, g, beta, layout, conv0, rec0, want_cache)
        got_cache = _States(conv0, rec0)
        got = layer.prefill_packed(mixed, g, beta, layout, conv0, rec0, got_cache)
    for a, w in zip(got, want):  # the chunked form sums in another order over 100 tokens: fp32 tolerance
        torch.testing.assert_close(a, w, atol=1e-4, rtol=1e-4)
    assert got_cache.snapshots.keys() == want_cache.snapshots.keys() and len(got_cache.snapshots) == sum(
        map(len, snapshots)
    )
    for key, (c, r) in want_cache.snapshots.items():
        assert torch.equal(got_cache.snapshots[key][0], c)
        torch.testing.assert_close(got_cache.snapshots[key][1], r, atol=1e-4, rtol=1e-4)


def test_compiled_decode_step_is_a_one_token_segment_and_close_to_the_torch_ops(torch_ops) -> None:
    """The in-place decode kernel leaves the same bits as the one-sequence segment kernel at T = 1 (a decode step
    and a one-token verify block agree), and the PyTorch decode step's values to fp32 rounding."""
    layer = _layer()
    gen = torch.Generator().manual_seed(5)
    b = 3
    x = torch.randn(b, layer.in_proj.in_features, generator=gen)
    conv0 = torch.randn(b, layer.conv_dim, layer.kernel - 1, generator=gen)
    rec0 = torch.randn(b, layer.n_heads, layer.head_dim, layer.head_dim, generator=gen) * 0.1
    with torch.inference_mode():
        mixed, g, beta, _ = layer.project(x)
        conv, rec = conv0.clone(), rec0.clone()
        o = layer.decode_in_place(mixed, g, beta, conv, rec)
        for i in range(b):  # each row as a lone one-token segment from its own slot
            cpool, rpool = conv0[i : i + 1].clone(), rec0[i : i + 1].clone()
            o_i = layer.segment_in_place(
                mixed[i : i + 1], g[i : i + 1], beta[i : i + 1], _pool_states(cpool, rpool), []
            )
            assert torch.equal(o_i[0], o[i]) and torch.equal(cpool[0], conv[i]) and torch.equal(rpool[0], rec[i])
        with torch_ops:
            conv_t, rec_t = conv0.clone(), rec0.clone()
            o_t = layer.decode_in_place(mixed, g, beta, conv_t, rec_t)
    assert torch.equal(conv, conv_t)  # the window is a copy of inputs either way
    torch.testing.assert_close(o, o_t, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(rec, rec_t, atol=1e-5, rtol=1e-4)


def _pool_states(conv_pool: torch.Tensor, rec_pool: torch.Tensor) -> SequenceStates:
    return SequenceStates(conv_pool, rec_pool, 0, 0, [])


@torch.no_grad()
def test_a_large_call_split_over_threads_gives_the_same_bits() -> None:
    """Work above the kernel's threshold runs on torch's thread count; each (sequence, head) is still one loop."""
    x = make_inputs(B=8, T=64, H=4, K=32, V=32, seed=11)
    q, k, v, g, beta = prepped(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, s1, _ = kda_steps(q, k, v, g, beta, x["state"])
        torch.set_num_threads(2)
        o2, s2, _ = kda_steps(q, k, v, g, beta, x["state"])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_autograd_batch_invariance_and_other_layouts_keep_the_torch_ops() -> None:
    x = make_inputs(B=2, T=3, H=2, K=8, V=8)
    q, state = x["q"], x["state"]
    assert not kda_kernel.applies(q, state)  # grad mode on
    with torch.no_grad():
        assert kda_kernel.applies(q, state)
        assert not kda_kernel.applies(q, state.transpose(-1, -2))  # not contiguous
        assert not kda_kernel.applies(q, state.double())
        with batch_invariant.mode():
            assert not kda_kernel.applies(q, state)


class _Situ:
    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return situ(gate, up, 4.0, 8.0)


@pytest.mark.parametrize("tokens, hidden", [(1, 40), (3, 40), (8, 40), (5, 64), (32, 64)])
@torch.no_grad()
def test_expert_pairs_kernel_matches_the_grouped_gemms(tokens: int, hidden: int) -> None:
    """40 wide: the scalar tail after the 16-lane chunks; 64: whole chunks. 32 tokens: several row tiles per expert
    and the weight rows split across threads (a parallel region)."""
    gen = torch.Generator().manual_seed(tokens)
    experts, inter, top_k = 8, 24, 2
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    want = expert_segments(x, ids, weights, gate_up, down, "situ", 4.0, 8.0)
    got = expert_pairs_kernel(x, ids, weights, gate_up, down, _Situ())
    assert max_diff(got, want) < ATOL
    # a token's terms do not depend on the other tokens of its batch
    alone = expert_pairs_kernel(x[-1:], ids[-1:], weights[-1:], gate_up, down, _Situ())
    assert torch.equal(alone, got[-1:])


class _PoolCache:
    """A decode batch's histories as rows of one KV pool in scattered slots, as the paged cache holds them."""

    def __init__(self, lengths: list[int], rank: int, rope: int, gen: torch.Generator) -> None:
        slots_total = sum(lengths) + 17
        self.latent = torch.randn(slots_total, rank, generator=gen)
        self.rope_key = torch.randn(slots_total, rope, generator=gen)
        perm = torch.randperm(slots_total, generator=gen)
        width = max(lengths) + 3  # a page table wider than the longest history
        self.slots = torch.zeros(len(lengths), width, dtype=torch.long)
        at = 0
        for i, n in enumerate(lengths):
            self.slots[i, :n] = perm[at : at + n]
            at += n
        self.lengths = torch.tensor(lengths)
        self.width = max(lengths)

    def decode_lengths(self):
        return self.lengths

    def decode_pool(self, layer):
        return self.latent, self.rope_key, self.slots[:, : self.width]

    def decode_kv(self, layer):
        idx = self.slots[:, : self.width]
        return self.latent[idx], self.rope_key[idx]


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v32"])
@torch.no_grad()
def test_mla_decode_in_the_pool_matches_the_padded_form(tiny_checkpoints, torch_ops, family: str) -> None:
    """The kernel reads every row's history from the pool by slot; the PyTorch form gathers padded histories. The
    same attention to fp32 rounding, and a row's kernel result does not depend on the other rows of its batch."""
    from kestrel.models.loader import load_model

    model, cfg = load_model(str(tiny_checkpoints[family]), dtype=torch.float32)
    attn = model.model.layers[cfg.attention_layers[0]].self_attn
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 9, 33, 70]
    cache = _PoolCache(lengths, attn.rank, attn.rope_dim, gen)
    q_nope = torch.randn(len(lengths), attn.n_heads, attn.nope, generator=gen)
    q_rope = torch.randn(len(lengths), attn.n_heads, attn.rope_dim, generator=gen)
    got = attn._attend_in_pool(q_nope, q_rope, cache, cache.lengths)
    assert got is not None
    with torch_ops:
        assert attn._attend_in_pool(q_nope, q_rope, cache, cache.lengths) is None
        allowed = torch.arange(cache.width)[None, :] < cache.lengths[:, None]
        want = attn._attend_latent_padded(q_nope, q_rope, *cache.decode_kv(0), allowed)
    assert got.shape == want.shape and max_diff(got, want) < ATOL
    # the kernel's rows: one row alone gives the same bits as in its batch
    kernel = cpu_kernels.module().mla_decode_fp32
    q_latent = torch.randn(len(lengths), attn.n_heads, attn.rank, generator=gen)
    slots = cache.slots[:, : cache.width]
    batch = kernel(q_latent, q_rope, cache.latent, cache.rope_key, slots, cache.lengths, attn.scale)
    row = kernel(q_latent[2:3], q_rope[2:3], cache.latent, cache.rope_key, slots[2:3], cache.lengths[2:3], attn.scale)
    assert torch.equal(row, batch[2:3])


def test_engine_uses_the_kernels_and_gives_the_torch_ops_tokens(tiny_checkpoints, monkeypatch) -> None:
    calls = []
    real_steps, real_decode, real_experts = kda_kernel.steps, kda_kernel.decode, moe.expert_pairs_kernel
    monkeypatch.setattr(kda_kernel, "steps", lambda *a: calls.append(("kda", a[0].shape)) or real_steps(*a))
    monkeypatch.setattr(kda_kernel, "decode", lambda *a: calls.append(("kda_decode", a[0].shape)) or real_decode(*a))
    monkeypatch.setattr(moe, "expert_pairs_kernel", lambda *a: calls.append(("moe", a[0].shape)) or real_experts(*a))
    prompts = [[5, 9, 11, 3] * 9, [7, 8] * 30]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=1024)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ("kda_decode", (2, llm.engine.model.model.layers[0].self_attn.conv_dim)) in calls  # both decode rows
    assert any(kind == "moe" and shape[0] == 2 for kind, shape in calls)  # the two requests' decode rows
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    calls.clear()
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls and got == want


def test_engine_decodes_dense_mla_in_the_pool_with_the_torch_ops_tokens(tiny_checkpoints, monkeypatch) -> None:
    """kimi_linear's MLA layers (no indexer) decode through the pool kernel; the tokens equal the PyTorch form's."""
    from kestrel.models.layers import mla

    calls = []
    real = mla.MLAAttention._attend_in_pool

    def spy(self, q_nope, *args):
        out = real(self, q_nope, *args)
        calls.append((q_nope.shape[0], out is not None))
        return out

    monkeypatch.setattr(mla.MLAAttention, "_attend_in_pool", spy)
    prompts = [[5, 9, 11, 3] * 9, [7, 8] * 30, [4] * 3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_checkpoints["kimi_linear"]), max_total_tokens=1024)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert (3, True) in calls  # all three requests' decode rows, through the kernel
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    calls.clear()
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls and not any(used for _, used in calls) and got == want
