"""MoonViT tower, merger, projector and preprocessing against transformers' Kimi_K25ForConditionalGeneration and
Kimi_K25ImageProcessor (tiny random checkpoint in K2.5's hub layout), plus the vision config parser."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_fixtures import HF_K25_TOKENS, hf_image_processor, save_hf_kimi_k25
from PIL import Image

from kestrel.config import ConfigError, model_config_from_dict
from kestrel.models.loader import load_model
from kestrel.models.simple_cache import full_logits
from kestrel.models.vision.preprocess import ImageError, load_image, preprocess_image

# (height, width): square = the 6x6 position table itself, wide, tall, odd sizes that need padding, tiny.
SIZES = [(84, 84), (70, 130), (200, 60), (45, 101), (29, 31)]
IMAGE, START, END = HF_K25_TOKENS["image_token_id"], HF_K25_TOKENS["vision_start_token_id"], 303


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_kimi_k25")
    hf = save_hf_kimi_k25(path, seed=8)
    model, cfg = load_model(path)
    return hf, model, cfg, path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Random-pixel PNGs of every size, plus RGBA, greyscale and palette ones (the RGB conversion rules)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"rgb{i}.png")
        paths.append(root / f"rgb{i}.png")
    Image.fromarray(rng.integers(0, 256, (50, 64, 4), dtype=np.uint8), "RGBA").save(root / "rgba.png")
    Image.fromarray(rng.integers(0, 256, (40, 90), dtype=np.uint8), "L").save(root / "grey.png")
    Image.fromarray(rng.integers(0, 256, (300, 420, 3), dtype=np.uint8)).convert("P").save(root / "palette.png")
    return paths + [root / "rgba.png", root / "grey.png", root / "palette.png"]


def _tower_inputs(paths, vision):
    processed = [preprocess_image(Image.open(p), vision) for p in paths]
    return processed, torch.cat([p.pixel_values for p in processed]), [p.grid for p in processed]


def test_hub_layout_fixture_is_what_transformers_reads_back(k25):
    """The checkpoint Kestrel loads has K2.5's original names; transformers converts them to exactly its weights."""
    import transformers

    hf, _, _, path = k25
    again = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(path).eval()
    ours, theirs = hf.state_dict(), again.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with open(path / "model.safetensors", "rb") as f:
        names = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names and "language_model.lm_head.weight" in names


@torch.no_grad()
def test_tower_and_image_features_match_transformers_for_every_aspect_ratio(k25, images):
    hf, model, cfg, _ = k25
    _, pixels, grids = _tower_inputs(images[: len(SIZES)], cfg.vision)
    grid_thw = torch.tensor(grids)
    assert len({g[1:] for g in grids}) == len(grids) and (1, 6, 6) in grids  # every shape, the table's own too
    hidden = hf.model.vision_tower(pixels, grid_thw=grid_thw).last_hidden_state
    torch.testing.assert_close(model.vision_tower.hidden_states(pixels, grids), hidden, atol=1e-4, rtol=0)
    theirs = hf.model.get_image_features(pixels, grid_thw).pooler_output
    ours = model.encode_images(pixels, grids)
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@torch.no_grad()
def test_clip_of_frames_adds_the_temporal_sinusoid_as_transformers_does(k25):
    hf, model, _, _ = k25
    pixels = torch.randn(2 * 4 * 6, 3, 14, 14, generator=torch.Generator().manual_seed(1))
    theirs = hf.model.vision_tower(pixels, grid_thw=torch.tensor([[2, 4, 6]])).pooler_output
    torch.testing.assert_close(model.vision_tower(pixels, [(2, 4, 6)]), theirs, atol=1e-4, rtol=0)


def _prompt(processed) -> list[int]:
    ids = [5, 6]
    for i, image in enumerate(processed):
        ids += [START] + [IMAGE] * image.num_tokens + [END, 7 + i, 9]
    return ids


