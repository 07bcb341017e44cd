"""Supervised fine-tuning through Kestrel's own layers (autograd through chunked KDA, MoE and DSA).

Sequences are packed without padding into one `ForwardBatch`; the loss covers assistant tokens only. The
router's correction bias is nudged toward balanced expert load (DeepSeek-V3's aux-loss-free balancing) and
the DSA indexers learn from their distillation loss. Checkpoints are safetensors in the loader's format.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from kestrel.chat_template import GENERATION_PROMPT, IM_END, IM_MIDDLE, IM_SYSTEM, render_message, tools_json
from kestrel.config import VisionConfig, model_config_from_dict
from kestrel.models.checkpoint import VISION_PREFIXES, init_random_, save_checkpoint
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.layers.moe import MoE
from kestrel.models.loader import build_model, load_model, load_weights
from kestrel.models.lora import LoRAAdapter, load_peft
from kestrel.models.vision.inputs import encode_images, image_offsets, splice_rows
from kestrel.models.vision.preprocess import image_tokens, preprocess_image
from kestrel.tokenizer import load_tokenizer, save_tokenizer
from kestrel.train.data import Episode
from kestrel.train.lora import attach_trainable, save_adapter
from kestrel.train.stop_signal import STOP
from kestrel.train.vision_data import IMAGE_SIZE, render_image

if TYPE_CHECKING:
    from kestrel.train.vision_pretrain import TowerPretrain

log = logging.getLogger(__name__)
ADAPTER_DIR = "adapter"  # under the output folder: a trained adapter (PEFT format) beside checkpoint/
# (token ids, learn mask[, image specs]): what the trainer packs; specs are drawn by `render_image` per batch.
Example = tuple[list[int], list[bool]] | tuple[list[int], list[bool], list[tuple[str, int]]]


@dataclass
class SFTConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    save_every: int = 200
    bias_update_rate: float = 1e-3
    indexer_loss_weight: float = 0.1
    # DSA layers attend densely for this many first steps while their indexers distil the dense attention: a fresh
    # indexer's top-k is near random, so sparse attention from step 0 hides what a copy must read (a tool call's
    # argument in the user turn ~250 tokens back) and attention cannot learn to look for it.
    dense_warmup_steps: int = 0
    max_minutes: float | None = None
    save_dtype: str = "float32"
    # LLaVA stage 1: only the vision tower and projector learn; the text model stays bit for bit (in eval mode:
    # no router-bias nudges, no indexer distillation), so text behaviour cannot move.
    freeze_text: bool = False


def encode_episode(tok: Tokenizer, ep: Episode) -> tuple[list[int], list[bool]]:
    """Token ids and a per-token 'is an assistant token the model must learn' mask.

    Every segment starts and ends at a chat token, so encoding segments separately equals encoding the
    whole rendered conversation.
    """
    ids: list[int] = []
    mask: list[bool] = []

    def add(text: str, learn: bool) -> None:
        piece = tok.encode(text).ids
        ids.extend(piece)
        mask.extend([learn] * len(piece))

    if ep.tools:
        add(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{tools_json(ep.tools)}{IM_END}", False)
    if ep.reasoning_effort:
        add(f"{IM_SYSTEM}reasoning_effort{IM_MIDDLE}{ep.reasoning_effort}{IM_END}", False)
    for message in ep.messages:
        text = render_message(message)
        if message["role"] == "assistant":
            add(GENERATION_PROMPT, False)
            add(text[len(GENERATION_PROMPT) :], True)
        else:
            add(text, False)
    return ids, mask


def encode_example(tok: Tokenizer, ep: Episode, vision: VisionConfig | None) -> Example:
    """`encode_episode`, with each image marker's placeholder repeated once per merged patch of its image
    (never learned), and the episode's image specs (drawn only when a batch needs them)."""
    ids, mask = encode_episode(tok, ep)
    spec = ep.meta.get("image")
    if spec is None:
        return ids, mask
    if vision is None:
        raise ValueError("training data has images but the model config has no vision_config")
    n = image_tokens(IMAGE_SIZE, IMAGE_SIZE, vision)
    at = ids.index(vision.image_token_id)
    return ids[:at] + [vision.image_token_id] * n + ids[at + 1 :], mask[:at] + [False] * n + mask[at + 1 :], [spec]


def attach_images(model: CausalLM, batch: ForwardBatch, examples: list[Example]) -> None:
    """Draw, preprocess and encode (with gradients, when training) the batch's images into its placeholders."""
    vision, rows, images, start = model.cfg.vision, [], [], 0
    for example in examples:
        for spec in example[2] if len(example) > 2 else []:
            image = preprocess_image(render_image(*spec)[0], vision)
            rows += splice_rows(image_offsets(example[0], [image], vision.image_token_id), [image], start)
            images.append(image)
        start += len(example[0])
    if images:
        batch.mm_rows = torch.tensor(rows, dtype=torch.long, device=model.device)
        batch.mm_embeds = torch.cat(encode_images(model, images))


