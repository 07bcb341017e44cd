"""DeepSeek-V3 / Kimi K2: config parsing, routing against transformers, the MTP layer skipped, engine invariants,
prefix cache and planner on Kestrel-written tiny checkpoints. (Logits / greedy / cached-vs-full against
transformers' DeepseekV3ForCausalLM are in test_models_vs_transformers.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from test_engine import _assert_all_freed, _assert_matches_reference, _greedy, _prompts
from test_prefix_cache import _assert_idle_and_clear, _converse

from kestrel import LLM
from kestrel.config import ConfigError, model_config_from_dict
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import build_model, load_model, param_count
from kestrel.models.presets import preset_config
from kestrel.models.simple_cache import full_logits
from kestrel.plan import Layout, kv_bytes_per_token_layer, param_totals, plan

FAMILIES = ["deepseek_v3", "kimi_k2"]


@pytest.fixture(scope="module")
def ds_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds_v3")
    return {fam: make_model(fam, "tiny", root / fam, seed=7) for fam in FAMILIES}


# -- config ----------------------------------------------------------------------------------------------


def test_kimi_k2_config_parses_as_plain_mla_with_dense_first_and_moe_frequency():
    raw = preset_config("kimi_k2", "tiny") | {
        "num_hidden_layers": 6,
        "q_lora_rank": None,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 2,
    }
    cfg = model_config_from_dict(raw)
    assert cfg.model_type == "kimi_k2" and cfg.layer_kinds == ["mla"] * 6 and not cfg.has_indexer
    assert cfg.mlp_kinds == ["dense", "dense", "moe", "dense", "moe", "dense"]
    assert cfg.q_lora_rank is None and cfg.use_rope and cfg.router_activation == "sigmoid"
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("yarn", 32.0, 50000.0)


def test_deepseek_v3_defaults_follow_transformers():
    """No first_k_dense_replace: 3 dense layers (transformers' default); grouped routing read from n_group."""
    raw = preset_config("deepseek_v3", "tiny") | {"num_hidden_layers": 5, "n_group": 4, "topk_group": 2}
    raw.pop("first_k_dense_replace")
    cfg = model_config_from_dict(raw)
    assert cfg.mlp_kinds == ["dense"] * 3 + ["moe"] * 2
    assert (cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor) == (4, 2, True, 2.5)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"topk_method": "greedy"}, "topk_method"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"moe_layer_freq": 0}, "moe_layer_freq"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
    ],
)
def test_unsupported_deepseek_v3_options_raise_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        model_config_from_dict(preset_config("deepseek_v3", "tiny") | override)


# -- routing and loading against transformers -----------------------------------------------------------


def test_grouped_noaux_routing_equals_transformers_and_groups_matter(hf_deepseek_v3):
    """Per MoE layer, the same experts and weights as transformers' router; dropping the grouping or the
    correction bias changes the choice (so the oracle tests exercise both)."""
    hf, path = hf_deepseek_v3
    model, cfg = load_model(path)
    assert (cfg.n_group, cfg.topk_group) == (4, 2)
    x = torch.randn(256, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    moe_layers = [i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"]
    assert moe_layers
    for i in moe_layers:
        ours = model.model.layers[i].mlp.gate
        weights, ids = ours(x)
        with torch.no_grad():
            _, ref_w, ref_ids = hf.model.layers[i].mlp.gate(x)
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)
        grouped = ours.choose(ours.scores(x)).sort(-1).values
        ours.n_group = 1
        assert (ours.choose(ours.scores(x)).sort(-1).values != grouped).any(-1).float().mean() > 0.05
        ours.n_group = cfg.n_group
        bias = ours.e_score_correction_bias.clone()
        ours.e_score_correction_bias.zero_()
        assert (ours.choose(ours.scores(x)).sort(-1).values != grouped).any(-1).any()
        ours.e_score_correction_bias.copy_(bias)


def test_mtp_layer_in_the_checkpoint_is_skipped(ds_checkpoints, tmp_path):
    """DeepSeek-V3 ships its multi-token-prediction module as `model.layers.{num_hidden_layers}.*`."""
    src = ds_checkpoints["deepseek_v3"]
    dst = tmp_path / "with_mtp"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    n, d = config["num_hidden_layers"], config["hidden_size"]
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d),
        f"model.layers.{n}.enorm.weight": torch.ones(d),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(config["vocab_size"], d),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.randn(4, d),
    }
    save_file(mtp, dst / "model-mtp.safetensors")
    prompt = list(range(3, 40))
    plain, _ = load_model(src)
    with_mtp, _ = load_model(dst)
    assert torch.equal(full_logits(plain, prompt), full_logits(with_mtp, prompt))


