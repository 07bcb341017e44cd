"""Correctness of the KDA kernels: chunked vs recurrent vs transformers' torch reference, state carry-over, autograd."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    l2norm,
    recurrent_kimi_delta_attention,
)

from kestrel.models.layers.kda_ops import (
    kda_chunked,
    kda_chunked_packed,
    kda_recurrent,
    kda_step,
    kda_steps,
    l2_normalize,
)

ATOL = 1e-5


def make_inputs(
    B: int = 2, T: int = 203, H: int = 2, K: int = 16, V: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Raw (un-normalised) q/k plus Kimi-style gates: g = -exp(A_log) * softplus(x), beta = sigmoid(x)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)
    A_log = rand(H, 1) * 0.5 - 1.5  # per-head decay rate, exp(A_log) ~ 0.2
    return {
        "q": rand(B, T, H, K),
        "k": rand(B, T, H, K),
        "v": rand(B, T, H, V),
        "g": -A_log.exp() * F.softplus(rand(B, T, H, K)),
        "beta": torch.sigmoid(rand(B, T, H)),
        "state": rand(B, H, K, V) * 0.5,
    }


def prepped(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """What kestrel's kernels expect: q, k already L2-normalised, q scaled by K**-0.5."""
    K = x["q"].shape[-1]
    return l2_normalize(x["q"]) * K**-0.5, l2_normalize(x["k"]), x["v"], x["g"], x["beta"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def test_l2_normalize_matches_transformers() -> None:
    x = torch.randn(3, 5, 16)
    assert torch.equal(l2_normalize(x), l2norm(x, dim=-1, eps=1e-6))


def test_decode_step_matches_recurrent_token_by_token() -> None:
    """kda_step (one read of the state per token, the decode form) walks the same states as the recurrent loop."""
    x = make_inputs(T=40)
    q, k, v, g, beta = prepped(x)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=x["state"])
    state, outs = x["state"], []
    for t in range(q.shape[1]):
        o, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o)
    assert max_diff(torch.stack(outs, dim=1), o_ref) < ATOL
    assert max_diff(state, s_ref) < ATOL


@pytest.mark.parametrize("chunk_size", [16, 48, 64])  # 48: not a power of two (odd-part leaves of size 3)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrent(chunk_size: int, with_state: bool) -> None:
    x = make_inputs()
    s0 = x["state"] if with_state else None
    o_ref, s_ref = kda_recurrent(*prepped(x), initial_state=s0)
    o, s = kda_chunked(*prepped(x), initial_state=s0, chunk_size=chunk_size)
    assert o.dtype == s.dtype == torch.float32
    assert o.shape == x["v"].shape and s.shape == x["state"].shape
    assert max_diff(o, o_ref) < ATOL
    assert max_diff(s, s_ref) < ATOL
    if with_state:  # the initial state must actually matter for this to test anything
        o_zero, _ = kda_recurrent(*prepped(x))
        assert max_diff(o_zero, o_ref) > 1e-2