def packed_batch(examples: list[Example], device) -> tuple[ForwardBatch, torch.Tensor]:
    """One ForwardBatch of whole sequences and the next-token targets (-100 where no loss)."""
    ids, targets, lens = [], [], []
    for seq, mask, *_ in examples:
        ids.extend(seq)
        targets.extend([t if m else -100 for t, m in zip(seq[1:], mask[1:])] + [-100])
        lens.append(len(seq))
    input_ids = torch.tensor(ids, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    batch = ForwardBatch(input_ids=input_ids, positions=positions, extend_lens=lens, prefix_lens=[0] * len(lens))
    return batch, torch.tensor(targets, device=device)


def lm_loss(model: CausalLM, batch: ForwardBatch, targets: torch.Tensor) -> torch.Tensor:
    hidden = model(batch)
    rows = targets != -100
    logits = model.logits(hidden[rows])
    return torch.nn.functional.cross_entropy(logits, targets[rows])


def indexer_loss(model: CausalLM) -> torch.Tensor | None:
    losses = [getattr(layer.self_attn, "indexer_loss", None) for layer in model.model.layers if layer.kind == "dsa"]
    losses = [x for x in losses if x is not None]
    return torch.stack(losses).mean() if losses else None


def set_dense_warmup(model: CausalLM, on: bool) -> None:
    """Switch every DSA layer between dense (warm-up) and top-k attention for the training forward."""
    for layer in model.model.layers:
        if layer.kind == "dsa":
            layer.self_attn.dense_warmup = on


@torch.no_grad()
def update_router_bias(model: CausalLM, routed: dict[int, torch.Tensor], rate: float) -> None:
    """Raise the bias of under-loaded experts and lower over-loaded ones (sign update)."""
    for layer_id, ids in routed.items():
        moe = model.model.layers[layer_id].mlp
        assert isinstance(moe, MoE)
        load = torch.bincount(ids.reshape(-1), minlength=moe.gate.n_experts).float()
        moe.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)


