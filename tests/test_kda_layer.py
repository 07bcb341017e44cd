"""KDA layer prefill forms: the short-segment form (verify blocks, short prompts joining a decode step) computes what
the packed varlen form computes, for every sequence, its states and its prefix-cache snapshots."""

from __future__ import annotations

import json

import pytest
import torch

from kestrel.config import model_config_from_dict
from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.models.forward_batch import ForwardBatch, SequenceStates
from kestrel.models.layers import cpu_kernels
from kestrel.models.layers.kda import CHUNK_SIZE, KDAAttention


class _States:
    """The slice of ModelCache a KDA layer touches in a prefill: states in, states and snapshots out."""

    def __init__(self, conv: torch.Tensor, rec: torch.Tensor) -> None:
        self.conv, self.rec, self.snapshots = conv, rec, {}

    def store_state_snapshots(self, layer, seqs, indices, conv_states, recurrent_states) -> None:
        for seq, index, c, r in zip(seqs, indices, conv_states, recurrent_states):
            self.snapshots[(seq, index)] = (c.clone(), r.clone())


def _layer() -> KDAAttention:
    cfg = model_config_from_dict(json.loads((EMBEDDED_DIR / "config.json").read_text()))
    torch.manual_seed(0)
    layer = KDAAttention(cfg, cfg.kda_layers[0])
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer


def _prefill_case(layer: KDAAttention, lens: list[int], snapshots, seed: int):
    """Random layer inputs of prefill sequences with these lengths, their committed states, and their batch."""
    gen = torch.Generator().manual_seed(seed)
    rows, b = sum(lens), len(lens)
    x = torch.randn(rows, layer.in_proj.in_features, generator=gen)
    conv0 = torch.randn(b, layer.conv_dim, layer.kernel - 1, generator=gen)
    rec0 = torch.randn(b, layer.n_heads, layer.head_dim, layer.head_dim, generator=gen) * 0.1
    batch = ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.long),
        positions=torch.arange(rows),
        extend_lens=lens,
        prefix_lens=[5] * b,
        state_snapshots=snapshots,
    )
    return x, conv0, rec0, batch