@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers(with_state: bool) -> None:
    x = make_inputs(T=150)
    s0 = x["state"] if with_state else None
    raw = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o_tc, s_tc = chunk_kimi_delta_attention(
        *raw, chunk_size=64, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_tr, s_tr = recurrent_kimi_delta_attention(
        *raw, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_c, s_c = kda_chunked(*prepped(x), initial_state=s0, chunk_size=64)
    o_r, s_r = kda_recurrent(*prepped(x), initial_state=s0)
    for o, s in ((o_c, s_c), (o_r, s_r)):
        for o_ref, s_ref in ((o_tc, s_tc), (o_tr, s_tr)):
            assert max_diff(o, o_ref) < ATOL
            assert max_diff(s, s_ref) < ATOL


@pytest.mark.parametrize("T", [0, 1, 5])
def test_short_sequences(T: int) -> None:
    """Decode-sized and empty inputs: the chunked path pads to one chunk (or returns the state unchanged)."""
    x = make_inputs(T=T)
    o_ref, s_ref = kda_recurrent(*prepped(x), initial_state=x["state"])
    o, s = kda_chunked(*prepped(x), initial_state=x["state"])
    assert o.shape == o_ref.shape == x["v"].shape
    assert max_diff(s, s_ref) < ATOL
    if T:
        assert max_diff(o, o_ref) < ATOL


def test_strong_decay_is_finite() -> None:
    """Decays of up to ~e^-200 per chunk must not overflow (no exp(-G) factorisation) and still match."""
    x = make_inputs(B=1, T=130, H=1)
    x["g"] = x["g"] * 20.0
    o_ref, s_ref = kda_recurrent(*prepped(x), initial_state=x["state"])
    o, s = kda_chunked(*prepped(x), initial_state=x["state"], chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert max_diff(o, o_ref) < ATOL
    assert max_diff(s, s_ref) < ATOL


@pytest.mark.parametrize("fn", [kda_chunked, kda_recurrent])
def test_split_sequence_carries_state(fn) -> None:
    x = make_inputs(T=203)
    q, k, v, g, beta = prepped(x)
    o_full, s_full = fn(q, k, v, g, beta, initial_state=x["state"])
    cut = 77  # not a chunk multiple on purpose
    o1, s1 = fn(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=x["state"])
    o2, s2 = fn(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=s1)
    assert max_diff(torch.cat([o1, o2], dim=1), o_full) < ATOL
    assert max_diff(s2, s_full) < ATOL


def test_steps_match_recurrent_and_keep_intermediate_states() -> None:
    """The multi-token decode form (short prefills, verify blocks) walks the recurrent loop's states."""
    x = make_inputs(T=9)
    q, k, v, g, beta = prepped(x)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=x["state"])
    o, s, kept = kda_steps(q, k, v, g, beta, x["state"], keep_after=[2, 8])
    assert max_diff(o, o_ref) < ATOL and max_diff(s, s_ref) < ATOL
    _, s3 = kda_recurrent(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], initial_state=x["state"])
    assert max_diff(kept[0], s3) < ATOL and max_diff(kept[1], s_ref) < ATOL


def test_packed_varlen_matches_each_sequence_alone() -> None:
    """Sequences packed end to end (each on its own chunk boundary, segments cut mid-sequence, an empty trailing
    segment) give every sequence's outputs and segment-end states as if it ran alone from its own state."""
    C = 16
    seqs = [make_inputs(B=1, T=T, seed=s) for s, T in enumerate([37, 5, 64, 20])]
    cuts = [[0, 9, 37], [0, 5, 5], [0, 64], [0, 16, 20]]  # segment bounds per sequence ([0, 5, 5]: empty segment)
    rows, chunk_at, first, ends, want_o, want_s = [], 0, [], [], [], []
    for x, bounds in zip(seqs, cuts):
        first.append(chunk_at // C)
        q, k, v, g, beta = prepped(x)
        state = x["state"]
        for a, b in zip(bounds, bounds[1:]):
            o, state = kda_recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=state)
            want_o.append(o[0])
            want_s.append(state[0])
            rows.extend(range(chunk_at, chunk_at + b - a))
            chunk_at += -(-(b - a) // C) * C
            ends.append(chunk_at // C - 1)

    def packed(name: str) -> torch.Tensor:
        flat = torch.cat([dict(zip("qkvgb", prepped(x)))[name][0] for x in seqs])
        return flat.new_zeros(chunk_at, *flat.shape[1:]).index_copy(0, torch.tensor(rows), flat)

    inits = torch.cat([x["state"] for x in seqs])
    o, states = kda_chunked_packed(*(packed(n) for n in "qkvgb"), inits, first, ends, chunk_size=C)
    assert max_diff(o[torch.tensor(rows)], torch.cat(want_o)) < ATOL
    assert max_diff(states, torch.stack(want_s)) < ATOL


def test_low_precision_inputs_compute_in_fp32() -> None:
    x = make_inputs(T=70, dtype=torch.bfloat16)
    o, s = kda_chunked(*prepped(x), initial_state=x["state"], chunk_size=16)
    o_ref, s_ref = kda_recurrent(*(t.float() for t in prepped(x)), initial_state=x["state"].float())
    assert o.dtype == s.dtype == torch.float32
    assert max_diff(o, o_ref) < ATOL
    assert max_diff(s, s_ref) < ATOL


def test_gradients_flow() -> None:
    x = make_inputs(B=1, T=70, H=2, K=8, V=8)
    leaves = [t.clone().requires_grad_(True) for t in prepped(x)]
    s0 = x["state"].clone().requires_grad_(True)
    o, s = kda_chunked(*leaves, initial_state=s0, chunk_size=16)
    (o.sum() + s.sum()).backward()
    for t in [*leaves, s0]:
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_gradcheck_packed_float64() -> None:
    """The packed varlen form under autograd (SFT trains through it): two sequences of 5 and 3 tokens in chunks of 2,
    a mid-sequence segment end, every input and both initial states checked against finite differences."""
    C, lens = 2, [5, 3]
    seqs = [make_inputs(B=1, T=T, H=1, K=3, V=3, dtype=torch.float64, seed=s) for s, T in enumerate(lens)]
    rows, at = [], 0
    for T in lens:
        rows += range(at, at + T)
        at += -(-T // C) * C
    index = torch.tensor(rows)
    flat = [torch.cat([prepped(x)[i][0] for x in seqs]).clone().requires_grad_(True) for i in range(5)]
    inits = torch.cat([x["state"] for x in seqs]).clone().requires_grad_(True)

    def f(q, k, v, g, beta, s0):
        packed = [t.new_zeros(at, *t.shape[1:]).index_copy(0, index, t) for t in (q, k, v, g, beta)]
        o, states = kda_chunked_packed(*packed, s0, [0, 3], [1, 2, 4], chunk_size=C)
        return o[index], states

    assert torch.autograd.gradcheck(f, (*flat, inits), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [2, 4, 6])
def test_gradcheck_float64(chunk_size: int) -> None:
    """fp64 in -> fp64 math, so finite differences are exact enough. T=5 with chunk 2/4 covers several chunks, padding
    and the recursive halving of the intra-chunk scores; chunk 6 covers the elementwise leaf (odd part 3) path."""
    x = make_inputs(B=1, T=5, H=1, K=3, V=3, dtype=torch.float64)
    inputs = tuple(t.clone().requires_grad_(True) for t in (*prepped(x), x["state"]))

    def f(q, k, v, g, beta, s0):
        return kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)
