"""Kimi Delta Attention layer: short conv → per-channel gated delta rule → gated RMSNorm → o_proj.

A request's KDA memory is fixed: the recurrent state S [H, K, V] (fp32) and the last kernel-1 conv inputs.
Prefill chunks run the chunked (WY/UT) form, decode batches run the recurrent form over all requests at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers.kda_ops import kda_chunked, kda_recurrent, l2_normalize
from kestrel.models.layers.norm import GatedRMSNorm
from kestrel.models.weight_loaders import reshape_loader, set_loader, stacked_loader


class KDAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = cfg.kda_num_heads, cfg.kda_head_dim
        self.kernel = cfg.kda_conv_size
        d, c = cfg.hidden_size, cfg.kda_num_heads * cfg.kda_head_dim
        self.conv_dim = 3 * c
        self.q_proj = nn.Linear(d, c, bias=False)
        self.k_proj = nn.Linear(d, c, bias=False)
        self.v_proj = nn.Linear(d, c, bias=False)
        # q, k and v short convs stacked along channels: [3C, 1, kernel] (depthwise).
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        set_loader(self.conv1d.weight, stacked_loader({"q": 0, "k": 1, "v": 2}, 3), {"q", "k", "v"})
        self.f_a_proj = nn.Linear(d, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(c, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        set_loader(self.A_log, reshape_loader)
        self.gate_lower_bound = cfg.kda_gate_lower_bound
        self.b_proj = nn.Linear(d, self.n_heads, bias=False)
        if cfg.kda_full_rank_gate:
            self.g_proj = nn.Linear(d, c, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, c, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(c, d, bias=False)

    def empty_state(self, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        conv = torch.zeros(batch_size, self.conv_dim, self.kernel - 1, device=device, dtype=self.q_proj.weight.dtype)
        rec = torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device, dtype=torch.float32)
        return conv, rec

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g ≤ 0, [T, H, K], fp32."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.n_heads, self.head_dim)
        decay = self.A_log.float().exp().view(1, self.n_heads, 1)
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(decay * g)
        return -decay * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))

    def short_conv(self, mixed: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor, snaps=None):
        """Causal depthwise conv + SiLU per sequence, continuing from each sequence's last kernel-1 inputs.

        Also returns, per sequence, the conv state after each offset in `snaps[seq]` (prefix-cache snapshots).
        """
        weight = self.conv1d.weight.squeeze(1)  # [3C, kernel]
        keep = self.kernel - 1
        if batch.is_decode:
            window = torch.cat([conv_state, mixed.to(conv_state.dtype)[:, :, None]], dim=-1)  # [B, 3C, kernel]
            out = (window * weight[None]).sum(-1)
            final = window[:, :, -keep:]
            at = [[final[seq]] * len(snaps[seq]) for seq in range(batch.num_seqs)] if snaps else None
            return F.silu(out), final, at
        outs, states, at = [], [], []
        for seq in range(batch.num_seqs):
            xi = mixed[batch.seq_slice(seq)].t()  # [3C, n]
            full = torch.cat([conv_state[seq].to(xi.dtype), xi], dim=-1)
            out = F.conv1d(full[None], weight[:, None, :], groups=self.conv_dim)[0]  # [3C, n]
            outs.append(out.t())
            states.append(full[:, -keep:])
            # The inputs before offset m sit at full[:, m : m + keep] (full starts with the keep old ones).
            at.append([full[:, m : m + keep] for m in snaps[seq]] if snaps else [])
        return F.silu(torch.cat(outs, dim=0)), torch.stack(states), at if snaps else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        cache = batch.cache
        if cache is None and batch.num_seqs > 1 and not batch.is_decode:
            return self.forward_padded(x, mixed, batch)
        if cache is not None:
            conv_state, rec_state = cache.load_state(self.layer_id)
        else:
            conv_state, rec_state = self.empty_state(batch.num_seqs, x.device)
        snaps = batch.state_snapshots if cache is not None else None
        mixed, conv_state, conv_at = self.short_conv(mixed, batch, conv_state, snaps)
        q, k, v = (y.reshape(t, self.n_heads, self.head_dim) for y in mixed.split(self.conv_dim // 3, dim=-1))
        q = l2_normalize(q.float()) * self.head_dim**-0.5
        k = l2_normalize(k.float())
        g = self.forget_gate(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        rec_at: list[list[torch.Tensor]] = [[] for _ in range(batch.num_seqs)]
        if batch.is_decode:
            o, rec_state = kda_recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], rec_state)
            o = o[:, 0]
            if snaps:
                rec_at = [[rec_state[seq]] * len(snaps[seq]) for seq in range(batch.num_seqs)]
        else:
            outs, states = [], []
            for seq in range(batch.num_seqs):
                sl = batch.seq_slice(seq)
                state = rec_state[seq : seq + 1]
                # Snapshot offsets split the chunk into segments; each segment continues from the last state.
                lo = 0
                for hi in [*(snaps[seq] if snaps else []), batch.extend_lens[seq]]:
                    if hi > lo:
                        part = slice(sl.start + lo, sl.start + hi)
                        oi, state = kda_chunked(
                            q[None, part], k[None, part], v[None, part], g[None, part], beta[None, part], state
                        )
                        outs.append(oi[0])
                        lo = hi
                    rec_at[seq].append(state[0])
                rec_at[seq].pop()  # the state after the whole chunk is the request's own, not a snapshot
                states.append(state[0])
            o, rec_state = torch.cat(outs, dim=0), torch.stack(states)
        if cache is not None:
            cache.store_state(self.layer_id, conv_state, rec_state)
            for seq, offsets in enumerate(snaps or []):
                for j in range(len(offsets)):
                    cache.store_state_snapshot(self.layer_id, seq, j, conv_at[seq][j], rec_at[seq][j])
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.to(x.dtype), gate.view(t, self.n_heads, self.head_dim))
        return self.o_proj(o.reshape(t, -1))

    def forward_padded(self, x: torch.Tensor, mixed: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Whole sequences from an empty state (training, full forward): all sequences in one padded call.

        Trailing padding has zero inputs, β = 0 and g = 0, so it leaves every real position unchanged.
        """
        t, lens = x.shape[0], torch.tensor(batch.extend_lens, device=x.device)
        width = int(lens.max())
        real = torch.arange(width, device=x.device)[None, :] < lens[:, None]  # [B, L]

        def pad(flat: torch.Tensor) -> torch.Tensor:
            out = flat.new_zeros(real.shape + flat.shape[1:])
            out[real] = flat
            return out

        weight = self.conv1d.weight.squeeze(1)
        conv_in = F.pad(pad(mixed).transpose(1, 2), (self.kernel - 1, 0))
        conv = F.silu(F.conv1d(conv_in, weight[:, None, :], groups=self.conv_dim)).transpose(1, 2)  # [B, L, 3C]
        q, k, v = (y.reshape(*real.shape, self.n_heads, self.head_dim) for y in conv.split(self.conv_dim // 3, -1))
        q = l2_normalize(q.float()) * self.head_dim**-0.5
        k = l2_normalize(k.float())
        g = pad(self.forget_gate(x))
        beta = pad(torch.sigmoid(self.b_proj(x).float()))
        o, _ = kda_chunked(q, k, v, g, beta)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o[real].to(x.dtype), gate.view(t, self.n_heads, self.head_dim))
        return self.o_proj(o.reshape(t, -1))
