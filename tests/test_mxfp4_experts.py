"""MXFP4 routed experts: the Hugging Face `*_blocks` / `*_scales` layout, kept packed, and a forward that equals the
same model with the dequantized experts in full precision."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kestrel import LLM, SamplingParams
from kestrel.cli import main
from kestrel.config import ConfigError, model_config_from_dict
from kestrel.models.checkpoint import make_model, with_mxfp4_experts
from kestrel.models.layers.moe import Experts, expert_segments
from kestrel.models.layers.moe_mxfp4 import MXFP4Experts, expert_bytes, mxfp4_expert_segments
from kestrel.models.loader import build_model, load_model, param_count
from kestrel.models.presets import preset_config
from kestrel.models.simple_cache import greedy_generate
from kestrel.quant.fp4 import mxfp4_quantize

# gpt-oss / transformers' FP4 table and unpacking (low nibble first, scale 2^(s − 127)), restated independently.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def hf_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(FP4_VALUES)
    *prefix, g, b = blocks.shape
    out = torch.empty(*prefix, g, 2 * b)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    out = torch.ldexp(out, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(*prefix, g * 2 * b)


@pytest.fixture(scope="module")
def mxfp4_k3(tmp_path_factory):
    return make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("k3mx"), seed=5, weight_format="mxfp4")


def test_checkpoint_holds_hf_blocks_and_scales_and_keeps_the_rest_high_precision(mxfp4_k3):
    config = json.loads((mxfp4_k3 / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    cfg = model_config_from_dict(config)
    d, inter, e = cfg.routed_expert_hidden_size or cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    with safe_open(mxfp4_k3 / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        layer = cfg.mlp_kinds.index("moe")
        prefix = f"model.layers.{layer}.block_sparse_moe.experts."
        blocks, scales = f.get_tensor(prefix + "gate_up_proj_blocks"), f.get_tensor(prefix + "gate_up_proj_scales")
        assert blocks.dtype == scales.dtype == torch.uint8
        assert blocks.shape == (e, 2 * inter, d // 32, 16) and scales.shape == (e, 2 * inter, d // 32)
        assert f.get_tensor(prefix + "down_proj_blocks").shape == (e, d, inter // 32, 16)
        assert not [n for n in names if ".experts." in n and n.endswith(".weight")]  # no dense routed expert
        for n in names:  # routers, norms, KDA decay, indexer and shared experts stay floating point
            if any(k in n for k in ("gate.weight", "A_log", "dt_bias", "indexer", "norm", "shared_experts")):
                assert f.get_tensor(n).is_floating_point(), n
    model, _ = load_model(mxfp4_k3)
    module = next(m for m in model.modules() if isinstance(m, MXFP4Experts))
    assert torch.equal(module.gate_up_proj_blocks, blocks)
    gate_up, _ = module.dense()
    assert torch.equal(gate_up, hf_dequantize(blocks, scales))  # Kestrel reads the layout as transformers does
    packed, bf16 = expert_bytes(model)
    assert packed / bf16 == pytest.approx(4.25 / 16)  # 4 bits + one E8M0 byte per 32 values, vs 16 bits
    assert not any(isinstance(m, Experts) for m in model.modules())


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_packed_segments_equal_the_dense_mixture_of_dequantized_weights(tokens):
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, k = 6, 64, 32, 2
    gate_up, down = (
        torch.randn(experts, 2 * inter, hidden, generator=gen),
        torch.randn(experts, hidden, inter, generator=gen),
    )
    x, weights = torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, k, generator=gen)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[:k] for _ in range(tokens)])
    gu_b, gu_s = mxfp4_quantize(gate_up)
    d_b, d_s = mxfp4_quantize(down)
    gu_b, d_b = gu_b.view(experts, 2 * inter, hidden // 32, 16), d_b.view(experts, hidden, inter // 32, 16)
    with torch.no_grad():
        packed = mxfp4_expert_segments(x, ids, weights, gu_b, gu_s, d_b, d_s, "situ", 4.0, 8.0)
        dense = expert_segments(x, ids, weights, hf_dequantize(gu_b, gu_s), hf_dequantize(d_b, d_s), "situ", 4.0, 8.0)
        unquantized = expert_segments(x, ids, weights, gate_up, down, "situ", 4.0, 8.0)
    assert torch.allclose(packed, dense, atol=1e-4)
    assert not torch.allclose(packed, unquantized, atol=1e-3)  # the weights really are 4-bit


def test_engine_on_mxfp4_experts_equals_the_dequantized_model(mxfp4_k3):
    """Token for token, the packed model computes what the same model with dequantized dense experts computes."""
    packed, _ = load_model(mxfp4_k3)
    config = json.loads((mxfp4_k3 / "config.json").read_text())
    del config["quantization_config"]
    dense = build_model(model_config_from_dict(config))
    state = {k: v for k, v in packed.state_dict().items() if not k.endswith(("_blocks", "_scales"))}
    dense.load_state_dict(state, strict=False)
    for name, module in packed.named_modules():
        if isinstance(module, MXFP4Experts):
            target = dense.get_submodule(name)
            target.gate_up_proj.data, target.down_proj.data = module.dense()
    prompt = list(range(3, 40))
    tokens, logits = greedy_generate(packed, prompt, 8)
    ref_tokens, ref_logits = greedy_generate(dense, prompt, 8)
    assert tokens == ref_tokens and torch.allclose(logits, ref_logits, atol=1e-4)
    llm = LLM(str(mxfp4_k3), max_total_tokens=1024, chunked_prefill_size=8)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == tokens


def test_mxfp4_experts_need_widths_divisible_by_32():
    config = preset_config("deepseek_v32", "tiny")
    config["moe_intermediate_size"] = 48
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        model_config_from_dict(config)


def test_conversion_keeps_every_non_expert_tensor(tiny_checkpoints):
    dense, _ = load_model(tiny_checkpoints["deepseek_v32"])
    config = json.loads((tiny_checkpoints["deepseek_v32"] / "config.json").read_text())
    packed, new_config = with_mxfp4_experts(dense, config)
    assert new_config["quantization_config"]["quant_method"] == "mxfp4" and "quantization_config" not in config
    assert param_count(packed) == param_count(dense)  # packed bytes count as the weights they hold
    dense_state, packed_state = dense.state_dict(), packed.state_dict()
    for name, tensor in packed_state.items():
        if not name.endswith(("_blocks", "_scales")):
            assert torch.equal(tensor, dense_state[name]), name


def test_make_model_cli_writes_and_converts_mxfp4_checkpoints(tiny_checkpoints, tmp_path, capsys):
    assert (
        main(["make-model", "--family", "deepseek_v32", "--out", str(tmp_path / "r"), "--weight-format", "mxfp4"]) == 0
    )
    assert "resident in MXFP4" in capsys.readouterr().out
    src = tiny_checkpoints["kimi_k3"]
    assert main(["make-model", "--from", str(src), "--out", str(tmp_path / "c"), "--weight-format", "mxfp4"]) == 0
    converted, cfg = load_model(tmp_path / "c")
    dense, _ = load_model(src)
    assert cfg.routed_expert_format == "mxfp4"
    packed = next(m for m in converted.modules() if isinstance(m, MXFP4Experts))
    original = next(m for m in dense.modules() if isinstance(m, Experts))
    for dequantized, weight in zip(packed.dense(), (original.gate_up_proj, original.down_proj)):
        blocks, scales = mxfp4_quantize(weight.detach())  # Kestrel's quantizer on the source weights
        assert torch.equal(dequantized, hf_dequantize(blocks.view(*scales.shape, 16), scales))
    assert main(["make-model", "--out", str(tmp_path / "x")]) == 2  # neither --family nor --from
