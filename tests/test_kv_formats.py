"""Quantized KV cache (`--kv-cache-dtype fp8_e4m3|nvfp4`): byte layouts, what the pool stores, engine invariants
within each format, HiCache moving the quantized bytes, and capacity agreeing with `kestrel plan`."""

from __future__ import annotations

import json

import pytest
import torch

import kestrel.engine.capacity as capacity_module
from kestrel import LLM, SamplingParams
from kestrel.cache.kv_pool import QuantizedKVStorage, kv_bytes_per_token
from kestrel.cli import main
from kestrel.config import ConfigError
from kestrel.engine.config import EngineConfig
from kestrel.plan import kimi_k31_pro_config, kv_bytes_per_token_layer, resolve_model
from kestrel.quant.fp4 import mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize
from kestrel.quant.fp8 import fp8_dequantize_groups, fp8_quantize_groups
from kestrel.quant.kv_formats import KVTokenLayout

FORMATS = ["fp8_e4m3", "nvfp4"]
PLAN_FORMAT = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4"}
PAGE = 8


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 259, (int(k),), generator=gen).tolist() for k in torch.randint(lo, hi, (n,), generator=gen)
    ]


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def test_k31_token_bytes_are_flashmla_656_132_and_nvfp4_416_68():
    fp8 = KVTokenLayout("fp8_e4m3", 512, 64, 128)
    nv = KVTokenLayout("nvfp4", 512, 64, 128)
    assert (fp8.latent_bytes, fp8.index_bytes) == (512 + 4 * 4 + 64 * 2, 128 + 4) == (656, 132)
    assert (nv.latent_bytes, nv.index_bytes) == (256 + 32 + 128, 64 + 4) == (416, 68)
    k31 = kimi_k31_pro_config()
    for fmt in FORMATS:  # the engine's pool sizer and the planner count the same bytes
        want = sum(kv_bytes_per_token_layer(k31, k31.layer_kinds[i], PLAN_FORMAT[fmt]) for i in k31.attention_layers)
        assert kv_bytes_per_token(k31, torch.bfloat16, fmt) == want
    assert kv_bytes_per_token(k31, torch.bfloat16, "fp8_e4m3") == 24 * 788
    assert kv_bytes_per_token(k31, torch.bfloat16, "nvfp4") == 24 * 484


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_round_trip_through_the_format_quantizers(fmt):
    g = torch.Generator().manual_seed(0)
    lay = KVTokenLayout(fmt, 512, 64, 128)
    latent, rope, index = (
        torch.randn(5, 512, generator=g),
        torch.randn(5, 64, generator=g),
        torch.randn(5, 128, generator=g),
    )
    gs = nvfp4_global_scale(40.0)
    rows, irows = lay.encode_latent(latent, rope, gs), lay.encode_index(index)
    assert (
        rows.dtype == irows.dtype == torch.uint8
        and rows.shape == (5, lay.latent_bytes)
        and irows.shape == (5, lay.index_bytes)
    )
    got_latent, got_rope = lay.decode_latent(rows.view(1, 5, -1), gs, torch.float32)  # leading dims pass through
    if fmt == "fp8_e4m3":
        want_latent = fp8_dequantize_groups(*fp8_quantize_groups(latent, 128))
        want_index = fp8_dequantize_groups(*fp8_quantize_groups(index, 128))
    else:
        want_latent = nvfp4_dequantize(*nvfp4_quantize(latent, gs), gs)
        want_index = mxfp4_dequantize(*mxfp4_quantize(index))
    assert torch.equal(got_latent[0], want_latent) and torch.equal(got_rope[0], rope.bfloat16().float())
    assert torch.equal(lay.decode_index(irows, torch.float32), want_index)
    assert not torch.equal(want_latent, latent)  # it is quantized


