"""DFlash block draft: proposes B-1 tokens in one forward from the target's hidden states.

Context = RMSNorm(fc(concat of the hidden states of a few target layers)), one vector per committed token. Every
draft layer projects the context with its own MLA k/v projections (k-norm, RoPE at the token's absolute position)
and appends those keys/values to the block's own. The block is `[last committed token, MASK × (B-1)]` embedded
with the target's embedding; it attends bidirectionally to context + block, and the target's final norm and LM
head turn the B-1 mask rows into proposals. The target's parts are borrowed, never saved with the draft.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.config import ConfigError, RopeConfig
from kestrel.models.checkpoint import text_weights_sha256
from kestrel.models.decoder import CausalLM
from kestrel.models.layers.norm import RMSNorm
from kestrel.models.layers.rope import RotaryEmbedding, apply_rope_interleaved

log = logging.getLogger(__name__)
DRAFT_MODEL_TYPE = "dflash_draft"


def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` layer ids spread evenly over 1..L-3 (the DFlash choice: early, middle and late features)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


@dataclass
class DraftConfig:
    """The draft's config.json (`model_type` = dflash_draft); `target_layer_ids` may be set by hand."""

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 512
    block_size: int = 8  # the block size trained for; any B <= block_size works at inference
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    target_sha256: str | None = None  # `text_weights_sha256` of the target the draft was trained on
    tie_word_embeddings: bool = False  # read by the checkpoint loader

    def __post_init__(self) -> None:
        if not self.target_layer_ids:
            self.target_layer_ids = default_target_layers(self.num_target_layers, 3)
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ConfigError(f"draft config 'target_layer_ids': {bad} not in [0, {self.num_target_layers})")
        if self.block_size < 2:
            raise ConfigError("draft config 'block_size': must be >= 2")

    def to_dict(self) -> dict:
        return {"model_type": DRAFT_MODEL_TYPE, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict) -> DraftConfig:
        if raw.get("model_type") != DRAFT_MODEL_TYPE:
            raise ConfigError(
                f"draft config 'model_type': expected {DRAFT_MODEL_TYPE!r}, got {raw.get('model_type')!r}"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known - {"model_type"})
        if unknown:
            raise ConfigError(f"draft config: unknown fields {unknown}")
        return cls(**{k: v for k, v in raw.items() if k in known})

    @classmethod
    def for_target(cls, target: CausalLM, **overrides) -> DraftConfig:
        cfg = target.cfg
        return cls(
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_target_layers=cfg.num_hidden_layers,
            rms_norm_eps=cfg.rms_norm_eps,
            **overrides,
        )


class DraftAttention(nn.Module):
    """MLA attention of the block over [context; block] keys. Both go through the same k/v projections."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.nope, self.rope_dim, self.v_dim = (
            h,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.rank = cfg.kv_lora_rank
        self.q_proj = nn.Linear(d, h * (self.nope + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.k_norm = RMSNorm(self.nope + self.rope_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)
        self.scale = (self.nope + self.rope_dim) ** -0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] at positions whose rope tables are cos/sin [T, dr] → keys [T, H, dk], values [T, H, dv]."""
        t = x.shape[0]
        latent, rope_key = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        rope_key = apply_rope_interleaved(rope_key, cos, sin)[:, None].expand(t, self.n_heads, self.rope_dim)
        return self.k_norm(torch.cat([k_nope, rope_key], dim=-1)), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        ctx_mask: torch.Tensor,
        first: int = 0,
    ) -> torch.Tensor:
        """x [N, B, d] blocks; ctx_k [N, L, H, dk], ctx_v [N, L, H, dv], ctx_mask [N, L] (True = visible).

        Every row is a key/value; only rows from `first` on are queries, and the output is theirs [N, B - first, d]
        (the last layer needs no output for a block's first row: it proposes nothing)."""
        n, b, _ = x.shape
        flat = x.reshape(n * b, -1)
        c, s = cos.reshape(n * b, -1), sin.reshape(n * b, -1)
        k, v = self.kv(flat, c, s)
        bq = b - first
        xq, cq, sq = (t[:, first:].reshape(n * bq, -1) for t in (x, cos, sin))
        q = self.q_proj(xq).view(n * bq, self.n_heads, self.nope + self.rope_dim)
        q = torch.cat([q[..., : self.nope], apply_rope_interleaved(q[..., self.nope :], cq, sq)], dim=-1)
        # One softmax over the context's and the block's scores (bidirectional in the block), the two halves
        # multiplied separately: the context is never copied into a [context; block] tensor, and no
        # scaled_dot_product_attention (dk != dv sends it to its unfused math path: 0.2 ms a layer at 250 tokens).
        q = (q * self.scale).view(n, bq, self.n_heads, -1).transpose(1, 2)  # [N, H, Bq, dk]
        ctx_scores = torch.matmul(q, ctx_k.permute(0, 2, 3, 1)).masked_fill(~ctx_mask[:, None, None, :], -torch.inf)
        own_scores = torch.matmul(q, k.view(n, b, self.n_heads, -1).permute(0, 2, 3, 1))
        probs = torch.cat([ctx_scores, own_scores], dim=-1).softmax(dim=-1)
        width = ctx_k.shape[1]
        out = torch.matmul(probs[..., :width], ctx_v.transpose(1, 2)).add_(
            torch.matmul(probs[..., width:], v.view(n, b, self.n_heads, -1).transpose(1, 2))
        )
        return self.o_proj(out.transpose(1, 2).reshape(n, bq, -1))


