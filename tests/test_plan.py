import json
import re

import pytest
import torch

from kestrel.cache.state_pool import state_bytes_per_slot
from kestrel.cli import main
from kestrel.config import load_model_config, model_config_from_dict
from kestrel.models.checkpoint import make_model
from kestrel.models.loader import build_model, param_count
from kestrel.models.presets import preset_config
from kestrel.plan import (
    GIB,
    Layout,
    PlanError,
    format_plan,
    kimi_k31_pro_config,
    kv_bytes_per_token_layer,
    param_totals,
    plan,
)

MIB = 1 << 20
GB300_GIB = 268  # 288 GB of HBM per GB300


@pytest.fixture(scope="module")
def k31():
    return kimi_k31_pro_config()


def test_preset_is_93_layers_69_kda_24_dsa_near_2_8t_params(k31):
    assert k31.num_hidden_layers == 93
    assert len(k31.kda_layers) == 69 and len(k31.attention_layers) == 24
    assert all(k31.layer_kinds[i] == "dsa" for i in k31.attention_layers)
    total, active = param_totals(k31)
    assert 2.7e12 < total < 2.9e12
    assert 95e9 < active < 110e9


def test_kv_format_table_gives_the_seeds_bytes_per_dsa_layer(k31):
    assert kv_bytes_per_token_layer(k31, "dsa", "bf16") == 1152 + 132 == 1284
    assert kv_bytes_per_token_layer(k31, "dsa", "fp8") == 656 + 132 == 788
    assert kv_bytes_per_token_layer(k31, "dsa", "nvfp4") == 416 + 68 == 484
    assert kv_bytes_per_token_layer(k31, "mla", "fp8") == 656  # plain MLA layers carry no index key


def test_fp8_kv_is_18_9_kb_per_token_over_24_layers(k31):
    p = plan(k31, Layout(gpu_mem_gib=GB300_GIB))
    assert p.kv_bytes_per_token_per_layer == 788
    assert p.kv_bytes_per_token_per_rank == 24 * 788 == 18_912


def test_bf16_kv_of_589824_tokens_is_16_9_gib_at_tp32_and_4_2_gib_with_attention_dp4(k31):
    tp32 = plan(k31, Layout(gpus=32, tp=32, kv_format="bf16"))
    dp4 = plan(k31, Layout(gpus=32, tp=32, dp_attn=4, kv_format="bf16"))
    assert tp32.kv_bytes_per_rank_for_tokens(589_824) == 589_824 * 24 * 1284
    assert tp32.kv_bytes_per_rank_for_tokens(589_824) / GIB == pytest.approx(16.93, abs=0.01)
    assert dp4.attention_groups == 4 and dp4.layout["attn_tp"] == 8
    assert dp4.kv_bytes_per_rank_for_tokens(589_824) / GIB == pytest.approx(4.23, abs=0.01)


def test_kda_recurrent_state_is_52_mib_per_request_per_rank_at_tp8(k31):
    p = plan(k31, Layout(gpu_mem_gib=GB300_GIB))
    assert p.kda_recurrent_bytes_per_request_per_rank == 69 * 12 * 128 * 128 * 4 == 54_263_808
    assert p.kda_recurrent_bytes_per_request_per_rank / MIB == pytest.approx(51.75)
    assert p.kda_conv_bytes_per_request_per_rank == 69 * 3 * 12 * 128 * 3 * 2
    assert p.kda_state_bytes_per_request_per_rank == 54_263_808 + 1_907_712


def test_kda_state_matches_the_engine_state_pool_at_tp1():
    cfg = model_config_from_dict(preset_config("kimi_k3", "small"))
    p = plan(cfg, Layout(gpus=1, tp=1, gpu_mem_gib=1))
    assert p.kda_state_bytes_per_request_per_rank == state_bytes_per_slot(cfg, torch.bfloat16)


def test_nvfp4_latents_with_mxfp4_index_keys_hold_1_6x_the_tokens_of_fp8(k31):
    layout = dict(gpu_mem_gib=GB300_GIB, max_running_requests=32)
    fp8 = plan(k31, Layout(**layout, kv_format="fp8"))
    nvfp4 = plan(k31, Layout(**layout, kv_format="nvfp4"))
    ratio = nvfp4.max_cached_tokens / fp8.max_cached_tokens
    assert ratio == pytest.approx(788 / 484, rel=1e-5)
    assert 1.6 < ratio < 1.7