@pytest.mark.parametrize("fmt", FORMATS)
def test_pool_stores_quantized_bytes_of_the_same_latents(fmt, tiny_checkpoints):
    """The first attention layer sees the same latents in both runs: the pool holds exactly their quantized form."""
    path, prompt = str(tiny_checkpoints["deepseek_v32"]), _prompts(1, 4, 40, 41)[0]
    ref = LLM(path, max_total_tokens=256, page_size=PAGE)
    q = LLM(path, max_total_tokens=256, page_size=PAGE, kv_cache_dtype=fmt)
    for llm in (ref, q):
        llm.generate([prompt], _greedy(1), use_tqdm=False)
    kv, ref_kv = q.engine.runner.kv, ref.engine.runner.kv
    assert isinstance(kv, QuantizedKVStorage)
    layer = q.engine.model_config.attention_layers[0]
    lay = kv.layouts[layer]
    assert kv.latent[layer].dtype == torch.uint8 and kv.latent[layer].shape[1] == lay.latent_bytes
    # The finished prompt's full pages stay in the prefix cache, on the same page ids in both engines.
    page_ids = [pg for child in q.engine.cache.root.children.values() for pg in child.pages]
    assert page_ids
    slots = torch.tensor([p * PAGE + o for p in page_ids for o in range(PAGE)])
    ref_latent, ref_rope = ref_kv.read(layer, slots)
    gs = kv.global_scale[layer]
    want = lay.decode_latent(lay.encode_latent(ref_latent, ref_rope, gs), gs, torch.float32)
    got = kv.read(layer, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if fmt == "nvfp4":  # the layer scale bounds |latent| (max|γ|·√r): no e4m3 block scale reaches 448 and saturates
        block_scales = kv.latent[layer][slots][:, lay.rank // 2 : lay.rank // 2 + lay.rank // 16]
        assert int((block_scales & 0x7F).max()) < 0x7E
    want_index = lay.decode_index(lay.encode_index(ref_kv.read_index(layer, slots)), torch.float32)
    assert torch.equal(kv.read_index(layer, slots), want_index)


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v32"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_and_chunked_equal_alone_and_whole_within_format(family, fmt, tiny_checkpoints):
    path = str(tiny_checkpoints[family])
    prompts = _prompts(8, 2)
    alone = LLM(path, max_total_tokens=1024, kv_cache_dtype=fmt, chunked_prefill_size=-1, enable_prefix_caching=False)
    ref = [alone.generate([p], _greedy(), use_tqdm=False)[0].outputs[0] for p in prompts]
    batched = LLM(path, max_total_tokens=2048, kv_cache_dtype=fmt, chunked_prefill_size=7, page_size=PAGE)
    for r, out in zip(ref, batched.generate(prompts, _greedy(), use_tqdm=False)):
        assert out.outputs[0].token_ids == r.token_ids
        assert out.outputs[0].logprobs == pytest.approx(r.logprobs, abs=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_hit_equals_cold_and_host_tier_moves_quantized_pages(fmt, tiny_checkpoints):
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=16, chunked_prefill_size=64, state_track_interval=32, max_running_requests=2)
    cold = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, kv_cache_dtype=fmt, **args)
    hi = LLM(
        path, max_total_tokens=256, hicache_size=0.05, hicache_write_policy="write_back", kv_cache_dtype=fmt, **args
    )
    histories = {0: _prompts(1, 11, 120, 121)[0], 1: _prompts(1, 12, 120, 121)[0]}
    cached = 0
    for _ in range(3):
        for s in (0, 1):  # each session's turn evicts the other's pages to the host tier
            out = hi.generate([histories[s]], _greedy(5), use_tqdm=False)[0].outputs[0]
            ref = cold.generate([histories[s]], _greedy(5), use_tqdm=False)[0].outputs[0]
            assert out.token_ids == ref.token_ids
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            cached += out.cached_tokens
            histories[s] = histories[s] + out.token_ids + _prompts(1, 20 + s, 20, 21)[0]
    stats = hi.engine.stats()
    assert cached > 0 and stats["prefix_cache_host_hit_tokens"] > 0
    io = hi.engine.cache.io
    assert io.packed_bytes_per_token == kv_bytes_per_token(hi.engine.model_config, torch.float32, fmt)
    packed = io.gather_pages([0, 1])
    assert packed.dtype == torch.uint8 and packed.shape == (2, 16, io.packed_bytes_per_token)


@pytest.mark.parametrize("fmt", FORMATS)
def test_disk_tier_restart_reuses_quantized_pages(fmt, tiny_checkpoints, tmp_path):
    path = str(tiny_checkpoints["kimi_k3"])
    args = dict(page_size=16, chunked_prefill_size=64, state_track_interval=32, kv_cache_dtype=fmt)
    prompt = _prompts(1, 5, 150, 151)[0]
    off = LLM(path, max_total_tokens=4096, enable_prefix_caching=False, **args)
    expected = off.generate([prompt + [7, 8, 9]], _greedy(), use_tqdm=False)[0].outputs[0]
    first = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), **args)
    first.generate([prompt], _greedy(), use_tqdm=False)
    first.engine.close()
    second = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), **args)
    out = second.generate([prompt + [7, 8, 9]], _greedy(), use_tqdm=False)[0].outputs[0]
    assert out.cached_tokens_by_tier["disk"] >= 128
    assert out.token_ids == expected.token_ids and out.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    # Another format must not read these pages: the cache namespace names the KV format.
    other = "nvfp4" if fmt == "fp8_e4m3" else "auto"
    third = LLM(path, max_total_tokens=4096, hicache_storage_dir=str(tmp_path), **(args | {"kv_cache_dtype": other}))
    assert third.generate([prompt + [7, 8, 9]], _greedy(), use_tqdm=False)[0].outputs[0].cached_tokens == 0


def test_engine_capacity_equals_kestrel_plan_per_format(tiny_checkpoints, monkeypatch, capsys):
    """Same free memory: the engine's KV token capacity is what `kestrel plan --kv-format F` prints, per format."""
    path = str(tiny_checkpoints["deepseek_v32"])  # no KDA layers: the budget is all KV
    capacity = {}
    for fmt in FORMATS:
        flags = ["--gpus", "1", "--tp", "1", "--gpu-mem-gib", "0.02", "--mem-fraction", "1", "--kv-format", fmt]
        assert main(["plan", path, *flags, "--max-running-requests", "4", "--json"]) == 0
        p = json.loads(capsys.readouterr().out)
        monkeypatch.setattr(capacity_module, "free_memory_bytes", lambda device, free=p["free_bytes_per_rank"]: free)
        llm = LLM(path, kv_cache_dtype=fmt, mem_fraction=1.0, page_size=1, max_running_requests=4096)
        assert llm.engine.kv_bytes_per_token == p["kv_bytes_per_token_per_rank"]
        capacity[fmt] = llm.engine.pages.num_pages
        assert capacity[fmt] == p["max_cached_tokens"] > 1000
    per_token = {fmt: kv_bytes_per_token(resolve_model(path), torch.float32, fmt) for fmt in FORMATS}
    ratio = capacity["nvfp4"] / capacity["fp8_e4m3"]
    assert ratio == pytest.approx(per_token["fp8_e4m3"] / per_token["nvfp4"], rel=1e-3) and ratio > 1.5


def test_bad_kv_cache_dtype_and_unfit_widths_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_lora_rank 24 must be a multiple of 16"):
        KVTokenLayout("nvfp4", 24, 8, 32)
    with pytest.raises(ValueError, match="index_head_dim 48 must be a multiple of 32"):
        KVTokenLayout("nvfp4", 32, 8, 48)