class DraftMLP(nn.Module):
    def __init__(self, d: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, first: int = 0) -> torch.Tensor:
        """Rows `first`.. of the layer's output (see `DraftAttention.forward`)."""
        h = x[:, first:] + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_mask, first)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft's own weights; `bind(target)` lends it the target's embedding, final norm and LM head."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = RotaryEmbedding(
            RopeConfig(theta=cfg.rope_theta), cfg.qk_rope_head_dim, cfg.max_position_embeddings
        )
        self._target: list[CausalLM] = []  # a list so the target's parameters are not registered here

    def bind(self, target: CausalLM) -> DFlashDraft:
        t = target.cfg
        if (t.hidden_size, t.vocab_size, t.num_hidden_layers) != (
            self.cfg.hidden_size,
            self.cfg.vocab_size,
            self.cfg.num_target_layers,
        ):
            raise ConfigError(
                "draft model: hidden_size / vocab_size / num_target_layers "
                f"{(self.cfg.hidden_size, self.cfg.vocab_size, self.cfg.num_target_layers)} do not match the target's "
                f"{(t.hidden_size, t.vocab_size, t.num_hidden_layers)}"
            )
        self._target = [target]
        return self

    @property
    def target(self) -> CausalLM:
        if not self._target:
            raise RuntimeError("draft model is not bound to a target (call bind)")
        return self._target[0]

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """Captured target hidden states (layer -> [T, d]) → context features [T, d]."""
        feats = torch.cat([hidden[i] for i in self.cfg.target_layer_ids], dim=-1)
        return self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))

    def context_kv(self, feats: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per draft layer, the keys [T, H, dk] and values [T, H, dv] of context features at absolute positions."""
        cos, sin = self.rotary(positions, feats.dtype)
        return [layer.self_attn.kv(feats, cos, sin) for layer in self.layers]

    def block_logits(
        self,
        last_tokens: torch.Tensor,
        start: torch.Tensor,
        block: int,
        ctx: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [N, block-1, V] (fp32) for the MASK positions of N blocks.

        last_tokens [N]: each block's first token, at absolute position start [N]; ctx: per layer ([N, L, H, dk],
        [N, L, H, dv]) keys/values of the context each block may see (ctx_mask [N, L]).
        """
        target = self.target
        emb = target.model.embed_tokens(last_tokens)  # [N, d]
        x = torch.cat([emb[:, None], self.mask_embedding.to(emb.dtype).expand(emb.shape[0], block - 1, -1)], dim=1)
        positions = start[:, None] + torch.arange(block, device=start.device)
        cos, sin = self.rotary(positions.reshape(-1), x.dtype)
        cos, sin = cos.view(*positions.shape, -1), sin.view(*positions.shape, -1)
        last = len(self.layers) - 1
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx)):
            x = layer(x, cos, sin, k, v, ctx_mask, first=1 if i == last else 0)  # the last: the mask rows only
        return target.logits(target.model.norm(x))


def save_draft(draft: DFlashDraft, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """safetensors + config.json, in the layout `load_draft` (the checkpoint loader) reads."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu", dtype).contiguous() for name, p in draft.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(draft.cfg.to_dict(), indent=2) + "\n")
    return out


def load_draft(path: str | Path, target: CausalLM) -> DFlashDraft:
    """Read a draft checkpoint with the same loader as the target; weights in the target's dtype and device."""
    from kestrel.models.loader import load_weights, skip_init

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ConfigError(f"draft model: no config.json in {path}")
    cfg = DraftConfig.from_dict(json.loads(cfg_file.read_text()))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(target.dtype)
    try:
        with skip_init(), torch.device(target.device):
            draft = DFlashDraft(cfg)
    finally:
        torch.set_default_dtype(previous)
    load_weights(draft, path)
    return draft.eval().bind(target)


def random_draft(target: CausalLM, seed: int = 0, std: float = 0.02, **overrides) -> DFlashDraft:
    """A draft with random weights (tests: proposals are mostly wrong, outputs must not change)."""
    gen = torch.Generator().manual_seed(seed)
    draft = DFlashDraft(DraftConfig.for_target(target, **overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("mask_embedding"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return draft.to(target.device, target.dtype).eval().bind(target)


EMBEDDED_DRAFT_DIR = Path(__file__).resolve().parent.parent / "assets" / "kestrel-mini-dflash"


def load_spec_draft(config, model_path: str | Path, target: CausalLM) -> DFlashDraft:
    """The draft named by `speculative_draft_model`, or the shipped one when the target is the embedded model."""
    from kestrel.models.builtin import EMBEDDED_DIR

    path = config.speculative_draft_model
    if path is None:
        if Path(model_path).resolve() != EMBEDDED_DIR.resolve():
            raise ConfigError(
                "engine option 'speculative_draft_model': required unless the model is the embedded kestrel-mini"
            )
        path = EMBEDDED_DRAFT_DIR
    draft = load_draft(path, target)
    want = draft.cfg.target_sha256
    if want is not None and Path(model_path).is_dir() and text_weights_sha256(model_path) != want:
        log.warning("draft %s was trained on other target weights: expect low acceptance (outputs are unchanged)", path)
    return draft
