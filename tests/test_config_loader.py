"""Config parsing (names real checkpoints and transformers write) and loader errors and formats."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.config import ConfigError, load_model_config, model_config_from_dict
from kestrel.models.checkpoint import make_model
from kestrel.models.layers.linear import FusedLinear
from kestrel.models.loader import CheckpointError, load_model, param_count
from kestrel.models.presets import preset_config
from kestrel.models.simple_cache import full_logits


def test_real_checkpoint_names_and_transformers_names_agree():
    real = preset_config("kimi_linear", "tiny")  # Kimi-Linear's own field names
    hf = dict(real)
    for old, new in [
        ("num_experts", "n_routed_experts"),
        ("num_experts_per_token", "num_experts_per_tok"),
        ("moe_renormalize", "norm_topk_prob"),
        ("num_shared_experts", "n_shared_experts"),
        ("model_max_length", "max_position_embeddings"),
    ]:
        hf[new] = hf.pop(old)
    hf.pop("linear_attn_config")
    hf |= {
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "mlp_layer_types": ["dense"] + ["sparse"] * 3,
    }
    a, b = model_config_from_dict(real), model_config_from_dict(hf)
    assert a.to_dict() == b.to_dict()
    assert a.layer_kinds == ["kda", "kda", "kda", "mla"] and a.mlp_kinds == ["dense", "moe", "moe", "moe"]


def test_legacy_rope_scaling_equals_rope_parameters():
    new = preset_config("deepseek_v32", "tiny")
    old = dict(new)
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    assert model_config_from_dict(old).rope == model_config_from_dict(new).rope


def test_k3_nested_text_config_and_full_rank_gate():
    cfg = model_config_from_dict(preset_config("kimi_k3", "tiny"))
    assert cfg.model_type == "kimi_k3" and cfg.kda_full_rank_gate and cfg.layer_kinds[3] == "dsa"


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(num_experts_per_token=99), "num_experts_per_tok"),
        (lambda c: c["linear_attn_config"].update(kda_layers=[1, 2, 9]), "kda_layers"),
        (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
        (
            lambda c: c.update(layer_types=["linear_attention"] * 3 + ["weird"]) or c.pop("linear_attn_config"),
            "layer_types",
        ),
    ],
)
def test_bad_config_names_the_field(edit, field):
    raw = json.loads(json.dumps(preset_config("kimi_linear", "tiny")))
    edit(raw)
    with pytest.raises(ConfigError, match=field):
        model_config_from_dict(raw)


def test_bad_config_json_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        load_model_config(tmp_path)


def test_missing_unexpected_and_mismatched_tensors_in_one_error(tmp_path, tiny_checkpoints):
    ckpt = tmp_path / "broken"
    shutil.copytree(tiny_checkpoints["kimi_linear"], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    tensors["model.layers.0.bogus.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.zeros(7)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    msg = str(err.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg
    assert "model.layers.1.mlp.experts.down_proj" in msg
    assert "model.layers.0.bogus.weight" in msg
    assert "model.norm.weight: expected (64,), got (7,)" in msg


def test_sharded_checkpoint_and_bf16_load(tmp_path, tiny_checkpoints):
    from kestrel.models.checkpoint import save_checkpoint

    model, _ = load_model(tiny_checkpoints["deepseek_v32"])
    config = json.loads((tiny_checkpoints["deepseek_v32"] / "config.json").read_text())
    out = save_checkpoint(model, config, tmp_path / "sharded", max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 2
    again, _ = load_model(out)
    ids = torch.arange(3, 43)
    assert torch.equal(full_logits(model, ids), full_logits(again, ids))
    bf16, _ = load_model(out, dtype=torch.bfloat16)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    assert (full_logits(bf16, ids) - full_logits(model, ids)).abs().max() < 0.5


def test_transformers_fused_expert_layout_loads(tmp_path, tiny_checkpoints):
    """transformers' in-memory layout (fused experts, stacked conv, forget_gate.*) loads to the same model."""
    src = tiny_checkpoints["kimi_linear"]
    model, cfg = load_model(src)
    state = model.state_dict()
    for prefix, module in model.named_modules():  # Kestrel's fused input projections are not transformers'
        if isinstance(module, FusedLinear):
            parent = prefix.rsplit(".", 1)[0]
            for part, piece in zip(module.parts, state.pop(f"{prefix}.weight").split(module.sizes)):
                state[f"{parent}.{part}.weight"] = piece
    tensors = {}
    for name, t in state.items():
        name = name.replace("self_attn.f_a_proj", "self_attn.forget_gate.f_a_proj")
        tensors[name] = t.clone()
    out = tmp_path / "fused"
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    save_file(tensors, out / "model.safetensors")
    again, _ = load_model(out)
    ids = torch.arange(3, 40)
    assert torch.equal(full_logits(model, ids), full_logits(again, ids))


def test_small_preset_is_about_20m_parameters(tmp_path):
    cfg = model_config_from_dict(preset_config("kimi_linear", "small"))
    from kestrel.models.loader import build_model

    n = param_count(build_model(cfg))
    assert 15e6 < n < 30e6, n


def test_make_model_is_deterministic(tmp_path):
    a = make_model("kimi_k3", "tiny", tmp_path / "a", seed=5)
    b = make_model("kimi_k3", "tiny", tmp_path / "b", seed=5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