def test_dcp8_holds_eight_times_the_full_contexts_of_tp8(k31):
    tp8 = plan(k31, Layout(gpu_mem_gib=GB300_GIB))
    dcp8 = plan(k31, Layout(gpu_mem_gib=GB300_GIB, dcp=8))
    assert tp8.kv_bytes_per_token_per_rank == 8 * dcp8.kv_bytes_per_token_per_rank
    assert tp8.full_context_requests == 3  # the seeds' TP8 FP8 figure on 8 GB300
    assert dcp8.full_context_requests == 8 * tp8.full_context_requests == 24
    # With the same state pool the KV room is identical, so token capacity scales by exactly 8.
    same_pool = dict(gpu_mem_gib=GB300_GIB, max_running_requests=64)
    t, d = plan(k31, Layout(**same_pool)), plan(k31, Layout(**same_pool, dcp=8))
    assert 8 * t.max_cached_tokens <= d.max_cached_tokens < 8 * (t.max_cached_tokens + 1)


def test_max_running_requests_caps_concurrency_and_reserves_its_state_pool(k31):
    free = plan(k31, Layout(gpu_mem_gib=GB300_GIB))
    capped = plan(k31, Layout(gpu_mem_gib=GB300_GIB, max_running_requests=100))
    # Uncapped, the pool holds one slot per full-context request, and that pool bounds concurrency.
    assert free.max_concurrent_requests == free.state_pool_requests == free.full_context_requests == 3
    assert free.concurrency_bound.startswith("state pool")
    assert capped.concurrency_bound == "--max-running-requests"
    assert capped.max_concurrent_requests == 100 and capped.state_pool_requests == 100
    room = capped.free_bytes_per_rank - 100 * capped.kda_state_bytes_per_request_per_rank
    assert capped.max_cached_tokens == room // 18_912


def test_dflash_draft_kv_ring_adds_15_percent_of_target_kv(k31):
    base = plan(k31, Layout(gpu_mem_gib=GB300_GIB))
    ring = plan(k31, Layout(gpu_mem_gib=GB300_GIB, speculative_algorithm="dflash"))
    off = plan(k31, Layout(gpu_mem_gib=GB300_GIB, speculative_algorithm="dflash", draft_kv_ring=False))
    assert ring.kv_bytes_per_token_per_rank == pytest.approx(1.15 * base.kv_bytes_per_token_per_rank)
    assert off.kv_bytes_per_token_per_rank == base.kv_bytes_per_token_per_rank


def test_pipeline_stages_hold_kv_and_weights_only_for_their_layers(k31):
    pp1 = plan(k31, Layout(gpus=8, tp=8, gpu_mem_gib=GB300_GIB))
    pp4 = plan(k31, Layout(gpus=32, tp=8, pp=4, pp_partition=[24, 24, 24, 21], gpu_mem_gib=GB300_GIB))
    dsa_per_stage = [sum(k31.layer_kinds[i] == "dsa" for i in st.layers) for st in pp4.stages]
    assert dsa_per_stage == [6, 6, 6, 6]
    assert pp4.kv_bytes_per_token_per_rank == 6 * 788
    assert pp4.weight_bytes_per_rank < pp1.weight_bytes_per_rank / 3


def test_prefill_context_parallel_copies_shard_no_memory(k31):
    """PCP 2 doubles the GPUs of one engine: each copy holds a stage's weights and every request's KV and state, so
    the per-GPU figures stay those of PP4 alone and one engine still serves one set of requests."""
    base = dict(tp=8, pp=4, pp_partition=[24, 24, 24, 21], gpu_mem_gib=GB300_GIB)
    pp4, pcp2 = plan(k31, Layout(gpus=32, **base)), plan(k31, Layout(gpus=64, pcp=2, **base))
    for field in ("weight_bytes_per_rank", "kv_bytes_per_token_per_rank", "kda_state_bytes_per_request_per_rank"):
        assert getattr(pcp2, field) == getattr(pp4, field)
    assert pcp2.attention_groups == pp4.attention_groups == 1
    assert pcp2.full_context_requests == pp4.full_context_requests
    assert "PCP2" in format_plan(pcp2) and any("--pcp" in a for a in pcp2.assumptions)


