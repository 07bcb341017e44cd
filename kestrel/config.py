"""Checkpoint `config.json` → one `ModelConfig` for every supported family.

Real checkpoints and transformers write different names for the same thing (`num_experts` /
`n_routed_experts`, `moe_renormalize` / `norm_topk_prob`, legacy `rope_scaling` / `rope_parameters`);
they are all read here, once, so the model code sees a single vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_linear", "deepseek_v32", "kimi_k3", "deepseek_v3", "kimi_k2", "kimi_k25")
# DeepSeek-V3 architecture (Kimi K2 checkpoints name it `kimi_k2`): plain MLA on every layer, no indexer.
DEEPSEEK_V3_TYPES = ("deepseek_v3", "kimi_k2")
# Multimodal wrappers: {"text_config": ..., "vision_config": ...}. Kimi K2.5 / K2.6 (`kimi_k25`) wrap a DeepSeek-V3
# text model and always carry a MoonViT tower; K3 may.
MULTIMODAL_TYPES = ("kimi_k3", "kimi_k25")
LAYER_KINDS = ("kda", "mla", "dsa")


class ConfigError(ValueError):
    """A checkpoint config that Kestrel cannot serve; the message names the field."""


@dataclass
class RopeConfig:
    """Rotary embedding of the MLA rope slice (and the DSA indexer); `rope_type` default or yarn."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass
class VisionConfig:
    """MoonViT (Kimi K2.5 / K3): patch embedding, encoder, 2x2 merger, projector; and how images are preprocessed.

    Read from `vision_config` (transformers' names or the original `vt_*` / `init_pos_emb_*` ones) plus the
    top-level projector and token fields; preprocessing defaults are `Kimi_K25ImageProcessor`'s.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    text_hidden_size: int
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"
    projection_hidden_size: int = 0  # the projector's LayerNorm width (= hidden_size)
    projection_eps: float = 1e-5
    image_token_id: int = 163605  # <|media_pad|>, repeated once per merged patch
    max_patches: int = 16384  # the resize keeps at most this many 14-px patches ...
    max_patches_per_side: int = 512  # ... and at most this many along either side
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        self.merge_kernel = tuple(self.merge_kernel)
        self.projection_hidden_size = self.projection_hidden_size or self.hidden_size
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]

    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"config field 'vision_config.{name}': {why}")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive int")
        for name in ("pos_emb_height", "pos_emb_width", "pos_emb_time", "max_patches", "max_patches_per_side"):
            need(getattr(self, name) > 0, name, "must be > 0")
        need(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads", "must divide hidden_size")
        need(self.head_dim % 4 == 0, "hidden_size", "head dim must be a multiple of 4 (2-D rotary: h and w halves)")
        need(len(self.merge_kernel) == 2 and min(self.merge_kernel) >= 1, "merge_kernel_size", "two sizes >= 1")
        need(self.hidden_act in VISION_ACTIVATIONS, "hidden_act", f"one of {VISION_ACTIVATIONS}")
        need(
            self.projection_hidden_size == self.hidden_size,
            "mm_hidden_size",
            f"the projector normalises tower outputs: must equal hidden_size {self.hidden_size}",
        )


VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# Other MoonViT variants a `vision_config` may describe; refused by name rather than served with the wrong math.
_VISION_FIXED = {
    "norm_type": ("layernorm",),
    "mm_projector_type": ("patchmerger",),
    "pos_emb_type": ("divided_fixed",),
    "pos_emb_interpolation_mode": ("bicubic",),
    "merge_type": ("sd2_tpool",),
    "mlp_type": ("mlp2", "mlp"),
    "attn_bias": (True,),
    "linear_bias": (True,),
    "patch_embed_proj_bias": (True,),
}


def vision_config_from_dict(
    vision: dict[str, Any], top: dict[str, Any], text_hidden_size: int, preprocessor: dict[str, Any] | None = None
) -> VisionConfig:
    """`vision_config` + the wrapper's top-level fields (+ `preprocessor_config.json`) → `VisionConfig`."""
    if not isinstance(vision, dict):
        raise ConfigError("config field 'vision_config': must be an object")
    for name, allowed in _VISION_FIXED.items():
        if name in vision and vision[name] not in allowed:
            raise ConfigError(
                f"config field 'vision_config.{name}': unsupported {vision[name]!r} (supported: {allowed})"
            )
    qkv = vision.get("qkv_hidden_size")
    hidden = _first(vision, "hidden_size", "vt_hidden_size")
    if qkv is not None and qkv != hidden:
        raise ConfigError("config field 'vision_config.qkv_hidden_size': must equal hidden_size (no wider attention)")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"config field 'vision_config.rope_parameters.rope_type': unsupported {rope['rope_type']!r}")
    missing = [n for n in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")]
    missing = [n for n in missing if _first(vision, n, f"vt_{n}") is None]
    if missing:
        raise ConfigError(f"config field 'vision_config.{missing[0]}': missing")
    pre = preprocessor or {}
    size = pre.get("size") or {}
    return VisionConfig(
        hidden_size=int(hidden),
        num_hidden_layers=int(_first(vision, "num_hidden_layers", "vt_num_hidden_layers")),
        num_attention_heads=int(_first(vision, "num_attention_heads", "vt_num_attention_heads")),
        intermediate_size=int(_first(vision, "intermediate_size", "vt_intermediate_size")),
        text_hidden_size=text_hidden_size,
        patch_size=int(_first(vision, "patch_size", default=14)),
        pos_emb_height=int(_first(vision, "pos_emb_height", "init_pos_emb_height", default=64)),
        pos_emb_width=int(_first(vision, "pos_emb_width", "init_pos_emb_width", default=64)),
        pos_emb_time=int(_first(vision, "pos_emb_time", "init_pos_emb_time", default=4)),
        merge_kernel=tuple(int(k) for k in _first(vision, "merge_kernel_size", default=(2, 2))),
        rope_theta=float(_first(rope, "rope_theta", default=10000.0)),
        hidden_act=_first(vision, "hidden_act", "activation_func", default="gelu_pytorch_tanh"),
        projection_hidden_size=int(
            _first(top, "projection_hidden_size", default=_first(vision, "mm_hidden_size", default=0))
        ),
        projection_eps=float(
            _first(top, "projection_layer_norm_eps", default=_first(vision, "projector_ln_eps", default=1e-5))
        ),
        image_token_id=int(_first(top, "image_token_id", "media_placeholder_token_id", default=163605)),
        max_patches=int(_first(pre, "max_patches", "in_patch_limit", default=16384)),
        max_patches_per_side=int(
            _first(size, "max_height", default=_first(pre, "patch_limit_on_one_side", default=512))
        ),
        image_mean=tuple(float(x) for x in _first(pre, "image_mean", default=(0.5, 0.5, 0.5))),
        image_std=tuple(float(x) for x in _first(pre, "image_std", default=(0.5, 0.5, 0.5))),
    )


@dataclass
class ModelConfig:
    """Everything the decoder needs, with one name per concept; validated on construction."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_kinds: list[str]
    mlp_kinds: list[str]
    rms_norm_eps: float = 1e-6
    intermediate_size: int = 0
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # MLA / DSA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    use_rope: bool = True
    rope: RopeConfig = field(default_factory=RopeConfig)
    mla_use_output_gate: bool = False
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # KDA
    kda_num_heads: int = 0
    kda_head_dim: int = 0
    kda_conv_size: int = 4
    kda_full_rank_gate: bool = False
    kda_gate_lower_bound: float | None = None
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router_activation: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    # "mxfp4": routed experts stored packed (`quantization_config.quant_method`); everything else stays as loaded.
    routed_expert_format: str = "dense"
    # AttnRes
    attn_res_block_size: int | None = None
    # The MoonViT tower, patch merger and projector (K2.5, K3 with a `vision_config`); None: text only.
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        self.validate()

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == "kda"]

    @property
    def attention_layers(self) -> list[int]:
        """Layers with an MLA latent cache (plain MLA and DSA)."""
        return [i for i, k in enumerate(self.layer_kinds) if k in ("mla", "dsa")]

    @property
    def has_indexer(self) -> bool:
        return "dsa" in self.layer_kinds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- validation ------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"config field {name!r}: {why}")

        need(self.model_type in SUPPORTED_MODEL_TYPES, "model_type", f"unsupported {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive int")
        need(len(self.layer_kinds) == self.num_hidden_layers, "layer_types", "needs one entry per layer")
        need(len(self.mlp_kinds) == self.num_hidden_layers, "mlp_layer_types", "needs one entry per layer")
        for kind in self.layer_kinds:
            need(kind in LAYER_KINDS, "layer_types", f"unknown layer kind {kind!r}")
        for kind in self.mlp_kinds:
            need(kind in ("dense", "moe"), "mlp_layer_types", f"unknown mlp kind {kind!r}")
        need(self.hidden_act in ("silu", "situ"), "hidden_act", f"unsupported activation {self.hidden_act!r}")
        if "dense" in self.mlp_kinds:
            need(self.intermediate_size > 0, "intermediate_size", "must be > 0 for dense layers")
        if self.attention_layers:
            for name in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                need(getattr(self, name) > 0, name, "must be > 0 for MLA layers")
            need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
            if self.use_rope:
                need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even for RoPE")
                need(self.rope.rope_type in ("default", "yarn"), "rope_type", f"unsupported {self.rope.rope_type!r}")
        if self.has_indexer:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                need(getattr(self, name) > 0, name, "must be > 0 for DSA layers")
            if self.use_rope:
                need(self.index_head_dim >= self.qk_rope_head_dim, "index_head_dim", "must be >= qk_rope_head_dim")
        if self.kda_layers:
            for name in ("kda_num_heads", "kda_head_dim", "kda_conv_size"):
                need(getattr(self, name) > 0, f"linear_attn_config.{name.removeprefix('kda_')}", "must be > 0")
        if "moe" in self.mlp_kinds:
            need(self.num_experts > 0, "num_experts", "must be > 0 for MoE layers")
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok", "must be in [1, experts]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0 for MoE layers")
            need(self.router_activation in ("sigmoid", "softmax"), "moe_router_activation_func", "sigmoid|softmax")
            need(self.n_group >= 1 and self.num_experts % self.n_group == 0, "n_group", "must divide num_experts")
            need(1 <= self.topk_group <= self.n_group, "topk_group", "must be in [1, n_group]")
            need(self.routed_expert_format in ("dense", "mxfp4"), "quantization_config.quant_method", "mxfp4 or none")
            if self.routed_expert_format == "mxfp4":
                expert_in = self.routed_expert_hidden_size or self.hidden_size
                in_name = "routed_expert_hidden_size" if self.routed_expert_hidden_size else "hidden_size"
                need(expert_in % 32 == 0, in_name, "MXFP4 experts need a multiple of 32")
                need(
                    self.moe_intermediate_size % 32 == 0, "moe_intermediate_size", "MXFP4 experts need a multiple of 32"
                )
        if self.attn_res_block_size is not None:
            need(self.attn_res_block_size > 0, "attn_res_block_size", "must be > 0")


# ---------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------


def _first(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    return default


def _layer_kinds(raw: dict[str, Any], model_type: str, n_layers: int, has_indexer: bool) -> list[str]:
    full = "dsa" if has_indexer else "mla"
    if model_type == "deepseek_v32":
        return ["dsa"] * n_layers
    if model_type in DEEPSEEK_V3_TYPES:
        return ["mla"] * n_layers
    lac = raw.get("linear_attn_config") or {}
    if "kda_layers" in lac and "full_attn_layers" in lac:
        kinds: list[str | None] = [None] * n_layers
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", full)):
            for layer in lac[key]:
                if not (isinstance(layer, int) and 1 <= layer <= n_layers):
                    raise ConfigError(f"config field 'linear_attn_config.{key}': bad 1-based layer {layer!r}")
                kinds[layer - 1] = kind
        if None in kinds:
            raise ConfigError(f"config field 'linear_attn_config': layer {kinds.index(None) + 1} is in neither list")
        return kinds  # type: ignore[return-value]
    names = {"linear_attention": "kda", "full_attention": full, "indexed_attention": "dsa", "kda": "kda"}
    if raw.get("layer_types") is not None:
        types = raw["layer_types"]
        if any(t not in names for t in types):
            bad = next(t for t in types if t not in names)
            raise ConfigError(f"config field 'layer_types': unknown layer type {bad!r}")
        return [names[t] for t in types]
    return [full if i and i % 4 == 0 else "kda" for i in range(n_layers)]


def _mlp_kinds(raw: dict[str, Any], n_layers: int, model_type: str) -> list[str]:
    if raw.get("mlp_layer_types") is not None:
        mapping = {"dense": "dense", "sparse": "moe", "moe": "moe"}
        if any(t not in mapping for t in raw["mlp_layer_types"]):
            raise ConfigError("config field 'mlp_layer_types': entries must be 'dense' or 'sparse'")
        return [mapping[t] for t in raw["mlp_layer_types"]]
    n_experts = _first(raw, "num_experts", "n_routed_experts", "num_local_experts", default=0)
    if not n_experts:
        return ["dense"] * n_layers
    deepseek = model_type == "deepseek_v32" or model_type in DEEPSEEK_V3_TYPES
    first_dense = int(_first(raw, "first_k_dense_replace", default=3 if deepseek else 1))
    freq = int(_first(raw, "moe_layer_freq", default=1))
    if first_dense < 0:
        raise ConfigError("config field 'first_k_dense_replace': must be >= 0")
    if freq < 1:
        raise ConfigError("config field 'moe_layer_freq': must be >= 1")
    return ["moe" if i >= first_dense and (i - first_dense) % freq == 0 else "dense" for i in range(n_layers)]


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = _first(params, "rope_theta", default=_first(raw, "rope_theta", default=10000.0))
    rope_type = _first(params, "rope_type", "type", default="default")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(_first(params, "factor", default=1.0)),
        original_max_position_embeddings=_first(params, "original_max_position_embeddings"),
        beta_fast=float(_first(params, "beta_fast", default=32.0)),
        beta_slow=float(_first(params, "beta_slow", default=1.0)),
        mscale=_first(params, "mscale"),
        mscale_all_dim=_first(params, "mscale_all_dim"),
        attention_factor=_first(params, "attention_factor"),
        truncate=bool(_first(params, "truncate", default=True)),
    )


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _check_deepseek_v3(raw: dict[str, Any]) -> None:
    """Reject DeepSeek-V3 options whose math Kestrel does not implement, rather than serve them wrongly."""
    method = raw.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ConfigError(f"config field 'topk_method': unsupported {method!r} (DeepSeek-V3 routes with 'noaux_tc')")
    if raw.get("rope_interleave", True) is False:
        raise ConfigError("config field 'rope_interleave': false is unsupported (MLA rope is interleaved)")


def model_config_from_dict(raw: dict[str, Any], preprocessor: dict[str, Any] | None = None) -> ModelConfig:
    """Build a `ModelConfig` from a parsed `config.json` of any supported family (`preprocessor`: the parsed
    `preprocessor_config.json` of a vision checkpoint, if it has one)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"config field 'model_type': unsupported {model_type!r} (supported: {SUPPORTED_MODEL_TYPES})")
    vision, top_level, family = None, raw, model_type
    if model_type in MULTIMODAL_TYPES:
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"config field 'text_config': {model_type} checkpoints nest the language model there")
        vision = raw.get("vision_config")
        top_level = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
        text_type = raw["text_config"].get("model_type", "deepseek_v3")
        raw = {**top_level, **raw["text_config"], "model_type": model_type}
        if model_type == "kimi_k25":
            if text_type not in DEEPSEEK_V3_TYPES:
                raise ConfigError(
                    f"config field 'text_config.model_type': kimi_k25 wraps deepseek_v3, got {text_type!r}"
                )
            family = text_type
            if vision is None:
                raise ConfigError("config field 'vision_config': kimi_k25 checkpoints carry a vision tower")
            # The wrapper decides tying (transformers' Kimi_K25Config defaults to tied, K2.5 itself says false).
            raw["tie_word_embeddings"] = top_level.get("tie_word_embeddings", True)

    try:
        cfg = _parse(raw, family, vision, top_level, preprocessor)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"config: malformed value ({exc})") from exc
    cfg.model_type = model_type
    return cfg


