"""Multi-head latent attention (MLA), optionally sparse through a DSA indexer.

The cache holds per token only the normalised latent c (kv_lora_rank) and the rope key k_r. Two equal forms:
naive (expand c through kv_b_proj into per-head K/V; cheap for long prefill chunks) and absorbed (fold
kv_b_proj into the query and the output so attention runs in latent space; the decode form).
DSA decode past `index_topk` tokens gathers the selected latents and attends over those k only (the other forms
mask all L), so a long history costs its index keys plus k latents.
"""

from __future__ import annotations

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers import batch_invariant, cpu_kernels
from kestrel.models.layers.casts import cast
from kestrel.models.layers.constants import fp32_scalar
from kestrel.models.layers.derived import derived
from kestrel.models.layers.dsa import (
    Indexer,
    as_positions,
    causal_mask,
    gather_positions,
    positions_mask,
    selected_positions,
    topk_mask,
)
from kestrel.models.layers.hookless import HooklessModule
from kestrel.models.layers.linear import FusedLinear, compiled_cpu_product_dtype
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import apply_rope_interleaved, softmax_scale_mscale
from kestrel.models.layers.topk_order import topk_positions

# Eager CPU decode runs the latent-side products (scores, probs·latents) in fp32 up to this many gathered latent
# rows (batch × history), upcasting the gathered histories. torch's CPU bf16 `bmm` builds a oneDNN primitive per new
# shape, and a decode step's history length is new every step: 175-290 us per call at batch 1 against ~20 us for
# the upcast plus an fp32 bmm. The race's bf16 DeepSeek-V3 (1 thread) stepped 1.6x faster at batch 1 and 1.15x at
# 8; at 32 (~3,000 rows) the upcast cost more than it saved (0.9x), so larger batches keep the model dtype.
FP32_LATENT_MAX_ROWS = 2048

# Chunks of at most this many new tokens use the absorbed (latent-space) form.
ABSORB_MAX_TOKENS = 4