@pytest.mark.parametrize("which", [[1], [2, 3]], ids=["one_image", "two_images"])
@torch.no_grad()
def test_multimodal_logits_match_transformers(k25, images, which):
    hf, model, cfg, _ = k25
    processed, _, _ = _tower_inputs([images[i] for i in which], cfg.vision)
    ids = _prompt(processed)
    theirs = hf(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.cat([p.pixel_values for p in processed]),
        image_grid_thw=torch.tensor([p.grid for p in processed]),
    ).logits[0]
    ours = full_logits(model, ids, processed)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    text_only = full_logits(model, [t if t != IMAGE else 0 for t in ids])
    assert (text_only - theirs).abs().max() > 1e-2  # the image features, not the placeholders, made these logits


def test_preprocessing_equals_kimi_k25_image_processor(k25, images, tmp_path):
    """Pixel values and grids of the processor (torchvision backend), with a patch budget small enough that the
    larger images are resized (antialiased bicubic) and every one padded to a multiple of 28 px."""
    _, _, cfg, _ = k25
    vision = type(cfg.vision)(**{**vars(cfg.vision), "max_patches": 24})
    ref = hf_image_processor(images, tmp_path / "ref.safetensors", max_patches=24)
    processed = [preprocess_image(Image.open(p), vision) for p in images]
    assert [list(p.grid) for p in processed] == ref["grid"].tolist()
    heights = [Image.open(p).height for p in images]
    assert sum(g[1] * 14 < h - 28 for g, h in zip(ref["grid"].tolist(), heights)) >= 2  # downscaled, not just padded
    torch.testing.assert_close(torch.cat([p.pixel_values for p in processed]), ref["pixel_values"], atol=0, rtol=0)


def test_same_pixels_same_hash_other_pixels_other_hash(k25, images):
    _, _, cfg, _ = k25
    a = load_image(images[0].read_bytes(), cfg.vision, 10**7)
    b = preprocess_image(Image.open(images[0]).convert("RGB"), cfg.vision)
    c = load_image(images[1].read_bytes(), cfg.vision, 10**7)
    assert a.content_hash == b.content_hash != c.content_hash


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height RGB pixels but carries almost no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_image_size_is_refused_from_the_header_before_decoding(k25):
    """A 20000x20000 PNG without its pixel data is refused by its declared size, not by a (huge) decode."""
    with pytest.raises(ImageError, match="larger than the 50000000 pixels accepted"):
        load_image(png_header_only(20000, 20000), k25[2].vision, max_pixels=50_000_000)
    with pytest.raises(ImageError, match="9000x9000 = 81000000 pixels"):  # under Pillow's own bomb limit
        load_image(png_header_only(9000, 9000), k25[2].vision, max_pixels=50_000_000)
    with pytest.raises(ImageError, match="truncated or corrupt"):  # within the limit: decoding finds no data
        load_image(png_header_only(90, 90), k25[2].vision, max_pixels=50_000_000)
    with pytest.raises(ImageError, match="not a decodable image"):
        load_image(b"hello, I am a text file\n", k25[2].vision, max_pixels=50_000_000)


def test_original_vt_names_parse_like_transformers_names_and_variants_are_refused(k25):
    _, _, cfg, path = k25
    raw = json.loads((path / "config.json").read_text())
    v = raw["vision_config"]
    original = {
        "vt_hidden_size": v["hidden_size"],
        "vt_num_hidden_layers": v["num_hidden_layers"],
        "vt_num_attention_heads": v["num_attention_heads"],
        "vt_intermediate_size": v["intermediate_size"],
        "init_pos_emb_height": 6,
        "init_pos_emb_width": 6,
        "init_pos_emb_time": 4,
        "merge_kernel_size": [2, 2],
        "mm_hidden_size": v["hidden_size"],
        "projector_ln_eps": 1e-5,
        "mm_projector_type": "patchmerger",
    }
    top = {k: x for k, x in raw.items() if k not in ("image_token_id", "projection_hidden_size")}
    again = model_config_from_dict(top | {"vision_config": original, "media_placeholder_token_id": IMAGE})
    assert again.vision == cfg.vision
    for field, value in [("norm_type", "rmsnorm"), ("mm_projector_type", "patchmergerv2"), ("qkv_hidden_size", 48)]:
        with pytest.raises(ConfigError, match=field):
            model_config_from_dict(raw | {"vision_config": v | {field: value}})
    with pytest.raises(ConfigError, match="vision_config"):
        model_config_from_dict({k: x for k, x in raw.items() if k != "vision_config"})
