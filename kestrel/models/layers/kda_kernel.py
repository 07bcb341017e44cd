"""KDA on CPU through the compiled kernels (`kda_cpu.cpp`): the token loop (decode steps, verify blocks, prefills) and
the calls that also run the conv, SiLU and q/k norms (a decode step in place, a lone sequence's segment, a prefill's
conv pass).

Each token of `kda_steps` is five ATen ops on a [K, V] state per head (~25 us a token and layer at K = V = 64, one
thread); the C++ loop keeps each head's state in cache and does the same arithmetic for all tokens in ~4 us (a
7-token verify block of 4 heads: 145 -> 35 us; one decode token: 28 -> 11 us, `benchmarks/kda_kernel.py`). Where
it may run, and how it is built: `cpu_kernels`.
"""

from __future__ import annotations

import torch

from kestrel.models.layers import cpu_kernels

L2_EPS = 1e-6  # l2_normalize's eps (kda_ops), which the PyTorch path of the same layer uses


def applies(q: torch.Tensor, state: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether `steps` may serve this call: an fp32 contiguous state (and output buffers of its shape) on CPU at
    inference, with the kernels built."""
    if not cpu_kernels.inference_on_cpu(q) or not cpu_kernels.fp32_contiguous(state, *outs):
        return False
    if any(s.shape != state.shape for s in outs):
        return False
    return cpu_kernels.module() is not None


def steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep: dict[int, torch.Tensor],
    final: torch.Tensor,
) -> torch.Tensor:
    """Outputs [B, T, H, V] of T tokens from `state` (one token may come as [B, H, ...]: outputs [B, H, V]); the
    state after token t is written into keep[t] and the final one into `final` (which may be `state`). Call only where
    `applies` said yes."""
    q, k, v, g, beta = (_fp32(x) for x in (q, k, v, g, beta))
    return cpu_kernels.module().kda_steps_fp32(q, k, v, g, beta, state, list(keep), list(keep.values()), final)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()


def _fp32_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] as the varlen kernel reads it: fp32, heads and channels contiguous, rows at any stride."""
    if x.dtype == torch.float32 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.to(torch.float32).contiguous()


def conv_qkv(x: torch.Tensor, conv_w: torch.Tensor, out_rows: torch.Tensor, heads: int):
    """Conv + SiLU + q/k L2 norms of a prefill from its varlen conv layout (`KDAAttention.packed_qkv`'s work) ->
    q, k, v [N, H, K] as views of one buffer. Call only where `applies` said yes and x, conv_w are fp32 contiguous."""
    act = cpu_kernels.module().kda_conv_qkv_fp32(x, conv_w, out_rows, heads, L2_EPS)
    c = act.shape[1] // 3
    return (act[:, i * c : (i + 1) * c].unflatten(-1, (heads, -1)) for i in range(3))


def varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    lens: list[int],
    segment_seq: list[int],
    segment_last_token: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of several sequences packed end to end (q, k, g [N, H, K], v [N, H, V], beta [N, H]; sequence s has
    lens[s] rows and starts from states[s]) -> (outputs [N, H, V], the state after each segment [segments, H, K, V]),
    segment i ending at offset segment_last_token[i] of sequence segment_seq[i] (-1: before its first token). Call
    only where `applies(q, states)` said yes."""
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    rows = [starts[s] + last for s, last in zip(segment_seq, segment_last_token)]
    out = states.new_empty(len(rows), *states.shape[1:])
    q, k, v = (_fp32_rows(x) for x in (q, k, v))
    g, beta = _fp32(g), _fp32(beta)
    o = cpu_kernels.module().kda_varlen_fp32(q, k, v, g, beta, states, starts, list(segment_seq), rows, out)
    return o, out


def fused_applies(mixed: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether `segment` / `decode` may serve this layer call: fp32 CPU inference, `mixed` with unit column stride and
    the other tensors (inputs, conv weight, state pools or views) fp32 and contiguous, with the kernels built."""
    if not cpu_kernels.inference_on_cpu(mixed) or mixed.dtype != torch.float32 or mixed.stride(-1) != 1:
        return False
    return cpu_kernels.fp32_contiguous(*tensors) and cpu_kernels.module() is not None


def segment(
    mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor, states, offsets: list[int]
) -> torch.Tensor:
    """Conv + SiLU + q/k L2 norms + the delta rule of one sequence's T new tokens, its states read from and written
    to their pool slots (`SequenceStates`; snapshot i after offsets[i] tokens). Returns the outputs [T, H, K]. Call
    only where `fused_applies` said yes."""
    return cpu_kernels.module().kda_segment_fp32(
        mixed,
        conv_w,
        g,
        beta,
        states.conv_pool,
        states.recurrent_pool,
        states.slot,
        states.store_slot,
        list(offsets),
        list(states.snapshot_slots),
        L2_EPS,
    )


def decode(mixed, g, beta, conv_w, conv_state, rec_state) -> torch.Tensor:
    """One decode token of B sequences: conv + SiLU + q/k norms + the delta rule, the conv and recurrent states (pool
    views) updated in place. Returns the outputs [B, H, K]. Call only where `fused_applies` said yes."""
    return cpu_kernels.module().kda_decode_fp32(mixed, conv_w, g, beta, conv_state, rec_state, L2_EPS)
