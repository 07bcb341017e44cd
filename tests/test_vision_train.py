"""The synthetic visual task: deterministic images whose answers the pixels show, episodes packed with one
placeholder per merged patch, an SFT step that trains the tower through the spliced features, and the eval task."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kestrel.cli import main
from kestrel.models.checkpoint import make_model
from kestrel.tokenizer import byte_level_tokenizer
from kestrel.train.recipes import RECIPES, k3_mini_config, with_vision_tower
from kestrel.train.sft import SFTConfig, SFTTrainer, attach_images, lm_loss, packed_batch
from kestrel.train.vision_data import COLORS, KINDS, render_image, vision_episode, vision_episodes
from kestrel.train.vision_eval import HELD_OUT_SEED, vision_answer


def test_images_are_deterministic_and_show_their_answer():
    for kind in KINDS:
        (a, answer), (b, again) = render_image(kind, 7), render_image(kind, 7)
        assert answer == again and np.array_equal(np.asarray(a), np.asarray(b)) and a.size == (112, 112)
    image, color = render_image("color", 3)
    pixels = np.asarray(image).reshape(-1, 3)
    assert (np.abs(pixels.astype(int) - COLORS[color]).sum(1) < 10).sum() > 300  # the circle is painted that colour
    assert len({render_image("count", s)[1] for s in range(40)}) == 4
    assert len({render_image("number", s)[1] for s in range(40)}) > 20


def test_held_out_images_are_not_training_images():
    train = {ep.meta["image"] for ep in vision_episodes(RECIPES["vision-small"].sft.seed + 1, 500)}
    rng = random.Random(HELD_OUT_SEED)
    held = {vision_episode(rng, KINDS[i % 4]).meta["image"] for i in range(200)}
    assert not train & held


@pytest.mark.parametrize(
    ("kind", "text", "answer"),
    [
        ("color", "<think>I look at the circle.</think>The circle is red.", "red"),
        ("shape", "I look at the shape.</think>It is a star.", "star"),
        ("count", "<think>I count the triangles: three.</think>There are 3 triangles.", 3),
        ("number", "<think>I read the digits: 4 7.</think>The number is 47.", 47),
        ("number", "no digits here", None),
    ],
)
def test_vision_answer_reads_the_reply_after_the_reasoning(kind, text, answer):
    assert vision_answer(kind, text) == answer


def test_sft_trains_the_tower_through_the_image_placeholders(tmp_path):
    tok = byte_level_tokenizer()
    recipe = RECIPES["tiny-vision"]
    config = with_vision_tower(k3_mini_config(320, 64, 2, 4), recipe.vision, tok.token_to_id("<|media_pad|>"))
    eps = vision_episodes(0, 4)
    cfg = SFTConfig(steps=1, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=100, save_every=100)
    trainer = SFTTrainer(config, tok, eps, eps, cfg, tmp_path)
    ids, mask, specs = trainer.train_set[0]
    pad = tok.token_to_id("<|media_pad|>")
    assert (
        ids.count(pad) == 16 and not any(m for t, m in zip(ids, mask) if t == pad) and specs == [eps[0].meta["image"]]
    )
    model = trainer.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):  # the same batch: its loss must fall, and the tower must get gradients
        batch, targets = packed_batch(trainer.train_set, model.device)
        attach_images(model, batch, trainer.train_set)
        assert batch.mm_rows.numel() == 4 * 16
        loss = lm_loss(model, batch, targets)
        opt.zero_grad()
        loss.backward()
        assert model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
        assert model.mm_projector.proj[2].weight.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] * 0.9


def test_kestrel_eval_task_vision_scores_each_kind_of_held_out_image(tmp_path, capsys):
    path = make_model("kimi_k3", "tiny", tmp_path / "k3v", seed=1, vision="tiny")
    assert main(["eval", str(path), "--task", "vision", "-n", "4"]) == 0
    lines = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert set(lines) == {f"vision/{k}" for k in (*KINDS, "all")}
    assert all(0 <= float(v) <= 1 for v in lines.values())
