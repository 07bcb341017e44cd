"""Tower pretraining before LLaVA stage 1: the MoonViT tower and projector learn the synthetic visual task as a
classifier, with no language model in the loop.

Real vision-language models start from a pretrained tower (CLIP, SigLIP, MoonViT's own pretraining); a fresh tower
that must learn through a frozen tiny decoder gets a weak, slow signal. Here each question kind has a linear head on
the mean of the image's projected features (the rows the decoder will read): colour (7 classes), shape (4), count
(1-4) and number (0-99 as a tens head, none or 0-9, and a ones head, 0-9; 100 classes of a few images each learn
slowly). Images are rendered on the fly, the kinds in turn. The heads are dropped afterwards; stage 1 starts from the
tower and projector. Resumable (`pretrain.pt` in the output folder).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from kestrel.models.decoder import CausalLM
from kestrel.models.vision.inputs import encode_images
from kestrel.models.vision.preprocess import preprocess_image
from kestrel.train.sft import lr_at
from kestrel.train.stop_signal import STOP
from kestrel.train.vision_data import COLORS, KINDS, SHAPES, render_image

log = logging.getLogger(__name__)
STATE_FILE = "pretrain.pt"
HELD_OUT_SEED = 10_003  # neither stage 1's streams nor `kestrel eval --task vision`'s


@dataclass
class TowerPretrain:
    """How long and how the tower pretrains (whichever of steps and minutes runs out first)."""

    steps: int = 2400  # ~32 min on 2 shared cores: with --pretrain-minutes 30 the time budget binds
    max_minutes: float | None = None
    batch_size: int = 128
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine to this fraction of lr (`sft.lr_at`, shared with SFT)
    eval_every: int = 250
    eval_images: int = 400
    seed: int = 0


@dataclass
class PretrainState:
    step: int = 0
    seconds: float = 0.0
    loss: list[tuple[int, float]] = field(default_factory=list)
    accuracy: list[tuple[int, dict[str, float]]] = field(default_factory=list)


def _label(kind: str, answer) -> int:
    if kind == "color":
        return list(COLORS).index(answer)
    if kind == "shape":
        return SHAPES.index(answer)
    if kind == "count":
        return answer - 1
    return answer  # number: 0-99


class KindHeads(nn.Module):
    """Linear classifiers per question kind on an image's pooled features."""

    def __init__(self, width: int) -> None:
        super().__init__()
        sizes = {"color": len(COLORS), "shape": len(SHAPES), "count": 4, "tens": 11, "ones": 10}
        self.heads = nn.ModuleDict({k: nn.Linear(width, n) for k, n in sizes.items()})

    def loss(self, pooled: torch.Tensor, kind: str, labels: torch.Tensor) -> torch.Tensor:
        if kind != "number":
            return F.cross_entropy(self.heads[kind](pooled), labels)
        tens = torch.where(labels >= 10, labels // 10 + 1, torch.zeros_like(labels))
        return F.cross_entropy(self.heads["tens"](pooled), tens) + F.cross_entropy(
            self.heads["ones"](pooled), labels % 10
        )

    def predict(self, pooled: torch.Tensor, kind: str) -> torch.Tensor:
        if kind != "number":
            return self.heads[kind](pooled).argmax(-1)
        tens, ones = self.heads["tens"](pooled).argmax(-1), self.heads["ones"](pooled).argmax(-1)
        return torch.where(tens > 0, (tens - 1) * 10 + ones, ones)


def _images(rng: random.Random, n: int, model: CausalLM) -> tuple[list[str], list, torch.Tensor]:
    kinds = [KINDS[i % len(KINDS)] for i in range(n)]
    images, labels = [], []
    for kind in kinds:
        image, answer = render_image(kind, rng.randrange(1 << 40))
        images.append(preprocess_image(image, model.cfg.vision))
        labels.append(_label(kind, answer))
    return kinds, images, torch.tensor(labels, device=model.device)


def _pooled(model: CausalLM, images: list) -> torch.Tensor:
    return torch.stack([f.mean(0) for f in encode_images(model, images)])


class TowerPretrainer:
    def __init__(self, model: CausalLM, cfg: TowerPretrain, out_dir: str | Path) -> None:
        if not model.has_vision:
            raise ValueError("tower pretraining needs a model with a vision_config")
        self.model, self.cfg, self.out = model, cfg, Path(out_dir)
        self.heads = KindHeads(model.cfg.hidden_size).to(model.device)
        self.params = [*model.vision_tower.parameters(), *model.mm_projector.parameters(), *self.heads.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
        self.state = PretrainState()
        self.rng = random.Random(cfg.seed + 1)
        self.held_out = _images(random.Random(HELD_OUT_SEED), cfg.eval_images, model)
        self._resume()

    def _resume(self) -> None:
        path = self.out / STATE_FILE
        if not path.exists():
            return
        saved = torch.load(path, weights_only=False)
        self.model.vision_tower.load_state_dict(saved["tower"])
        self.model.mm_projector.load_state_dict(saved["projector"])
        self.heads.load_state_dict(saved["heads"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = PretrainState(**saved["state"])
        self.rng.setstate(saved["rng"])
        log.info("tower pretraining resumed from step %d", self.state.step)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "tower": self.model.vision_tower.state_dict(),
                "projector": self.model.mm_projector.state_dict(),
                "heads": self.heads.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "state": vars(self.state),
                "rng": self.rng.getstate(),
            },
            self.out / STATE_FILE,
        )

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        kinds, images, labels = self.held_out
        self.model.vision_tower.eval()
        pooled = _pooled(self.model, images)
        self.model.vision_tower.train()
        scores = {}
        for kind in KINDS:
            rows = torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=labels.device)
            scores[kind] = float((self.heads.predict(pooled[rows], kind) == labels[rows]).float().mean())
        return scores

    def train(self) -> PretrainState:
        cfg, state = self.cfg, self.state
        start = time.perf_counter() - state.seconds
        bar = tqdm(total=cfg.steps, initial=state.step, desc="tower pretraining", dynamic_ncols=True)
        with STOP.installed():
            while state.step < cfg.steps and not STOP.stop_here(state.step):
                elapsed = time.perf_counter() - start
                if cfg.max_minutes is not None and elapsed > cfg.max_minutes * 60:
                    break
                fraction = elapsed / (cfg.max_minutes * 60) if cfg.max_minutes else 0.0
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(state.step, cfg, fraction)
                kinds, images, labels = _images(self.rng, cfg.batch_size, self.model)
                pooled = _pooled(self.model, images)
                loss = sum(
                    self.heads.loss(pooled[rows], kind, labels[rows])
                    for kind in KINDS
                    if len(rows := torch.tensor([i for i, k in enumerate(kinds) if k == kind], device=labels.device))
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.optimizer.step()
                state.step += 1
                state.loss.append((state.step, loss.item()))
                bar.set_postfix(loss=f"{state.loss[-1][1]:.3f}")
                bar.update(1)
                if state.step % cfg.eval_every == 0:
                    state.accuracy.append((state.step, self.evaluate()))
                    log.info("tower pretraining step %d: held-out accuracy %s", state.step, state.accuracy[-1][1])
        bar.close()
        state.seconds = time.perf_counter() - start
        if not state.accuracy or state.accuracy[-1][0] != state.step:
            state.accuracy.append((state.step, self.evaluate()))
        self.save()
        return state