def _parse(
    raw: dict[str, Any],
    model_type: str,
    vision: dict[str, Any] | None,
    top_level: dict[str, Any],
    preprocessor: dict[str, Any] | None,
) -> ModelConfig:
    for required in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if required not in raw:
            raise ConfigError(f"config field {required!r}: missing")
    n_layers = int(raw["num_hidden_layers"])
    has_indexer = model_type == "deepseek_v32" or raw.get("index_topk") is not None
    lac = raw.get("linear_attn_config") or {}
    act = raw.get("hidden_act", "silu")
    use_nope = bool(raw.get("mla_use_nope", model_type in ("kimi_linear", "kimi_k3")))
    if model_type in DEEPSEEK_V3_TYPES:
        _check_deepseek_v3(raw)
    use_grouped = raw.get("use_grouped_topk", True)
    n_group = int(_first(raw, "num_expert_group", "n_group", default=1)) if use_grouped else 1
    topk_group = int(_first(raw, "topk_group", default=1)) if use_grouped else 1
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=n_layers,
        layer_kinds=_layer_kinds(raw, model_type, n_layers, has_indexer),
        mlp_kinds=_mlp_kinds(raw, n_layers, model_type),
        rms_norm_eps=float(_first(raw, "rms_norm_eps", default=1e-6)),
        intermediate_size=int(_first(raw, "intermediate_size", default=0)),
        hidden_act=act,
        situ_beta=float(_first(raw, "activation_situ_beta", default=1.0)),
        situ_linear_beta=_first(raw, "activation_situ_linear_beta"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(_first(raw, "max_position_embeddings", "model_max_length", default=4096)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_eos_list(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        num_attention_heads=int(_first(raw, "num_attention_heads", default=0)),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(_first(raw, "kv_lora_rank", default=0)),
        qk_nope_head_dim=int(_first(raw, "qk_nope_head_dim", default=0)),
        qk_rope_head_dim=int(_first(raw, "qk_rope_head_dim", default=0)),
        v_head_dim=int(_first(raw, "v_head_dim", default=0)),
        attention_bias=bool(raw.get("attention_bias", False)),
        use_rope=not use_nope,
        rope=_rope(raw),
        mla_use_output_gate=bool(raw.get("mla_use_output_gate", False)),
        index_n_heads=int(_first(raw, "index_n_heads", default=0)) if has_indexer else 0,
        index_head_dim=int(_first(raw, "index_head_dim", default=0)) if has_indexer else 0,
        index_topk=int(_first(raw, "index_topk", default=0)) if has_indexer else 0,
        kda_num_heads=int(_first(lac, "num_heads", default=_first(raw, "linear_num_heads", default=0))),
        kda_head_dim=int(_first(lac, "head_dim", default=_first(raw, "linear_head_dim", default=0))),
        kda_conv_size=int(
            _first(lac, "short_conv_kernel_size", default=_first(raw, "linear_conv_kernel_dim", default=4))
        ),
        kda_full_rank_gate=bool(_first(lac, "use_full_rank_gate", default=False)),
        kda_gate_lower_bound=_first(lac, "gate_lower_bound"),
        num_experts=int(_first(raw, "num_experts", "n_routed_experts", "num_local_experts", default=0)),
        num_experts_per_tok=int(_first(raw, "num_experts_per_token", "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(_first(raw, "moe_intermediate_size", default=0)),
        num_shared_experts=int(_first(raw, "num_shared_experts", "n_shared_experts", default=0)),
        router_activation=_first(raw, "moe_router_activation_func", "scoring_func", default="sigmoid"),
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(_first(raw, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(_first(raw, "routed_scaling_factor", default=1.0)),
        routed_expert_hidden_size=_first(raw, "routed_expert_hidden_size"),
        latent_moe_use_norm=bool(raw.get("latent_moe_use_norm", False)),
        routed_expert_format="mxfp4"
        if (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        else "dense",
        attn_res_block_size=_first(raw, "attn_res_block_size"),
        vision=vision_config_from_dict(vision, top_level, int(raw["hidden_size"]), preprocessor)
        if vision is not None
        else None,
    )


def load_model_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint folder (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {path}")
    try:
        raw = json.loads(file.read_text())
        pre_file = file.parent / "preprocessor_config.json"
        preprocessor = json.loads(pre_file.read_text()) if pre_file.exists() else None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file}: not valid JSON ({exc})") from exc
    return model_config_from_dict(raw, preprocessor)