class MLAAttention(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer_id: int, sparse: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        self.use_rope = cfg.use_rope
        qk = cfg.qk_head_dim
        # Everything MLA (and its indexer) reads from x, in one matmul.
        parts = {"q_a_proj": cfg.q_lora_rank} if cfg.q_lora_rank else {"q_proj": self.n_heads * qk}
        parts["kv_a_proj_with_mqa"] = self.rank + self.rope_dim
        if cfg.mla_use_output_gate:
            parts["g_proj"] = self.n_heads * self.v_dim
        if sparse:
            parts |= {"indexer.wk": cfg.index_head_dim, "indexer.weights_proj": cfg.index_n_heads}
        biased = frozenset({"q_a_proj", "kv_a_proj_with_mqa"} if cfg.attention_bias else ())
        self.in_proj = FusedLinear(cfg.hidden_size, parts, biased & set(parts))
        if cfg.q_lora_rank:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * qk, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.has_output_gate = cfg.mla_use_output_gate
        self.indexer = Indexer(cfg) if sparse else None
        self.scale = qk**-0.5 * (softmax_scale_mscale(cfg.rope) if cfg.use_rope else 1.0)
        # Set to a list to record (layer, causally masked index scores [n, L]) (tests compare selections).
        self.record_index_scores: list[torch.Tensor] | None = None
        # Training only: attend to every causal position while the indexer still learns from its distillation loss
        # (DeepSeek-V3.2's dense warm-up), so it has learned where attention goes before it chooses.
        self.dense_warmup = False

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        t = x.shape[0]
        proj = dict(zip(self.in_proj.parts, self.in_proj(x)))
        if "q_a_proj" in proj:
            q_resid = self.q_a_layernorm(proj["q_a_proj"])
            q = self.q_b_proj(q_resid)
        else:
            q, q_resid = proj["q_proj"], x
        q = q.view(t, self.n_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split_with_sizes([self.nope, self.rope_dim], dim=-1)
        latent, rope_key = proj["kv_a_proj_with_mqa"].split_with_sizes([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.use_rope:
            q_rope = apply_rope_interleaved(q_rope, cos, sin)
            rope_key = apply_rope_interleaved(rope_key, cos, sin)
        index_key = index_q = index_w = None
        if self.indexer is not None:
            wk, w = proj["indexer.wk"], proj["indexer.weights_proj"]
            iq = q_resid
            if self.training:
                # The indexer learns only from its distillation loss (selection is not differentiable): keep that
                # loss from reaching the main model, as DeepSeek-V3.2 does.
                wk, w = (self.in_proj.part(name, x.detach()) for name in ("indexer.wk", "indexer.weights_proj"))
                iq = q_resid.detach()
            index_key = self.indexer.keys(wk, cos, sin)
            index_q, index_w = self.indexer.queries(iq, w, cos, sin)
        if self.training:
            self.indexer_loss = None
        cache = batch.cache
        if cache is not None:
            cache.store_kv(self.layer_id, latent, rope_key, index_key)
        if batch_invariant.active():
            out = self._attend_fixed_order(q_nope, q_rope, latent, rope_key, index_key, index_q, index_w, batch)
            return self._output(out, proj.get("g_proj"))
        forced = batch.replay.index_topk(self.layer_id) if batch.replay is not None and self.indexer else None
        record = [] if batch.index_topk is not None and self.indexer is not None else None
        nd = batch.num_decode
        outs = []
        if nd:
            if forced is not None:
                raise ValueError("routing replay: index top-k replay runs over whole sequences, not decode rows")
            iq_d, iw_d = (index_q[:nd], index_w[:nd]) if index_q is not None else (None, None)
            outs.append(self._decode(q_nope[:nd], q_rope[:nd], iq_d, iw_d, cache, record))
        for seq in range(nd, batch.num_seqs):
            sl, prefix = batch.seq_slice(seq), batch.prefix_lens[seq]
            n = sl.stop - sl.start
            if cache is not None:
                hist_latent, hist_rope, hist_index = cache.load_kv(self.layer_id, seq)
            else:
                hist_latent, hist_rope = latent[sl], rope_key[sl]
                hist_index = index_key[sl] if index_key is not None else None
            allowed = causal_mask(prefix, n, hist_latent.shape[0], hist_latent.device)
            if self.indexer is not None:
                scores = self.indexer.scores(index_q[sl], index_w[sl], hist_index)
                if self.record_index_scores is not None:
                    self.record_index_scores.append((self.layer_id, scores.masked_fill(~allowed, float("-inf")).cpu()))
                if self.training:
                    loss = self._indexer_distill_loss(q_nope[sl], q_rope[sl], hist_latent, hist_rope, allowed, scores)
                    self.indexer_loss = loss if self.indexer_loss is None else self.indexer_loss + loss
                if forced is None and record is None:
                    if not (self.training and self.dense_warmup):
                        allowed = topk_mask(scores, allowed, self.indexer.topk)
                else:
                    topk = self.indexer.topk
                    positions = forced[sl] if forced is not None else selected_positions(scores, allowed, topk)
                    allowed = positions_mask(positions, allowed)
                    if record is not None:
                        record.append(positions)
            attend = self.attend_absorbed if n <= ABSORB_MAX_TOKENS else self.attend_naive
            outs.append(attend(q_nope[sl], q_rope[sl], hist_latent, hist_rope, allowed))
        if record is not None:
            batch.index_topk[self.layer_id] = torch.cat(record)
        return self._output(torch.cat(outs, dim=0), proj.get("g_proj"))

    def _attend_fixed_order(self, q_nope, q_rope, latent, rope_key, index_key, index_q, index_w, batch) -> torch.Tensor:
        """Batch-invariant mode: every query (decode row or prefill token alike) in the absorbed form over its own key
        positions, in blocks fixed by absolute position (`batch_invariant.latent_attention`). DSA queries attend to
        their top-k positions in ascending order. Returns [T, H, dv]."""
        bi = batch_invariant
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        q = bi.head_matmul(q_nope, w[:, : self.nope])  # [T, H, r]
        if self.rope_dim:
            q = torch.cat([q, q_rope.to(q.dtype)], dim=-1)
        forced = batch.replay.index_topk(self.layer_id) if batch.replay is not None and self.indexer else None
        record = [] if batch.index_topk is not None and self.indexer is not None else None
        outs = []
        for rows, hist_latent, hist_rope, hist_index, query_pos in self._histories(latent, rope_key, index_key, batch):
            slots = bi.padded_keys(hist_latent.shape[1])
            valid = torch.arange(slots, device=q.device)[None, :] <= query_pos[:, None]
            own = hist_latent.shape[0] > 1  # decode rows: past a row's length lie other requests' slots, zeroed
            keys = torch.cat([hist_latent, hist_rope], dim=-1) if self.rope_dim else hist_latent
            keys = bi.pad_rows(keys, slots, dim=1)
            keys = keys.masked_fill(~valid[..., None], 0.0) if own else keys
            if self.indexer is not None:
                if forced is not None:
                    positions = forced[rows]
                else:
                    index_keys = bi.pad_rows(hist_index, slots, dim=1)
                    index_keys = index_keys.masked_fill(~valid[..., None], 0.0) if own else index_keys
                    scores = bi.index_scores(index_q[rows], index_w[rows], index_keys, valid)
                    positions = selected_positions(scores, valid, self.indexer.topk)
                    if self.training and hist_latent.shape[0] == 1:
                        length = hist_latent.shape[1]
                        loss = self._indexer_distill_loss(
                            q_nope[rows], q_rope[rows], hist_latent[0], hist_rope[0], valid[:, :length],
                            scores[:, :length],
                        )  # fmt: skip
                        self.indexer_loss = loss if self.indexer_loss is None else self.indexer_loss + loss
                if record is not None:
                    record.append(positions)
                keys, valid = gather_positions(keys, positions, bi.padded_keys(positions.shape[1]))
            outs.append(bi.latent_attention(q[rows], keys, keys[..., : self.rank], valid, self.scale))
        if record is not None:
            batch.index_topk[self.layer_id] = torch.cat(record)
        out = torch.cat(outs)
        return bi.head_matmul(out.to(q_nope.dtype), w[:, self.nope :].transpose(1, 2))

    def _histories(self, latent, rope_key, index_key, batch: ForwardBatch):
        """Per attention group: (rows, latents [g, L, r], rope keys [g, L, dr], index keys [g, L, Di] or None, query
        positions [n]). The decode rows form one group, each row its own history (g = rows); each prefill sequence
        is one (g = 1)."""
        cache, nd = batch.cache, batch.num_decode
        if nd:
            hist_latent, hist_rope = cache.decode_kv(self.layer_id)
            hist_index = cache.decode_index_keys(self.layer_id) if self.indexer is not None else None
            yield slice(0, nd), hist_latent, hist_rope, hist_index, cache.decode_lengths() - 1
        for seq in range(nd, batch.num_seqs):
            sl, prefix = batch.seq_slice(seq), batch.prefix_lens[seq]
            if cache is not None:
                hist_latent, hist_rope, hist_index = cache.load_kv(self.layer_id, seq)
            else:
                hist_latent, hist_rope = latent[sl], rope_key[sl]
                hist_index = index_key[sl] if index_key is not None else None
            query_pos = torch.arange(prefix, prefix + sl.stop - sl.start, device=latent.device)
            yield sl, hist_latent[None], hist_rope[None], None if hist_index is None else hist_index[None], query_pos

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Heads [T, H, dv] → optional output gate (K3) → o_proj."""
        out = out.reshape(out.shape[0], self.n_heads * self.v_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _indexer_distill_loss(self, q_nope, q_rope, latent, rope_key, causal, index_scores) -> torch.Tensor:
        """Cross-entropy of the indexer's distribution against the dense attention (head-averaged, detached)."""
        length = latent.shape[0]
        with torch.no_grad():
            kv = self.kv_b_proj(latent).view(length, self.n_heads, self.nope + self.v_dim)
            scores = torch.einsum("nhd,lhd->hnl", q_nope, kv[..., : self.nope])
            if self.rope_dim:
                scores = scores + torch.einsum("nhd,ld->hnl", q_rope, rope_key)
            target = self._softmax(scores * self.scale, causal, torch.float32).mean(0)
        logp = torch.log_softmax(index_scores.masked_fill(~causal, float("-inf")), dim=-1)
        return -(target * logp.masked_fill(~causal, 0.0)).sum(-1).mean()

    def _decode(self, q_nope, q_rope, index_q, index_w, cache, record: list | None = None) -> torch.Tensor:
        """One new token for each decode row, all at once, in latent space over padded histories. [D, H, dv].

        DSA rows read only the latents the indexer selects (all of a history no longer than top-k, in score order),
        so a long history costs its index keys plus k latents. Equals the per-sequence masked form up to summation
        order. Only tensor shapes are read (no Python ints from the batch), so a compiled step keeps one graph.
        """
        if getattr(cache, "dcp_decode", None) is not None:  # decode context parallelism: KV sharded by token
            return cache.dcp_decode(self, q_nope, q_rope, index_q, index_w)
        lengths = cache.decode_lengths()
        if self.indexer is None:
            in_pool = self._attend_in_pool(q_nope, q_rope, cache, lengths)
            if in_pool is not None:
                return in_pool
            latent, rope_key = cache.decode_kv(self.layer_id)
            allowed = torch.arange(latent.shape[1], device=latent.device)[None, :] < lengths[:, None]  # [D, L]
            return self._attend_latent_padded(q_nope, q_rope, latent, rope_key, allowed)
        keys = cache.decode_index_keys(self.layer_id)
        allowed = torch.arange(keys.shape[1], device=keys.device)[None, :] < lengths[:, None]
        scores = self.indexer.scores_padded(index_q, index_w, keys).masked_fill(~allowed, float("-inf"))
        if self.record_index_scores is not None:
            for b, n in enumerate(lengths.tolist()):
                self.record_index_scores.append((self.layer_id, scores[b : b + 1, :n].cpu()))
        k = torch.sym_min(self.indexer.topk, keys.shape[1])
        idx, selected = topk_positions(scores, allowed, k)  # [D, k]; not selected: padding of histories shorter than k
        if record is not None:
            record.append(as_positions(idx, selected, self.indexer.topk))
        # the selected positions are a prefix of each row (selection order: the unselected padding sorts last)
        in_pool = self._attend_in_pool(q_nope, q_rope, cache, selected.sum(1), idx)
        if in_pool is not None:
            return in_pool
        latent, rope_key = cache.decode_kv_at(self.layer_id, idx)
        return self._attend_latent_padded(q_nope, q_rope, latent, rope_key, selected)

    def _attend_in_pool(
        self, q_nope, q_rope, cache, lengths: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`_attend_latent_padded` through the compiled CPU kernel (`mla_cpu.cpp`), which reads each row's keys from
        the KV pool through its slot table: no padded [D, L, r] gather, and scores, softmax and the latent sum in one
        pass per row. Row i attends to its first lengths[i] history positions, or (DSA) to the first lengths[i] of
        `positions` [D, k]. fp32 eager CPU inference over a plain pool only (else None: the PyTorch ops).
        Batch 32 of kimi_linear small (histories of 128-576 tokens, 1 thread): 6.3 -> 1.2 ms a layer."""
        if q_nope.dtype != torch.float32 or not cpu_kernels.inference_on_cpu(q_nope):
            return None
        pool = cache.decode_pool(self.layer_id)
        if pool is None or pool[0].dtype != torch.float32 or (kernels := cpu_kernels.module()) is None:
            return None
        latent, rope_key, slots = pool
        if positions is not None:
            slots = slots.gather(1, positions)
        w = self._absorb_weights(torch.float32)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()  # [D, H, r]
        q_rope = q_rope.contiguous() if self.rope_dim else q_nope.new_zeros(*q_nope.shape[:2], 0)
        out_latent = kernels.mla_decode_fp32(
            q_latent, q_rope, latent, rope_key, slots.long(), lengths.long().contiguous(), self.scale
        )
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _attend_latent_padded(self, q_nope, q_rope, latent, rope_key, allowed) -> torch.Tensor:
        """Absorbed attention of one query per sequence over its own keys: latents [B, L, r], allowed [B, L].

        Written as bmm over (head | sequence) batches, not einsum: einsum's permute-and-copy of the strided W_UK /
        W_UV views cost as much as the products at decode sizes (the same products, in the same order).
        """
        out_dtype, ct = q_nope.dtype, compiled_cpu_product_dtype(q_nope)
        if q_nope.device.type == "cpu" and latent.shape[0] * latent.shape[1] <= FP32_LATENT_MAX_ROWS:
            ct = torch.float32  # see FP32_LATENT_MAX_ROWS
        w = self._absorb_weights(ct)
        wt = w.dtype  # the per-head weight products run in this dtype (fp32 on CPU: see _absorb_weights)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = cast(torch.bmm(cast(q_nope, wt).transpose(0, 1), w_uk).transpose(0, 1), ct)  # [B, H, r]
        latent = cast(latent, ct)
        scores = torch.bmm(q_latent, latent.transpose(1, 2))  # [B, H, L]
        if self.rope_dim:
            scores = scores + torch.bmm(cast(q_rope, ct), cast(rope_key, ct).transpose(1, 2))
        scale = fp32_scalar(self.scale) if scores.dtype == torch.float32 else self.scale  # see constants.py
        scores = (scores * scale).masked_fill(~allowed[:, None, :], float("-inf"))
        probs = cast(torch.softmax(scores, dim=-1, dtype=torch.float32), ct)
        out_latent = cast(torch.bmm(probs, latent), wt)  # [B, H, r]
        return cast(torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1), out_dtype)

    def _absorb_weights(self, ct: torch.dtype) -> torch.Tensor:
        """kv_b_proj as per-head [H, nope + dv, r] for the absorbed products q·W_UK and o·W_UV.

        On CPU these run in fp32 whatever the model dtype: torch's CPU bf16 `bmm` at decode sizes was 5x slower
        than fp32 even at a fixed shape (30.7 vs 5.8 us, [4, 1, 64] x [4, 64, 512], one thread). Eager keeps an
        fp32 copy of the weight between steps (H·(nope + dv)·r·4 bytes per MLA layer, not counted by the planner:
        the price of skipping a per-step cast); compiled, inductor fuses the upcast. The latent-side products run
        in `ct` (see FP32_LATENT_MAX_ROWS).
        """
        w = self.kv_b_proj.weight
        shape = (self.n_heads, self.nope + self.v_dim, self.rank)
        if w.device.type != "cpu" or w.dtype == torch.float32:
            return cast(w.view(shape), ct)
        return derived(self, "absorb_fp32", w, lambda t: t.float().view(shape))

    # -- the two attention forms ------------------------------------------------------------------------
    def attend_naive(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor, allowed
    ) -> torch.Tensor:
        """Expand the latents to per-head keys/values, then ordinary attention. Returns [n, H, dv]."""
        length = latent.shape[0]
        kv = self.kv_b_proj(latent.to(q_nope.dtype)).view(length, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        scores = torch.einsum("nhd,lhd->hnl", q_nope, k_nope)
        if self.rope_dim:
            scores = scores + torch.einsum("nhd,ld->hnl", q_rope, rope_key.to(q_rope.dtype))
        probs = self._softmax(scores * self.scale, allowed, q_nope.dtype)
        return torch.einsum("hnl,lhd->nhd", probs, v)

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor, allowed
    ) -> torch.Tensor:
        """Attention in latent space: q·W_UK against c, then (p·c)·W_UV. Never expands the cache."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        latent = latent.to(q_nope.dtype)
        scores = torch.einsum("nhr,lr->hnl", q_latent, latent)
        if self.rope_dim:
            scores = scores + torch.einsum("nhd,ld->hnl", q_rope, rope_key.to(q_rope.dtype))
        probs = self._softmax(scores * self.scale, allowed, q_nope.dtype)
        out_latent = torch.einsum("hnl,lr->nhr", probs, latent)
        return torch.einsum("nhr,hvr->nhv", out_latent, w_uv)

    @staticmethod
    def _softmax(scores: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