def lr_at(step: int, cfg: SFTConfig | TowerPretrain, time_fraction: float = 0.0) -> float:
    """Linear warmup, then cosine to min_lr over whichever budget (steps or minutes) runs out first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max((step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), time_fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainState:
    step: int = 0
    train_loss: list[tuple[int, float]] = field(default_factory=list)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0


def trained_model(path: Path) -> tuple[CausalLM, dict[str, Any], Tokenizer]:
    """A trained checkpoint to train further (fp32 weights), its config.json and its tokenizer."""
    tok = load_tokenizer(path)
    if tok is None:
        raise ValueError(f"{path}: no tokenizer.json")
    model, _ = load_model(path, dtype=torch.float32)
    return model, json.loads((path / "config.json").read_text()), tok


class SFTTrainer:
    def __init__(
        self,
        model_config: dict[str, Any],
        tokenizer: Tokenizer,
        train: list[Episode],
        held_out: list[Episode],
        cfg: SFTConfig,
        out_dir: str | Path,
        model: CausalLM | None = None,
        adapter: LoRAAdapter | None = None,
    ) -> None:
        """`model`: start from these weights (e.g. a shipped text model plus a fresh tower) instead of random ones.
        `adapter`: a fresh LoRA adapter trained beside the (frozen) text weights, saved in PEFT format under
        `out_dir/adapter` (with `freeze_text`: the vision stage's language-model adapter)."""
        self.cfg, self.out = cfg, Path(out_dir)
        self.model_config_dict = model_config
        self.tokenizer = tokenizer
        torch.manual_seed(cfg.seed)
        mc = model_config_from_dict(model_config)
        self.model = model if model is not None else init_random_(build_model(mc, torch.float32), cfg.seed)
        self.adapter, adapter_params = adapter, []
        if adapter is not None:
            _, adapter_params = attach_trainable(self.model, adapter)  # freezes every model weight
        if cfg.freeze_text:
            if not self.model.has_vision:
                raise ValueError("freeze_text trains the vision tower, but the model config has no vision_config")
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith(VISION_PREFIXES))
        self.train_set = [encode_example(tokenizer, ep, mc.vision) for ep in train]
        self.eval_set = [encode_example(tokenizer, ep, mc.vision) for ep in held_out]
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for n, p in trainable if p.dim() >= 2 and "embed" not in n]
        other = [p for n, p in trainable if not (p.dim() >= 2 and "embed" not in n)] + adapter_params
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
        self.state = TrainState()
        self.rng = random.Random(cfg.seed)
        self._queue: list[list[Example]] = []
        self._resume()

    # -- checkpoints ------------------------------------------------------------------------------------
    def _resume(self) -> None:
        state_file = self.out / "trainer_state.pt"
        if not state_file.exists():
            return
        saved = torch.load(state_file, weights_only=False)
        load_weights(self.model, self.out / "checkpoint")
        if self.adapter is not None:
            saved_adapter = load_peft(self.out / ADAPTER_DIR)
            with torch.no_grad():
                for module, (a, b) in self.adapter.weights.items():
                    a.copy_(saved_adapter.weights[module][0])
                    b.copy_(saved_adapter.weights[module][1])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])
        self.rng.setstate(saved["rng"])
        log.info("resumed from step %d", self.state.step)

    def save(self) -> Path:
        ckpt = self.out / "checkpoint"
        dtype = torch.bfloat16 if self.cfg.save_dtype == "bfloat16" else None
        save_checkpoint(self.model, self.model_config_dict, ckpt, dtype=dtype)
        save_tokenizer(self.tokenizer, ckpt)
        if self.adapter is not None:
            save_adapter(self.adapter, self.out / ADAPTER_DIR, self.model_config_dict["model_type"])
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "state": asdict(self.state), "rng": self.rng.getstate()},
            self.out / "trainer_state.pt",
        )
        (self.out / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2))
        return ckpt

    # -- loop -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = []
        for i in range(0, len(self.eval_set), self.cfg.batch_size):
            examples = self.eval_set[i : i + self.cfg.batch_size]
            batch, targets = packed_batch(examples, self.model.device)
            attach_images(self.model, batch, examples)
            losses.append(float(lm_loss(self.model, batch, targets)))
        self._train_mode()
        return sum(losses) / len(losses)

    def _train_mode(self) -> None:
        self.model.train(not self.cfg.freeze_text)

    def _next_examples(self) -> list[Example]:
        """Random examples, drawn 4 batches at a time and grouped by length so padded KDA wastes little."""
        if not self._queue:
            n = self.cfg.batch_size
            pool = sorted(
                (self.train_set[self.rng.randrange(len(self.train_set))] for _ in range(4 * n)), key=lambda e: len(e[0])
            )
            self._queue = [pool[i : i + n] for i in range(0, len(pool), n)]
            self.rng.shuffle(self._queue)
        return self._queue.pop()

    def train(self) -> TrainState:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        self._train_mode()
        start = time.perf_counter() - self.state.seconds
        if not self.state.eval_loss:
            self.state.eval_loss.append((0, self.evaluate()))
        bar = tqdm(total=cfg.steps, initial=self.state.step, desc="sft", dynamic_ncols=True)
        with STOP.installed():
            self._loop(start, bar)
        bar.close()
        self.state.seconds = time.perf_counter() - start
        if not STOP.requested and (not self.state.eval_loss or self.state.eval_loss[-1][0] != self.state.step):
            self.state.eval_loss.append((self.state.step, self.evaluate()))
        self.save()
        self.plot_loss()
        return self.state

    def _loop(self, start: float, bar: tqdm) -> None:
        cfg = self.cfg
        while self.state.step < cfg.steps:
            if STOP.stop_here(self.state.step):
                break
            if cfg.max_minutes is not None and time.perf_counter() - start > cfg.max_minutes * 60:
                log.warning("time budget of %.1f min reached at step %d", cfg.max_minutes, self.state.step)
                break
            step = self.state.step
            time_fraction = (time.perf_counter() - start) / (cfg.max_minutes * 60) if cfg.max_minutes else 0.0
            for group in self.optimizer.param_groups:
                group["lr"] = lr_at(step, cfg, time_fraction)
            set_dense_warmup(self.model, step < cfg.dense_warmup_steps)
            examples = self._next_examples()
            batch, targets = packed_batch(examples, self.model.device)
            attach_images(self.model, batch, examples)
            if not cfg.freeze_text:
                batch.routed_experts = {}
            loss = lm_loss(self.model, batch, targets)
            total = loss
            aux = None if cfg.freeze_text else indexer_loss(self.model)
            if aux is not None:
                total = total + cfg.indexer_loss_weight * aux
            self.optimizer.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], cfg.grad_clip)
            self.optimizer.step()
            if batch.routed_experts is not None:
                update_router_bias(self.model, batch.routed_experts, cfg.bias_update_rate)
            self.state.step += 1
            self.state.train_loss.append((self.state.step, loss.item()))
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
            if self.state.step % cfg.eval_every == 0 or self.state.step == cfg.steps:
                self.state.eval_loss.append((self.state.step, self.evaluate()))
            if self.state.step % cfg.save_every == 0:
                self.state.seconds = time.perf_counter() - start
                self.save()

    def plot_loss(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        steps, losses = zip(*self.state.train_loss) if self.state.train_loss else ((), ())
        window = 20
        smooth = [
            sum(losses[max(0, i - window) : i + 1]) / len(losses[max(0, i - window) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(steps, smooth, label="train (smoothed)")
        if self.state.eval_loss:
            ax.plot(*zip(*self.state.eval_loss), "o-", label="held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (assistant tokens)")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("kestrel SFT")
        path = self.out / "loss_curve.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path
