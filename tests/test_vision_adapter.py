"""A checkpoint's vision adapter (`vision-lora/`): image requests run on it, text requests never do, and an adapter
trained against other weights is not loaded (kestrel/engine/vision_adapter.py)."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from kestrel import LLM, SamplingParams
from kestrel.chat_template import render_chat
from kestrel.engine.vision_adapter import ADAPTER_DIR, BASE_FILE, VISION_ADAPTER, adapter_mismatch, base_weights
from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.models.simple_cache import greedy_generate
from kestrel.train.vision_stage import run_vision_stage, ship_vision

NEW = 6


@pytest.fixture(scope="module")
def seeing(tiny_checkpoints, tmp_path_factory):
    """A tiny K3 text model + the tiny vision stage with a rank-4 adapter, shipped the way kestrel-mini is. B is
    made large so that the adapter visibly changes every output it touches."""
    base = tiny_checkpoints["kimi_k3"]
    trainer = run_vision_stage("tiny", base, tmp_path_factory.mktemp("vision_run"), steps=1, lora_rank=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, b in trainer.adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=gen))
    target = tmp_path_factory.mktemp("seeing")
    shutil.copytree(base, target, dirs_exist_ok=True)
    ship_vision(trainer, target, "tiny", target)
    return target


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8))


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _prompts(llm: LLM):
    """Two image prompts and one text prompt: (token ids, images or None)."""
    image_chat = render_chat(
        [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True,
    )
    text_chat = render_chat([{"role": "user", "content": "What is 3 + 4?"}], add_generation_prompt=True)
    first = llm.image_prompt(image_chat, [_image(0)])
    second = llm.image_prompt(image_chat, [_image(1)])
    return [first, second, (llm.engine.encode(text_chat), None)]


def _run(llm: LLM, **kwargs):
    prompts = _prompts(llm)
    outs = llm.generate([p for p, _ in prompts], _greedy(), images=[im for _, im in prompts], use_tqdm=False, **kwargs)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_ship_records_the_weights_the_adapter_was_trained_against(seeing):
    assert (seeing / ADAPTER_DIR / "adapter_config.json").is_file()
    recorded = json.loads((seeing / ADAPTER_DIR / BASE_FILE).read_text())
    assert recorded == base_weights(seeing) and adapter_mismatch(seeing) is None
    summary = json.loads((seeing / "training_summary.json").read_text())
    assert summary["vision"]["lora_rank"] == 4


def test_image_requests_run_on_the_vision_adapter_and_text_requests_never_do(seeing):
    llm = LLM(str(seeing), max_total_tokens=2048, page_size=8)
    assert VISION_ADAPTER in llm.engine.lora_names
    served = _run(llm)
    # The engine's answers equal the single-request reference with the adapter on every row for images, and with
    # no adapter for text.
    prompts = _prompts(llm)
    lora = llm.engine.lora
    for (ids, images), (tokens, _) in zip(prompts, served):
        lora.apply_to_all(lora.slot_of(VISION_ADAPTER) if images else None)
        assert tokens == greedy_generate(llm.engine.model, ids, NEW, images)[0]
    lora.apply_to_all(None)
    # A step with no image row runs with the adapter's hooks off the projections (no per-call hook cost).
    text_ids, _ = prompts[2]
    alone = llm.generate([text_ids], _greedy(), use_tqdm=False)[0].outputs[0]
    assert not lora.attached and alone.token_ids == served[2][0]
    assert alone.logprobs == pytest.approx(served[2][1], abs=1e-5)
    # Naming the adapter gives the same as leaving it to the engine.
    named = _run(llm, lora_name=[VISION_ADAPTER, VISION_ADAPTER, None])
    assert [t for t, _ in named] == [t for t, _ in served]
    for (_, a), (_, b) in zip(named, served):
        assert a == pytest.approx(b, abs=1e-5)

    off = LLM(str(seeing), max_total_tokens=2048, page_size=8, vision_adapter=False)
    assert off.engine.lora is None and VISION_ADAPTER not in off.engine.lora_names
    plain = _run(off)
    for (_, on_lps), (_, off_lps) in zip(served[:2], plain[:2]):  # images: the adapter moved every logprob
        assert all(abs(a - b) > 1e-6 for a, b in zip(on_lps, off_lps))
    assert served[2] == plain[2]  # text: byte-for-byte the base's


@pytest.mark.parametrize("moved", ["tower", "text", "record"])
def test_an_adapter_trained_on_other_weights_is_not_loaded(seeing, tmp_path, moved, caplog):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(seeing, ckpt)
    if moved == "record":
        (ckpt / ADAPTER_DIR / BASE_FILE).unlink()
    else:
        tensors = load_file(ckpt / "model.safetensors")
        name = next(n for n in sorted(tensors) if n.startswith("vision_tower.") == (moved == "tower"))
        tensors[name] = tensors[name] + 1
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert adapter_mismatch(ckpt) is not None
    with caplog.at_level(logging.WARNING, logger="kestrel.engine.vision_adapter"):
        llm = LLM(str(ckpt), max_total_tokens=1024, page_size=8)
    assert VISION_ADAPTER not in llm.engine.lora_names
    assert any("not loading the vision adapter" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_compiled_decode_serves_text_steps_and_image_steps_run_eagerly(seeing):
    """--compile with the vision adapter: graphs traced at start-up serve base-only decode steps without a
    recompilation; steps with adapter rows run eagerly; tokens equal the eager engine's."""
    from torch._dynamo.utils import counters

    eager_llm = LLM(str(seeing), max_total_tokens=2048, page_size=8)
    eager = _run(eager_llm)
    llm = LLM(str(seeing), max_total_tokens=2048, page_size=8, compile=True, compile_max_bs=2)
    graphs_at_start_up = counters["stats"]["unique_graphs"]
    compiled_step, call = llm.engine.runner.compiled.__class__, llm.engine.runner.compiled.__class__.__call__
    ran = []
    compiled_step.__call__ = lambda self, batch: (ran.append(batch.num_seqs), call(self, batch))[1]
    try:
        mixed = _run(llm)  # every decode step has adapter rows: eager
        assert not ran
        text_ids, _ = _prompts(llm)[2]
        alone = llm.generate([text_ids], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        compiled_step.__call__ = call
    assert ran, "the text request's decode steps ran compiled"
    assert counters["stats"]["unique_graphs"] == graphs_at_start_up
    assert [t for t, _ in mixed] == [t for t, _ in eager] and alone == eager[2][0]


def test_the_shipped_vision_adapter_was_trained_on_the_shipped_model():
    """Retraining kestrel-mini's text model or tower without retraining its vision adapter fails here."""
    assert (EMBEDDED_DIR / ADAPTER_DIR).is_dir(), "kestrel-mini ships its vision adapter"
    assert adapter_mismatch(EMBEDDED_DIR) is None
