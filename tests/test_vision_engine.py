"""Engine invariants with images (kimi_k3 + a tiny MoonViT: KDA, DSA and the tower): batched = alone, chunked
prefill through an image = whole, the tower runs once per image, prefix-cache hit on a repeated image = cold, a
different image at the same position never hits, and the disk tier keys images by content across restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kestrel import LLM, SamplingParams
from kestrel.chat_template import IMAGE_MARKER, render_chat
from kestrel.models.checkpoint import make_model
from kestrel.models.simple_cache import greedy_generate

NEW = 5
PAGE = 8


@pytest.fixture(scope="module")
def k3_vision(tmp_path_factory):
    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("k3_vision"), seed=11, vision="tiny"))


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _chat(text: str, n_images: int) -> str:
    content = [{"type": "image_url"}] * n_images + [{"type": "text", "text": text}]
    return render_chat([{"role": "user", "content": content}], add_generation_prompt=True)


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def _reference(llm: LLM, prompt: list[int], images) -> tuple[list[int], list[float]]:
    tokens, logits = greedy_generate(llm.engine.model, prompt, NEW, images)
    lp = torch.log_softmax(logits, dim=-1)
    return tokens, [float(lp[i, t]) for i, t in enumerate(tokens)]


def _assert_exact(llm: LLM, prompts, images, outputs) -> None:
    for prompt, ims, out in zip(prompts, images, outputs):
        tokens, lps = _reference(llm, prompt, ims)
        assert out.outputs[0].token_ids == tokens
        assert out.outputs[0].logprobs == pytest.approx(lps, abs=1e-4)


def _requests(llm: LLM):
    """Six prompts: one, two or no images of several shapes (4, 12 and 15 placeholders), one image shared."""
    pics = [_image(56, 56, 0), _image(84, 112, 1), _image(140, 70, 2), _image(84, 112, 3)]
    specs = [
        ("a square", [0]),
        ("two of them", [1, 2]),
        ("plain text, no image at all", []),
        ("the first again", [0]),
        ("wide", [3]),
        ("tall then square", [2, 0]),
    ]
    prompts, images = [], []
    for text, which in specs:
        ids, processed = llm.image_prompt(_chat(text, len(which)), [pics[i] for i in which])
        prompts.append(ids)
        images.append(processed or None)
    return prompts, images


def test_batched_requests_chunked_through_images_match_each_alone_and_whole(k3_vision):
    """Chunks of 5 tokens cut every image span (4, 12, 15 placeholders) across steps; the reference is each
    request alone, prefilled whole."""
    llm = LLM(k3_vision, max_total_tokens=4096, chunked_prefill_size=5, page_size=PAGE)
    prompts, images = _requests(llm)
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False, images=images)
    _assert_exact(llm, prompts, images, outputs)
    stats = llm.engine.stats()
    distinct = len({im.content_hash for ims in images if ims for im in ims})
    assert stats["images_encoded"] == distinct == 4  # image 0 appears three times, is encoded once
    assert stats["vision_tower_runs"] <= distinct  # and no image twice, though its span took several steps


def test_repeated_image_hits_the_prefix_cache_and_a_different_image_never_does(k3_vision):
    args = dict(max_total_tokens=4096, page_size=PAGE, state_track_interval=PAGE, chunked_prefill_size=64)
    llm = LLM(k3_vision, **args)
    cold = LLM(k3_vision, enable_prefix_caching=False, **args)
    a, b = _image(84, 112, 5), _image(84, 112, 6)  # same shape: identical token ids, different pixels
    text = "Describe this picture in detail please, as long as it takes."
    turn1, (pa,) = llm.image_prompt(_chat(text, 1), [a])
    first = llm.generate([turn1], _greedy(), use_tqdm=False, images=[[pa]])[0].outputs[0]
    span_end = turn1.index(pa_id := llm.engine.model_config.vision.image_token_id) + pa.num_tokens

    follow = turn1 + first.token_ids + llm.engine.encode("And the colours?")
    hit = llm.generate([follow], _greedy(), use_tqdm=False, images=[[pa]])[0].outputs[0]
    assert hit.cached_tokens >= span_end  # the image's pages were reused, not recomputed
    assert hit.token_ids == cold.generate([follow], _greedy(), use_tqdm=False, images=[[pa]])[0].outputs[0].token_ids

    other, (pb,) = llm.image_prompt(_chat(text, 1), [b])
    assert other == turn1  # the token ids alone cannot tell the two images apart
    miss = llm.generate([other], _greedy(), use_tqdm=False, images=[[pb]])[0].outputs[0]
    assert miss.cached_tokens <= turn1.index(pa_id)  # at most the text before the image
    assert miss.token_ids == cold.generate([other], _greedy(), use_tqdm=False, images=[[pb]])[0].outputs[0].token_ids
    assert llm.engine.stats()["images_encoded"] == 2


def test_disk_tier_reuses_an_image_prefix_after_a_restart(k3_vision, tmp_path):
    """HiCache unchanged: an image's pages written to disk are found again by a fresh engine (content keys are
    stable across processes), and the answer equals the cold one."""
    args = dict(max_total_tokens=4096, page_size=PAGE, state_track_interval=PAGE, chunked_prefill_size=64)
    tiers = dict(hicache_storage_dir=str(tmp_path), hicache_write_policy="write_through")
    first = LLM(k3_vision, **args, **tiers)
    prompt, (image,) = first.image_prompt(_chat("What is in the picture, exactly?", 1), [_image(84, 112, 7)])
    first.generate([prompt], _greedy(), use_tqdm=False, images=[[image]])
    first.engine.close()
    again = LLM(k3_vision, **args, **tiers)
    longer = prompt + again.engine.encode("More, please.")
    out = again.generate([longer], _greedy(), use_tqdm=False, images=[[image]])[0].outputs[0]
    assert out.cached_tokens_by_tier["disk"] >= prompt.index(again.engine.model_config.vision.image_token_id) + 12
    cold = LLM(k3_vision, enable_prefix_caching=False, **args)
    assert out.token_ids == cold.generate([longer], _greedy(), use_tqdm=False, images=[[image]])[0].outputs[0].token_ids


def test_bad_image_requests_are_refused_naming_the_field(k3_vision, tiny_checkpoints):
    llm = LLM(k3_vision, max_total_tokens=1024)
    ids, images = llm.image_prompt(_chat("hi", 1), [_image(56, 56, 0)])
    with pytest.raises(ValueError, match="images"):
        llm.engine.add_request(ids, _greedy(), images=images + images)  # two images, one run
    first = ids.index(llm.engine.model_config.vision.image_token_id)
    with pytest.raises(ValueError, match=r"images\[0\]"):
        llm.engine.add_request(ids[:first] + ids[first + 1 :], _greedy(), images=images)  # one placeholder short
    text_only = LLM(str(tiny_checkpoints["kimi_k3"]), max_total_tokens=1024)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.engine.add_request(ids, _greedy(), images=images)
    assert IMAGE_MARKER in _chat("x", 1)
