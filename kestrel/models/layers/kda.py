"""Kimi Delta Attention layer: short conv → per-channel gated delta rule → gated RMSNorm → o_proj.

A request's KDA memory is fixed: the recurrent state S [H, K, V] (fp32) and the last kernel-1 conv inputs.
Prefill chunks run the chunked (WY/UT) form, decode batches run the recurrent form over all requests at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.forward_batch import ForwardBatch, PackedPrefill, SequenceStates
from kestrel.models.layers import batch_invariant, cpu_kernels, kda_kernel
from kestrel.models.layers.casts import cast, fp32
from kestrel.models.layers.constants import fp32_scalar
from kestrel.models.layers.derived import derived
from kestrel.models.layers.hookless import HooklessModule
from kestrel.models.layers.kda_ops import kda_chunked_packed, kda_step, kda_steps, l2_normalize
from kestrel.models.layers.linear import FusedLinear
from kestrel.models.layers.norm import GatedRMSNorm
from kestrel.models.weight_loaders import reshape_loader, set_loader, stacked_loader

# Prefill segments up to this many tokens run the token loop: the chunked form would pad them to a full chunk. The
# loop's cost grows with the longest segment, the chunked form's with the chunks: at one sequence they cross near 32-40
# tokens on CPU, and with more sequences the loop is 3-4x faster at 24-32 tokens (benchmarks/kda_forms.py).
RECURRENT_MAX_TOKENS = 32
CHUNK_SIZE = 64  # chunked-form chunk length (64 measured fastest on CPU)


class KDAAttention(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = cfg.kda_num_heads, cfg.kda_head_dim
        self.kernel = cfg.kda_conv_size
        d, c = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim
        self.conv_dim = 3 * c
        # Everything KDA reads from x in one matmul: q, k, v, the forget-gate and output-gate inputs, and beta.
        gate = {"g_proj": c} if cfg.kda_full_rank_gate else {"g_a_proj": self.head_dim}
        self.in_proj = FusedLinear(
            d, {"q_proj": c, "k_proj": c, "v_proj": c, "f_a_proj": self.head_dim, "b_proj": self.n_heads} | gate
        )
        # q, k and v short convs stacked along channels: [3C, 1, kernel] (depthwise).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        set_loader(self.conv1d.weight, stacked_loader({"q": 0, "k": 1, "v": 2}, 3), {"q", "k", "v"})
        self.f_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(c, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        set_loader(self.A_log, reshape_loader)
        self.gate_lower_bound = cfg.kda_gate_lower_bound
        self.g_b_proj = None if cfg.kda_full_rank_gate else nn.Linear(self.head_dim, c, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(c, d, bias=False)

    def empty_state(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        conv = torch.zeros(batch_size, self.conv_dim, self.kernel - 1, device=device, dtype=self.conv1d.weight.dtype)
        rec = torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=torch.float32)
        return conv, rec

    def project(self, x: torch.Tensor):
        """x → (q|k|v before the conv [T, 3C], forget gate g [T, H, K] fp32, beta [T, H] fp32, output gate [T, C])."""
        mixed, f_a, b, gate = self.in_proj.fused(x).split_with_sizes([self.conv_dim, *self.in_proj.sizes[3:]], dim=-1)
        if self.g_b_proj is not None:
            gate = self.g_b_proj(gate)
        return mixed, self.forget_gate(f_a), torch.sigmoid(fp32(b)), gate

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g ≤ 0, [T, H, K], fp32."""
        g = (fp32(self.f_b_proj(f_a)) + self.dt_bias).view(-1, self.n_heads, self.head_dim)
        if self.gate_lower_bound is not None:
            decay = derived(self, "decay", self.A_log, lambda a: a.exp().view(1, self.n_heads, 1))
            return self.gate_lower_bound * torch.sigmoid(decay * g)
        # A_log and dt_bias are kept in fp32; softplus(g) = g above 20, log1p(exp(g)) below
        neg_decay = derived(self, "neg_decay", self.A_log, lambda a: -a.exp().view(1, self.n_heads, 1))
        return F.softplus(g, threshold=20.0) * neg_decay

    def _qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the conv output into heads; q, k L2-normalised (fp32), q scaled by K^-1/2."""
        c = self.conv_dim // 3
        qk = l2_normalize(fp32(conv_out[..., : 2 * c]).unflatten(-1, (2, self.n_heads, self.head_dim)))
        v = conv_out[..., 2 * c :].unflatten(-1, (self.n_heads, self.head_dim))
        scale = fp32_scalar(self.head_dim**-0.5) if qk.dtype == torch.float32 else self.head_dim**-0.5
        return qk[..., 0, :, :] * scale, qk[..., 1, :, :], v

    def _output(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = o.shape[0]
        o = self.o_norm(cast(o, dtype), gate.view(t, self.n_heads, self.head_dim))
        return self.o_proj(o.reshape(t, -1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        mixed, g, beta, gate = self.project(x)
        if batch.kda_inputs is not None:
            batch.kda_inputs[self.layer_id] = (mixed, g, beta)
        cache, nd, n = batch.cache, batch.num_decode, batch.num_seqs
        views = cache.decode_state_views(self.layer_id) if cache is not None and not torch.is_grad_enabled() else None
        if views is not None:  # every row decodes, its states updated where they live in the pool
            return self._output(self.decode_in_place(mixed, g, beta, *views), gate, x.dtype)
        if cache is not None and nd == 0 and n == 1 and batch.extend_lens[0] <= RECURRENT_MAX_TOKENS:
            states = None if torch.is_grad_enabled() else cache.sequence_state_views(self.layer_id)
            if states is not None:  # one verify block or short prompt: its states written where they live
                snaps = batch.state_snapshots[0] if batch.state_snapshots else None
                return self._output(self.segment_in_place(mixed, g, beta, states, snaps), gate, x.dtype)
        if cache is not None:
            conv_state, rec_state = cache.load_state(self.layer_id)
        else:
            conv_state, rec_state = self.empty_state(n, x.device)
        if nd == n:
            o, conv_state, rec_state = self.decode(mixed, g, beta, conv_state, rec_state)
        else:
            if nd:
                o_decode, conv_state[:nd], rec_state[:nd] = self.decode(
                    mixed[:nd], g[:nd], beta[:nd], conv_state[:nd], rec_state[:nd]
                )
            lens = batch.extend_lens[nd:]
            # Out of place: training backpropagates through the initial states read here.
            if max(lens) <= RECURRENT_MAX_TOKENS:  # verify blocks, short prompts joining a decode step
                snaps = batch.state_snapshots[nd:] if batch.state_snapshots else None
                out, conv_p, rec_p = self.short_segments(
                    mixed[nd:], g[nd:], beta[nd:], lens, conv_state[nd:], rec_state[nd:], snaps, cache, nd
                )
            else:
                packed = batch.packed_prefill(CHUNK_SIZE, self.kernel - 1)
                out, conv_p, rec_p = self.prefill_packed(
                    mixed[nd:], g[nd:], beta[nd:], packed, conv_state[nd:], rec_state[nd:], cache
                )
            if nd:
                o, conv_state, rec_state = (
                    torch.cat([a[:nd], b]) for a, b in ((o_decode, out), (conv_state, conv_p), (rec_state, rec_p))
                )
            else:  # nothing decodes this step (a lone verify block or prompt): no copies
                o, conv_state, rec_state = out, conv_p, rec_p
        if cache is not None:
            cache.store_state(self.layer_id, conv_state, rec_state)
        return self._output(o, gate, x.dtype)

    def decode(self, mixed, g, beta, conv_state, rec_state, in_place: bool = False):
        """One new token for each of B sequences, all at once: conv window, then one recurrent step."""
        window = torch.cat([conv_state, cast(mixed, conv_state.dtype)[:, :, None]], dim=-1)  # [B, 3C, kernel]
        w = self.conv1d.weight.squeeze(1)
        conv_out = F.silu(batch_invariant.window_conv(window, w) if batch_invariant.active() else (window * w).sum(-1))
        q, k, v = self._qkv(conv_out)
        o, rec_state = kda_step(q, k, v, g, beta, rec_state, in_place)
        return o, window[:, :, 1:], rec_state

    def decode_in_place(self, mixed, g, beta, conv_state, rec_state) -> torch.Tensor:
        """`decode` writing the new states into the given pool views (same arithmetic, bit for bit; with the compiled
        kernels, one call with the arithmetic of `segment_in_place`)."""
        conv_w = self.conv1d.weight.squeeze(1)
        if kda_kernel.fused_applies(mixed, g, beta, conv_w, conv_state, rec_state):
            return kda_kernel.decode(mixed, g, beta, conv_w, conv_state, rec_state)
        o, window, _ = self.decode(mixed, g, beta, conv_state, rec_state, in_place=True)
        conv_state.copy_(window)
        return o

    def prefill_packed(self, mixed, g, beta, packed: PackedPrefill, conv_state, rec_state, cache):
        """Every prefill sequence at once in the varlen layouts (no padding to the longest sequence for the chunked
        form; sequences of at most RECURRENT_MAX_TOKENS tokens take the token loop over a right-padded batch).

        mixed, g, beta: the prefill rows; conv_state / rec_state: their sequences' states. Hands mid-prefill states
        to the cache as snapshots and returns (outputs [rows, H, V], final conv states, final recurrent states).
        """
        dim = self.conv_dim
        x = mixed.new_empty(packed.conv_len, dim)  # index_copy_: CPU advanced-index writes go element by element
        x.index_copy_(0, packed.conv_token_rows, mixed)
        x.index_copy_(0, packed.conv_history_rows, conv_state.to(mixed.dtype).transpose(1, 2).reshape(-1, dim))
        conv_w = self.conv1d.weight.squeeze(1)
        if kda_kernel.applies(x, rec_state) and cpu_kernels.fp32_contiguous(x, conv_w):
            q, k, v = kda_kernel.conv_qkv(x, conv_w, packed.conv_out_rows, self.n_heads)
        else:
            q, k, v = self.packed_qkv(x, packed)
        if kda_kernel.applies(q, rec_state):  # the compiled token loop, no padding (faster than the chunked form)
            finals = packed.final_segments.tolist()
            lens = [packed.segment_last_token[i] + 1 for i in finals]
            o, states = kda_kernel.varlen(
                q, k, v, g, beta, rec_state, lens, packed.segment_seq, packed.segment_last_token
            )
        # Batch-invariant mode: the recurrent form everywhere, so a token's state update is the decode step's.
        elif packed.padded_width <= RECURRENT_MAX_TOKENS or batch_invariant.active():
            o, states = self._short_recurrent(q, k, v, g, beta, packed, rec_state)
        else:

            def place(t: torch.Tensor) -> torch.Tensor:  # prefill rows -> chunk layout, zeros in the padding
                return t.new_zeros(packed.chunk_len, *t.shape[1:]).index_copy(0, packed.chunk_rows, t)

            o, states = kda_chunked_packed(
                *(place(t) for t in (q, k, v, g, beta)),
                rec_state,
                packed.first_chunks,
                packed.segment_end_chunks,
                chunk_size=CHUNK_SIZE,
            )
            o, states = o[packed.chunk_rows], states.unbind(0)
        rows = packed.conv_state_rows  # [segments, keep]
        convs = x.index_select(0, rows.view(-1)).view(*rows.shape, dim).transpose(1, 2).to(conv_state.dtype)
        if len(packed.snapshot_segments):
            snaps = packed.snapshot_segments.tolist()
            seqs = [packed.seqs[packed.segment_seq[i]] for i in snaps]
            indices = [packed.segment_snapshot[i] for i in snaps]
            snap_convs, snap_states = convs.index_select(0, packed.snapshot_segments), [states[i] for i in snaps]
            cache.store_state_snapshots(self.layer_id, seqs, indices, snap_convs, torch.stack(snap_states))
        finals = packed.final_segments
        return o, convs.index_select(0, finals), torch.stack([states[i] for i in finals.tolist()])

    def packed_qkv(self, x: torch.Tensor, packed: PackedPrefill):
        """q, k, v of the prefill tokens from the conv layout x [conv_len, 3C] (cached inputs in front of each
        sequence): the depthwise causal conv as kernel shifted multiply-adds over the channels-last run."""
        w, span = self.conv1d.weight.squeeze(1), packed.conv_len - (self.kernel - 1)
        conv = x[:span] * w[:, 0]
        for j in range(1, self.kernel):
            conv = conv.addcmul(x[j : j + span], w[:, j])
        return self._qkv(F.silu(conv.index_select(0, packed.conv_out_rows)))

    def _short_recurrent(self, q, k, v, g, beta, packed: PackedPrefill, rec_state):
        """Short sequences token by token over a right-padded batch (padding has k = 0, β = 0, g = 0, so each
        sequence's state stops changing after its last token). Returns outputs [rows, H, V] and the segment-end states
        (views of the loop's states, one [H, K, V] per segment: nothing is copied until the caller picks)."""
        b, width = len(packed.seqs), packed.padded_width

        def pad(t: torch.Tensor) -> torch.Tensor:
            if not packed.uniform:
                t = t.new_zeros(b * width, *t.shape[1:]).index_copy(0, packed.padded_rows, t)
            return t.view(b, width, *t.shape[1:])

        ends = sorted(set(packed.segment_last_token))
        o, _, kept = kda_steps(pad(q), pad(k), pad(v), pad(g), pad(beta), rec_state, ends)
        o = o.reshape(b * width, *o.shape[2:])
        if not packed.uniform:
            o = o[packed.padded_rows]
        at = {t: i for i, t in enumerate(ends)}
        return o, [kept[at[t]][seq] for seq, t in zip(packed.segment_seq, packed.segment_last_token)]

    def short_segments(
        self,
        mixed: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        lens: list[int],
        conv_state: torch.Tensor,
        rec_state: torch.Tensor,
        snapshots: list[list[int]] | None = None,
        cache=None,
        first_seq: int = 0,
    ):
        """Segments of at most RECURRENT_MAX_TOKENS tokens, one per sequence, each from its own states, in a
        right-padded [b, L] layout built from the lengths alone (no varlen layouts): the conv over each sequence's
        cached inputs and its tokens, then the token loop. Same arithmetic as the packed path's recurrent branch, in
        far fewer ops (a verify block's KDA layer took ~2 ms through the packed layouts at batch 1).

        mixed, g, beta: the segments' rows in order; lens: tokens per sequence. Padding has β = 0 and g = 0, so every
        sequence's recurrent state stops changing after its last token. snapshots[i]: offsets m in [1, lens[i]]
        after which sequence first_seq + i's states go to `cache.store_state_snapshots`. Returns outputs
        [rows, H, V] fp32, the conv states and the recurrent states after each segment.
        """
        b, width, keep, dim = len(lens), max(lens), self.kernel - 1, self.conv_dim
        uniform = all(n == width for n in lens)
        rows = None  # bound before `pad` reads it: torch.compile cannot trace a closure over an unbound cell
        if not uniform:
            rows = torch.tensor([i * width + t for i, n in enumerate(lens) for t in range(n)], device=mixed.device)

        def pad(t: torch.Tensor) -> torch.Tensor:
            if not uniform:
                t = t.new_zeros(b * width, *t.shape[1:]).index_copy(0, rows, t)
            return t.view(b, width, *t.shape[1:])

        x, (q, k, v) = self._conv_qkv(conv_state, pad(mixed))
        wanted = sorted({m - 1 for offsets in snapshots or () for m in offsets or ()})
        o, state, kept = kda_steps(q, k, v, pad(g), pad(beta), rec_state, wanted)
        o = o.reshape(b * width, *o.shape[2:])
        if not uniform:
            o = o[rows]

        def conv_after(seqs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:  # states after `ends` tokens
            at = ends[:, None] + torch.arange(keep, device=x.device)
            picked = x.index_select(0, seqs).gather(1, at[:, :, None].expand(-1, -1, dim))
            return picked.transpose(1, 2).to(conv_state.dtype)

        if uniform:
            conv_final = x[:, width:].transpose(1, 2).to(conv_state.dtype)
        else:
            conv_final = conv_after(torch.arange(b, device=x.device), torch.tensor(lens, device=x.device))
        if wanted:
            at = {t: i for i, t in enumerate(wanted)}
            seqs, indices, ends, states = [], [], [], []
            for i, offsets in enumerate(snapshots):
                for index, m in enumerate(offsets or ()):
                    seqs.append(i)
                    indices.append(index)
                    ends.append(m)
                    states.append(kept[at[m - 1]][i])
            convs = conv_after(torch.tensor(seqs, device=x.device), torch.tensor(ends, device=x.device))
            cache.store_state_snapshots(
                self.layer_id, [first_seq + i for i in seqs], indices, convs, torch.stack(states)
            )
        return o, conv_final, state

    def _conv_qkv(self, conv_state: torch.Tensor, mixed: torch.Tensor):
        """Right-padded [b, L, 3C] conv inputs after their cached ones → (the run x [b, keep + L, 3C], (q, k, v))."""
        width = mixed.shape[1]
        x = torch.cat([conv_state.to(mixed.dtype).transpose(1, 2), mixed], dim=1)
        w = self.conv1d.weight.squeeze(1)
        conv = x[:, :width] * w[:, 0]
        for j in range(1, self.kernel):
            conv = conv.addcmul(x[:, j : j + width], w[:, j])
        return x, self._qkv(F.silu(conv))

    def segment_in_place(self, mixed, g, beta, states: SequenceStates, snapshots: list[int] | None) -> torch.Tensor:
        """`short_segments` for a one-sequence batch (a verify block or short prompt at concurrency 1), reading and
        writing its states where they live (`SequenceStates`): the same arithmetic, without the gather, the stack
        of kept states and the scatters into the pool. Returns the outputs [T, H, V]."""
        n, keep, offsets = mixed.shape[0], self.kernel - 1, snapshots or []
        conv_w = self.conv1d.weight.squeeze(1)
        if kda_kernel.fused_applies(mixed, g, beta, conv_w, states.conv_pool, states.recurrent_pool):  # one call
            return kda_kernel.segment(mixed, g, beta, conv_w, states, offsets)
        x, (q, k, v) = self._conv_qkv(states.conv, mixed[None])
        # Token index -> the slot its state goes to; a second slot for the same token (a repeated offset, or a
        # snapshot after the last token) gets a copy.
        targets = [(m - 1, rec) for m, (_, rec) in zip(offsets, states.snapshots)] + [(n - 1, states.final_recurrent)]
        into, copies = {}, []
        for t, dst in targets:
            if t in into:
                copies.append((dst, t))
            else:
                into[t] = dst
        o, _, _ = kda_steps(q, k, v, g[None], beta[None], states.recurrent, out=into)
        for dst, t in copies:
            dst.copy_(into[t])
        for m, (conv, _) in zip(offsets, states.snapshots):
            conv.copy_(x[:, m : m + keep].transpose(1, 2))
        states.final_conv.copy_(x[:, n : n + keep].transpose(1, 2))
        return o[0]

    def replay(self, mixed, g, beta, rows: torch.Tensor, lens: list[int], conv_state, rec_state):
        """ReplaySSM: `lens[i]` tokens of sequence i (flat `rows` of the given inputs, in order) from its committed
        states; returns the conv and recurrent states after them."""
        mixed, g, beta = (t.index_select(0, rows) for t in (mixed, g, beta))
        return self.short_segments(mixed, g, beta, lens, conv_state, rec_state)[1:]
