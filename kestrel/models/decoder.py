"""One decoder for every family, assembled per layer from `ModelConfig` (KDA / MLA / DSA; dense / MoE; AttnRes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from kestrel.config import ModelConfig
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers import batch_invariant
from kestrel.models.layers.attnres import attn_res_mix
from kestrel.models.layers.hookless import HooklessModule
from kestrel.models.layers.kda import KDAAttention
from kestrel.models.layers.mla import MLAAttention
from kestrel.models.layers.moe import DenseMLP, MoE
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding
from kestrel.models.vision.moonvit import Grid, MoonViT, Projector


@dataclass
class Residual:
    """The residual stream between two layers: the hidden states [T, d], or under AttnRes the running partial sum
    and the bank of block snapshots (what one pipeline stage hands the next)."""

    hidden: torch.Tensor
    bank: list[torch.Tensor] = field(default_factory=list)


class DecoderLayer(HooklessModule):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kind = cfg.layer_kinds[layer_id]
        d = cfg.hidden_size
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        if self.kind == "kda":
            self.self_attn: nn.Module = KDAAttention(cfg, layer_id)
        else:
            self.self_attn = MLAAttention(cfg, layer_id, sparse=self.kind == "dsa")
        self.is_moe = cfg.mlp_kinds[layer_id] == "moe"
        self.mlp: nn.Module = MoE(cfg) if self.is_moe else DenseMLP(cfg, d, cfg.intermediate_size)
        self.block_size = cfg.attn_res_block_size
        if self.block_size:
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def attention(self, x: torch.Tensor, batch: ForwardBatch, rope: tuple | None) -> torch.Tensor:
        if self.kind == "kda":
            return self.self_attn(x, batch)
        cos, sin = rope if rope is not None else (None, None)
        return self.self_attn(x, batch, cos, sin)

    def feed_forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not self.is_moe:
            return self.mlp(x)
        forced = batch.replay.experts(self.layer_id) if batch.replay is not None else None
        out, ids = self.mlp(x, forced)
        if batch.routed_experts is not None:
            batch.routed_experts[self.layer_id] = ids
        return out

    def forward(self, h: torch.Tensor, batch: ForwardBatch, rope: tuple | None) -> torch.Tensor:
        """Plain pre-norm residual block."""
        h = h + self.attention(self.input_layernorm(h), batch, rope)
        return h + self.feed_forward(self.post_attention_layernorm(h), batch)

    def forward_attn_res(
        self, partial: torch.Tensor | None, bank: list[torch.Tensor], batch: ForwardBatch, rope: tuple | None
    ) -> torch.Tensor:
        """AttnRes block: softmax-mix the block snapshots and the running partial sum → maybe snapshot →
        attention → mix → MLP. Returns the new partial."""
        x = (
            attn_res_mix(
                partial, bank, self.self_attention_res_proj.weight, self.self_attention_res_norm.weight, self.eps
            )
            if bank
            else partial
        )
        if self.layer_id % self.block_size == 0:
            bank.append(partial)
            partial = None
        a = self.attention(self.input_layernorm(x), batch, rope)
        partial = a if partial is None else partial + a
        mixed = attn_res_mix(partial, bank, self.mlp_res_proj.weight, self.mlp_res_norm.weight, self.eps)
        return partial + self.feed_forward(self.post_attention_layernorm(mixed), batch)


class DecoderModel(nn.Module):
    """Embeddings → layers → final norm. Parameter names follow the checkpoints' `model.*` names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = (
            RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
            if cfg.use_rope and cfg.attention_layers
            else None
        )
        if cfg.attn_res_block_size:
            self.output_attn_res_proj = nn.Linear(cfg.hidden_size, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.finish(self.run_layers(self.embed(batch), batch, self.layers))

    def embed(self, batch: ForwardBatch) -> Residual:
        """The stream before the first layer: the embeddings (AttnRes: the partial, with an empty bank)."""
        h = self.embed_tokens(batch.input_ids)
        if batch.mm_embeds is not None:  # image placeholders take the projected image features
            h = h.index_copy(0, batch.mm_rows, batch.mm_embeds.to(h.dtype))
        return Residual(h)

    def run_layers(self, res: Residual, batch: ForwardBatch, layers: Iterable[DecoderLayer]) -> Residual:
        """Carry the stream through `layers` (all of them, or one pipeline stage's run of them)."""
        rope = self.rotary(batch.positions, res.hidden.dtype) if self.rotary is not None else None
        capture = batch.captured if batch.captured is not None else {}
        if not self.cfg.attn_res_block_size:
            h = res.hidden
            for layer in layers:
                h = layer(h, batch, rope)
                if layer.layer_id in batch.capture_layers:
                    capture[layer.layer_id] = h
            return Residual(h)
        bank, partial = list(res.bank), res.hidden
        for layer in layers:
            partial = layer.forward_attn_res(partial, bank, batch, rope)
            if layer.layer_id in batch.capture_layers:  # the residual stream: every block's sum + the partial
                capture[layer.layer_id] = partial + sum(bank[1:], bank[0]) if bank else partial
        return Residual(partial, bank)

    def finish(self, res: Residual) -> torch.Tensor:
        """The final norm (AttnRes: over the output mix of the bank and the partial)."""
        if not self.cfg.attn_res_block_size:
            return self.norm(res.hidden)
        eps = self.cfg.rms_norm_eps
        return self.norm(
            attn_res_mix(res.hidden, res.bank, self.output_attn_res_proj.weight, self.output_attn_res_norm.weight, eps)
        )


class CausalLM(nn.Module):
    """Decoder + LM head (+ the vision tower and projector of a multimodal checkpoint, under its own names).
    `forward` returns final hidden states; `logits` projects the rows you need (fp32).

    With `batch_invariant` set (`--deterministic-inference`, and a trainer's matching mode), both run in
    `batch_invariant.mode()`: a row's result never depends on the rest of its batch, chunking or decode vs prefill.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.vision is not None:
            self.vision_tower = MoonViT(cfg.vision)
            self.mm_projector = Projector(cfg.vision)
        self.batch_invariant = False

    @property
    def has_vision(self) -> bool:
        return self.cfg.vision is not None

    def encode_images(self, pixel_values: torch.Tensor, grids: list[Grid]) -> list[torch.Tensor]:
        """Patches of several images → each image's placeholder embeddings [h·w / 4, hidden], in order."""
        features = self.mm_projector(self.vision_tower(pixel_values, grids))
        kh, kw = self.cfg.vision.merge_kernel
        return list(features.split([(h // kh) * (w // kw) for _, h, w in grids]))

    def _mode(self):
        return batch_invariant.mode() if self.batch_invariant else contextlib.nullcontext()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        with self._mode():
            return self.model(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._mode():
            return self.lm_head(hidden).float()

    def _anchor(self) -> torch.Tensor:
        """A weight in the model's dtype on its device: the embedding, or in a pipeline stage that has none (its
        other layers are other ranks'), the first layer norm it holds."""
        if self.model.embed_tokens is not None:
            return self.model.embed_tokens.weight
        return next(layer.input_layernorm.weight for layer in self.model.layers if isinstance(layer, DecoderLayer))

    @property
    def device(self) -> torch.device:
        return self._anchor().device

    @property
    def dtype(self) -> torch.dtype:
        return self._anchor().dtype