# -- engine invariants -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, -1])
def test_batched_and_chunked_requests_match_the_reference(family, chunk, ds_checkpoints):
    llm = LLM(str(ds_checkpoints[family]), max_total_tokens=4096, chunked_prefill_size=chunk, page_size=8)
    prompts = _prompts(12, 259, seed=2)
    _assert_matches_reference(llm, prompts, llm.generate(prompts, _greedy(), use_tqdm=False))
    _assert_all_freed(llm)


def test_one_request_alone_matches_the_reference(ds_checkpoints):
    llm = LLM(str(ds_checkpoints["deepseek_v3"]), max_total_tokens=1024)
    prompts = _prompts(1, 259, seed=1, lo=40, hi=41)
    _assert_matches_reference(llm, prompts, llm.generate(prompts, _greedy(), use_tqdm=False))
    _assert_all_freed(llm)


@pytest.mark.slow
def test_compiled_decode_matches_the_eager_reference(ds_checkpoints):
    """--compile on plain MLA layers: decode steps of 1 and 2 rows run the compiled graph; same tokens."""
    llm = LLM(str(ds_checkpoints["kimi_k2"]), max_total_tokens=2048, page_size=8, compile=True, compile_max_bs=2)
    compiled = llm.engine.runner.compiled
    ran, call = [], compiled.__class__.__call__
    compiled.__class__.__call__ = lambda self, batch: (ran.append(batch.num_seqs), call(self, batch))[1]
    try:
        prompts = _prompts(2, 259, seed=8, lo=20, hi=60)
        outputs = llm.generate(prompts, [_greedy(4), _greedy(9)], use_tqdm=False)
    finally:
        compiled.__class__.__call__ = call
    assert set(ran) == {1, 2}
    for prompt, out, n in zip(prompts, outputs, (4, 9)):
        _assert_matches_reference(llm, [prompt], [out], n)
    _assert_all_freed(llm)


def test_prefix_cache_hits_equal_cold_runs(ds_checkpoints):
    args = dict(max_total_tokens=4096, page_size=16, chunked_prefill_size=48)
    on = LLM(str(ds_checkpoints["kimi_k2"]), **args)
    off = LLM(str(ds_checkpoints["kimi_k2"]), enable_prefix_caching=False, **args)
    rec_on = _converse(on, sessions=2, turns=3, new_tokens=lambda t: 37 if t == 0 else 21, out_tokens=7)
    rec_off = _converse(off, sessions=2, turns=3, new_tokens=lambda t: 37 if t == 0 else 21, out_tokens=7)
    for turn, ((rows_on, computed_on), (rows_off, computed_off)) in enumerate(zip(rec_on, rec_off)):
        for (p_on, out_on, cached_on), (p_off, out_off, _) in zip(rows_on, rows_off):
            assert p_on == p_off and out_on == out_off, f"turn {turn}: cached run diverged"
            if turn > 0:
                assert cached_on > 0
        if turn > 0:
            assert computed_on < computed_off
    _assert_idle_and_clear(on)


# -- planner ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_formula_matches_the_built_model(family):
    cfg = model_config_from_dict(preset_config(family, "small"))
    assert param_totals(cfg)[0] == param_count(build_model(cfg))


def test_plan_counts_a_latent_per_layer_and_no_state(ds_checkpoints):
    cfg = model_config_from_dict(json.loads((ds_checkpoints["deepseek_v3"] / "config.json").read_text()))
    p = plan(cfg, Layout(gpus=1, tp=1, gpu_mem_gib=1.0, kv_format="bf16", context_len=4096))
    per_layer = kv_bytes_per_token_layer(cfg, "mla", "bf16")
    assert per_layer == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    assert p.kv_bytes_per_token_per_rank == cfg.num_hidden_layers * per_layer
    assert p.kda_state_bytes_per_request_per_rank == 0 and p.fits