@pytest.mark.parametrize("family", ["kimi_linear", "deepseek_v32", "kimi_k3"])
def test_parameter_formula_matches_the_built_model(family):
    cfg = model_config_from_dict(preset_config(family, "small"))
    assert param_totals(cfg)[0] == param_count(build_model(cfg))


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--tp", "3"], "--tp"),
        (["--dcp", "16"], "--dcp"),
        (["--dp-attn", "3"], "--dp-attn"),
        (["--ep", "3"], "--ep"),
        (["--gpus", "64", "--tp", "64"], "--tp"),  # 96 KDA heads do not split 64 ways
        (["--pp", "4", "--pp-partition", "24,24,24,20", "--gpus", "32"], "--pp-partition"),
        (["--pcp", "2", "--gpus", "8"], "--pcp"),  # tp 8 × pcp 2 GPUs per engine
        (["--pcp", "2", "--dcp", "8", "--gpus", "16"], "--pcp"),
    ],
)
def test_bad_layout_exits_2_naming_the_flag(flags, flag, capsys):
    assert main(["plan", *flags]) == 2
    assert flag in capsys.readouterr().err


def test_bad_layout_raises_plan_error(k31):
    with pytest.raises(PlanError, match="--tp"):
        plan(k31, Layout(gpus=8, tp=3))


def test_cli_json_is_one_object_with_the_required_keys(capsys):
    argv = ["plan", "--gpu-mem-gib", "268", "--dcp", "8", "--speculative-algorithm", "dflash", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "weight_bytes_per_rank",
        "kv_bytes_per_token_per_rank",
        "kda_state_bytes_per_request_per_rank",
        "max_concurrent_requests",
        "max_cached_tokens",
        "full_context_requests",
    ):
        assert key in out
    assert out["model"] == "kimi-k3.1-pro" and out["layout"]["draft_kv_ring"] is True


def test_cli_prints_a_readable_table(capsys):
    assert main(["plan", "--gpu-mem-gib", "268"]) == 0
    out = capsys.readouterr().out
    assert "max concurrent requests" in out and "18,912.0 B" in out


def test_plans_a_real_checkpoint_folder(tmp_path, capsys):
    path = make_model("kimi_k3", "tiny", tmp_path / "m")
    assert main(["plan", str(path), "--gpus", "2", "--tp", "2", "--gpu-mem-gib", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = load_model_config(path)
    assert out["total_params"] == param_count(build_model(cfg))
    per_layer = kv_bytes_per_token_layer(cfg, "dsa", "fp8")
    assert out["kv_bytes_per_token_per_rank"] == per_layer * len(cfg.attention_layers)
    assert out["fits"] and out["full_context_requests"] >= 1


def test_default_plan_fits_and_reads_consistently(capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "2.8T params, 101.9B active" in out and "8 GPUs" in out
    rows = dict(line.split("  ", 1) for line in out.splitlines())
    pool = int(rows["state pool (requests per group)"].strip())
    concurrency = rows["max concurrent requests"].strip()
    assert pool >= 1 and concurrency.startswith(f"{pool} (bound: state pool")
    assert not rows["free per GPU"].strip().startswith("-")


def test_a_layout_that_does_not_fit_exits_2_with_one_line_reason(capsys):
    assert main(["plan", "--gpu-mem-gib", "141"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: this layout does not fit: weights need"), err
    assert main(["plan", "--max-running-requests", "5000", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["plan", "--gpu-mem-gib", "210", "--context-len", str(1 << 22)]) == 2
    assert "--context-len" in capsys.readouterr().err


def test_concurrency_is_the_smaller_of_the_cap_and_what_memory_holds(k31):
    capped = plan(k31, Layout(max_running_requests=10))
    assert capped.max_concurrent_requests == 10 and capped.concurrency_bound == "--max-running-requests"
    p = plan(k31, Layout(max_running_requests=5000))
    assert not p.fits and p.concurrency_bound == "memory: KDA state"
    assert p.max_concurrent_requests == p.free_bytes_per_rank // p.kda_state_bytes_per_request_per_rank


def test_small_model_counts_print_in_thousands_on_one_gpu(tmp_path, capsys):
    path = make_model("kimi_k3", "tiny", tmp_path / "m")
    assert main(["plan", str(path), "--gpus", "1", "--tp", "1", "--gpu-mem-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 GPU ·" in out and "0.0B" not in out
    assert re.search(r"\(\d+\.\dK params, \d+\.\dK active\)", out), out