@pytest.mark.parametrize(
    "lens, snapshots",
    [
        ([7], [[1, 2, 3, 4, 5, 6]]),  # a verify block with per-position snapshots
        ([7, 7, 7], None),  # verify blocks of three requests
        ([3, 16, 1, 5], [[2], [4, 8, 16], [], [5]]),  # ragged short prompts, checkpoints at page offsets
        ([20, 32, 9], [[16], [16, 32], []]),  # the longest prompts that still take the loop
    ],
)
@pytest.mark.parametrize("kernels", ["0", "1"], ids=["torch", "compiled"])
def test_short_segments_equal_the_packed_form(lens, snapshots, kernels, monkeypatch):
    """Bit for bit with the PyTorch ops; with the compiled kernels the packed form's conv and norms are one C++ pass
    (its own rounding), the conv states exact copies either way."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, kernels)
    layer = _layer()
    x, conv0, rec0, batch = _prefill_case(layer, lens, snapshots, seed=len(lens))
    with torch.inference_mode():
        mixed, g, beta, _ = layer.project(x)
        short, packed = _States(conv0, rec0), _States(conv0, rec0)
        o_s, conv_s, rec_s = layer.short_segments(mixed, g, beta, lens, conv0, rec0, snapshots, short)
        layout = batch.packed_prefill(CHUNK_SIZE, layer.kernel - 1)
        o_p, conv_p, rec_p = layer.prefill_packed(mixed, g, beta, layout, conv0, rec0, packed)
    same = torch.equal if kernels == "0" else lambda a, b: torch.allclose(a, b, atol=2e-5, rtol=1e-4)
    assert same(o_s, o_p)
    assert torch.equal(conv_s, conv_p)
    assert same(rec_s, rec_p)
    assert short.snapshots.keys() == packed.snapshots.keys()
    assert len(short.snapshots) == sum(len(s or ()) for s in snapshots or ())
    for key, (c, r) in packed.snapshots.items():
        assert torch.equal(short.snapshots[key][0], c)
        assert same(short.snapshots[key][1], r)


def test_replay_from_committed_states_equals_the_prefix_alone():
    """ReplaySSM: replaying n accepted tokens of each block gives the states after exactly those n tokens."""
    layer = _layer()
    gen = torch.Generator().manual_seed(7)
    lens, accepted = [7, 7], [3, 7]
    x = torch.randn(sum(lens), layer.in_proj.in_features, generator=gen)
    conv0 = torch.randn(2, layer.conv_dim, layer.kernel - 1, generator=gen)
    rec0 = torch.randn(2, layer.n_heads, layer.head_dim, layer.head_dim, generator=gen) * 0.1
    with torch.inference_mode():
        mixed, g, beta, _ = layer.project(x)
        rows = torch.tensor([0, 1, 2, 7, 8, 9, 10, 11, 12, 13])
        conv_r, rec_r = layer.replay(mixed, g, beta, rows, accepted, conv0, rec0)
        for i, (start, n) in enumerate([(0, 3), (7, 7)]):
            sl = slice(start, start + n)
            _, conv_n, rec_n = layer.short_segments(mixed[sl], g[sl], beta[sl], [n], conv0[i : i + 1], rec0[i : i + 1])
            assert torch.equal(conv_r[i], conv_n[0])
            assert torch.equal(rec_r[i], rec_n[0])


@pytest.mark.parametrize(
    "n, snapshots",
    [
        (7, [1, 2, 3, 4, 5, 6]),  # a verify block with per-position snapshots
        (5, [2, 2, 5]),  # a repeated offset and a snapshot after the last token (prefix-cache checkpoints)
        (4, None),  # ReplaySSM's verify block, or a short prompt without checkpoints
    ],
)
@pytest.mark.parametrize("kernels", ["0", "1"], ids=["torch", "compiled"])
def test_segment_in_place_writes_what_short_segments_returns(n, snapshots, kernels, monkeypatch):
    """One sequence's segment read from and written to its pool slots (the concurrency-1 verify path) leaves the
    slots bit for bit where the gather/stack/scatter form puts them; the slot it reads is also where it stores."""
    layer = _layer()
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, layer.in_proj.in_features, generator=gen)
    slots = 2 + len(snapshots or ())
    conv_pool = torch.randn(slots, layer.conv_dim, layer.kernel - 1, generator=gen)
    rec_pool = torch.randn(slots, layer.n_heads, layer.head_dim, layer.head_dim, generator=gen) * 0.1
    conv0, rec0 = conv_pool[:1].clone(), rec_pool[:1].clone()
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, kernels)
    states = SequenceStates(conv_pool, rec_pool, 0, 0, list(range(2, slots)))
    with torch.inference_mode():
        mixed, g, beta, _ = layer.project(x)
        want = _States(conv0, rec0)
        o_s, conv_s, rec_s = layer.short_segments(
            mixed, g, beta, [n], conv0, rec0, [snapshots] if snapshots else None, want
        )
        o = layer.segment_in_place(mixed, g, beta, states, snapshots)
    # The PyTorch form is the same ops bit for bit; the compiled segment (conv, SiLU, norms and the delta rule in one
    # loop) rounds its own way. The conv states are copies of the inputs either way.
    same = torch.equal if kernels == "0" else lambda a, b: torch.allclose(a, b, atol=2e-5, rtol=1e-4)
    assert same(o, o_s)
    assert torch.equal(conv_pool[0], conv_s[0]) and same(rec_pool[0], rec_s[0])
    for index in range(len(snapshots or ())):
        c, r = want.snapshots[(0, index)]
        assert torch.equal(conv_pool[2 + index], c) and same(rec_pool[2 + index], r)
