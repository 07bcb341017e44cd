"""LoRA adapters beside the frozen base: exactness against a merged-weight oracle, PEFT files, mixed-adapter rows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.models.checkpoint import export_state_dict, save_checkpoint
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers import cpu_kernels
from kestrel.models.loader import load_model
from kestrel.models.lora import LoRAManager, _disk_name, load_peft, lora_targets
from kestrel.models.simple_cache import full_logits
from kestrel.train.lora import attach_trainable, new_adapter, save_adapter

FAMILIES = ("kimi_linear", "deepseek_v32", "kimi_k3")
PROMPT = [5, 17, 3, 42, 9, 11, 28, 7, 1, 30, 2, 64, 8, 19, 23, 4, 6, 50, 13, 21]


def _all_targets(model) -> list[str]:
    return sorted({m.rsplit(".", 1)[-1] for m in lora_targets(model)})


def _randomise(adapter, seed: int):
    """Non-zero B so the adapter changes the output."""
    gen = torch.Generator().manual_seed(seed)
    for module, (a, b) in adapter.weights.items():
        adapter.weights[module] = (a, torch.randn(b.shape, generator=gen) * 0.05)
    return adapter


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_b_adapter_equals_base_exactly(tiny_checkpoints, family, monkeypatch):
    """Bit for bit through the same ops: the routed experts of an adapter run one GEMM pair per expert (the LoRA
    terms go between them), so the base runs them that way too, not through the compiled CPU experts kernel, whose
    tiles round differently (tests/test_cpu_kernels.py holds the kernel to the GEMMs within fp32 rounding)."""
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    model, _ = load_model(tiny_checkpoints[family])
    base = full_logits(model, PROMPT)
    manager = LoRAManager(model)
    manager.apply_to_all(manager.add(new_adapter(model, _all_targets(model), r=4, seed=1)))
    assert torch.equal(full_logits(model, PROMPT), base)


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_equals_merged_weight_oracle(tiny_checkpoints, family, tmp_path):
    """Oracle: W + (alpha/r)·B·A written into the unfused checkpoint tensor of each module, loaded by the loader."""
    model, cfg = load_model(tiny_checkpoints[family])
    targets = _all_targets(model)
    adapter = _randomise(new_adapter(model, targets, r=4, lora_alpha=8.0, seed=2), seed=3)
    state = export_state_dict(model)
    for module, (a, b) in adapter.weights.items():
        key = f"{_disk_name(cfg.model_type, module)}.weight"
        state[key] = state[key] + adapter.scale * b @ a  # out of place: exported tensors share the model's memory
    config = json.loads((tiny_checkpoints[family] / "config.json").read_text())
    save_checkpoint(model, config, tmp_path / "merged")
    save_file(state, tmp_path / "merged" / "model.safetensors", metadata={"format": "pt"})
    merged, _ = load_model(tmp_path / "merged")
    base = full_logits(model, PROMPT)
    manager = LoRAManager(model)
    manager.apply_to_all(manager.add(adapter))
    got, want = full_logits(model, PROMPT), full_logits(merged, PROMPT)
    assert (want - base).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # Never merged: the base's weights are untouched, and removing the adapter gives the base back exactly.
    manager.remove(adapter.name)
    assert torch.equal(full_logits(model, PROMPT), base)


def test_peft_format_round_trip(tiny_checkpoints, tmp_path):
    model, cfg = load_model(tiny_checkpoints["kimi_k3"])
    adapter = _randomise(new_adapter(model, ["q_proj", "o_proj", "gate_proj", "kv_a_proj_with_mqa"], r=4), seed=5)
    out = save_adapter(adapter, tmp_path / "ad", cfg.model_type)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == sorted(["q_proj", "o_proj", "gate_proj", "kv_a_proj_with_mqa"])
    keys = set(load_file(out / "adapter_model.safetensors"))
    module = next(m for m in adapter.weights if m.endswith("mlp.shared_experts.gate_proj"))
    disk = module.replace(".mlp.", ".block_sparse_moe.")
    assert {f"base_model.model.{disk}.lora_A.weight", f"base_model.model.{disk}.lora_B.weight"} <= keys
    assert len(keys) == 2 * len(adapter.weights)
    back = load_peft(out, name="x")
    assert back.r == 4 and back.lora_alpha == 16.0 and set(back.weights) == set(adapter.weights)
    for m, (a, b) in adapter.weights.items():
        assert torch.equal(back.weights[m][0], a) and torch.equal(back.weights[m][1], b)


def test_bad_adapters_are_rejected_naming_the_problem(tiny_checkpoints, tmp_path):
    model, cfg = load_model(tiny_checkpoints["kimi_linear"])
    adapter = new_adapter(model, ["o_proj"], r=4)
    save_adapter(adapter, tmp_path / "ok", cfg.model_type)
    (tmp_path / "nofile").mkdir()
    with pytest.raises(ValueError, match="missing adapter_config.json"):
        load_peft(tmp_path / "nofile")
    module = next(iter(adapter.weights))
    a, b = adapter.weights[module]
    adapter.weights[module] = (a[:, :-1], b)
    with pytest.raises(ValueError, match=rf"{module} lora_A"):
        LoRAManager(model).add(adapter)
    with pytest.raises(ValueError, match="max-lora-rank"):
        LoRAManager(model).add(load_peft(tmp_path / "ok"), max_rank=2)
    with pytest.raises(ValueError, match="target_modules"):
        new_adapter(model, ["kv_b_proj"])


def test_mixed_adapters_in_one_batch_equal_each_sequence_alone(tiny_checkpoints):
    """Rows of base, adapter 1 and adapter 2 in one forward: each sequence's logits as when it runs alone."""
    model, _ = load_model(tiny_checkpoints["kimi_k3"])
    targets = _all_targets(model)
    manager = LoRAManager(model)
    s1 = manager.add(_randomise(new_adapter(model, targets, r=4, name="a1", seed=1), seed=11))
    s2 = manager.add(_randomise(new_adapter(model, targets[:5], r=2, name="a2", seed=2), seed=12))
    seqs = [(PROMPT[:7], s1), (PROMPT[3:15], None), (PROMPT[::2], s2), (PROMPT[1:6], s1)]
    alone = []
    for ids, slot in seqs:
        manager.apply_to_all(slot)
        alone.append(full_logits(model, ids))
    flat = [t for ids, _ in seqs for t in ids]
    batch = ForwardBatch(
        torch.tensor(flat),
        torch.tensor([p for ids, _ in seqs for p in range(len(ids))]),
        [len(ids) for ids, _ in seqs],
        [0] * len(seqs),
    )
    manager.set_rows([slot for ids, slot in seqs for _ in ids])
    with torch.inference_mode():
        logits = model.logits(model(batch))
    for i, want in enumerate(alone):
        torch.testing.assert_close(logits[batch.seq_slice(i)], want, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(alone[0], full_logits_base(model, manager, PROMPT[:7]), atol=1e-3)


def full_logits_base(model, manager, ids):
    manager.apply_to_all(None)
    return full_logits(model, ids)


def test_training_updates_only_the_adapter(tiny_checkpoints, tmp_path):
    model, cfg = load_model(tiny_checkpoints["deepseek_v32"])
    base = full_logits(model, PROMPT)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = new_adapter(model, ["q_b_proj", "o_proj", "down_proj"], r=4)
    manager, params = attach_trainable(model, adapter)
    opt = torch.optim.SGD(params, lr=0.5)
    ids = torch.tensor(PROMPT)
    for _ in range(3):
        logits = model.logits(model(ForwardBatch.single(ids[:-1])))
        loss = torch.nn.functional.cross_entropy(logits, ids[1:])
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in params)
        opt.step()
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters())
    assert not torch.allclose(full_logits(model, PROMPT), base, atol=1e-4)
    # What was trained is what a fresh model reads back from the PEFT files.
    save_adapter(adapter, tmp_path / "trained", cfg.model_type)
    fresh, _ = load_model(tiny_checkpoints["deepseek_v32"])
    other = LoRAManager(fresh)
    other.apply_to_all(other.add(load_peft(tmp_path / "trained")))
    torch.testing.assert_close(full_logits(fresh, PROMPT), full_logits(model, PROMPT), atol=1e-6, rtol=1e-6)
