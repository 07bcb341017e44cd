"""`kestrel train vision --base kestrel-mini`: LLaVA stage 1, a MoonViT tower and projector learn to speak to a
frozen text model.

The shipped text model is loaded as it is and never updated (`SFTConfig.freeze_text`): gradients of the answer
tokens' loss flow through it into the tower, so text-only behaviour is unchanged by construction (`ship_vision`
checks that every language-model tensor is byte-identical before it installs anything). The image markers
(`<|media_begin|>` ...) are added to the tokenizer when it lacks them; their rows already exist in the padded
embedding and stay as they are: the placeholders' rows are replaced by image features, the other three are fixed
random vectors the tower learns around. Replies use the frozen model's own shape (`style="short"`).

Why not train tower and text model together from scratch (the `vision-small` recipe): that reached 21% held-out,
with image features ~200x the norm of text embeddings. Here the projector's last layer starts scaled so features
have the text embeddings' norm (`match_embedding_norm`).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from kestrel.chat_template import MEDIA_PAD, MEDIA_TOKENS
from kestrel.config import model_config_from_dict
from kestrel.engine.vision_adapter import ADAPTER_DIR, record_base
from kestrel.models.builtin import EMBEDDED_DIR, TIED_DIR, model_dir
from kestrel.models.checkpoint import VISION_PREFIXES, init_random_, save_checkpoint, stored_dtype, text_weights_sha256
from kestrel.models.decoder import CausalLM
from kestrel.models.loader import build_model
from kestrel.models.lora import LoRAAdapter, load_peft
from kestrel.models.vision.inputs import encode_images
from kestrel.models.vision.preprocess import preprocess_image
from kestrel.tokenizer import save_tokenizer
from kestrel.train.lora import new_adapter, save_adapter
from kestrel.train.recipes import VISION_LORA_TARGETS, VISION_STAGES, VisionMix, with_vision_tower
from kestrel.train.sft import SFTTrainer, trained_model
from kestrel.train.stop_signal import stopped_early
from kestrel.train.vision_data import KINDS, render_image, vision_episodes
from kestrel.train.vision_pretrain import PretrainState, TowerPretrain, TowerPretrainer

log = logging.getLogger(__name__)
HELD_OUT_SEED = 10_001  # the held-out loss stream; `kestrel eval --task vision` draws from 10_002


def with_media_tokens(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """The tokenizer with the image markers appended as control tokens (ids after every existing one)."""
    missing = [t for t in MEDIA_TOKENS if tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the image markers need {tok.get_vocab_size()} token ids; the model has {vocab_size}")
    return tok


@torch.no_grad()
def match_embedding_norm(model: CausalLM, samples: int = 16) -> float:
    """Scale the projector's last layer so image features start with the mean norm of the text embeddings."""
    vision = model.cfg.vision
    images = [preprocess_image(render_image(KINDS[i % len(KINDS)], i)[0], vision) for i in range(samples)]
    features = torch.cat(encode_images(model, images))
    scale = float(model.model.embed_tokens.weight.norm(dim=-1).mean() / features.norm(dim=-1).mean())
    last = model.mm_projector.proj[-1]
    last.weight.mul_(scale)
    last.bias.mul_(scale)
    return scale


def vision_stage_model(base: Path, tower: VisionMix, seed: int = 0) -> tuple[CausalLM, dict, Tokenizer]:
    """The base text model's weights (unchanged) plus a fresh tower, the extended config, and the tokenizer."""
    text_model, config, tok = trained_model(base)
    tok = with_media_tokens(tok, text_model.cfg.vocab_size)
    # A base that already sees (the shipped kestrel-mini) retrains from its text weights with a fresh tower.
    config = with_vision_tower(config, tower, tok.token_to_id(MEDIA_PAD))
    model = init_random_(build_model(model_config_from_dict(config)), seed)
    text = {n: t for n, t in text_model.state_dict().items() if not n.startswith(VISION_PREFIXES)}
    missing, unexpected = model.load_state_dict(text, strict=False)
    stray = [n for n in missing if not n.startswith(VISION_PREFIXES)]
    if stray or unexpected:
        raise ValueError(f"base weights do not fit the extended model: missing {stray}, unexpected {unexpected}")
    match_embedding_norm(model)
    return model, config, tok


def vision_adapter(model: CausalLM, rank: int, seed: int = 0) -> LoRAAdapter:
    """A fresh adapter (B = 0: the model starts as the base) on the language model's `VISION_LORA_TARGETS`, routed
    experts left out: what must learn is the attention reading image rows, and per-expert terms multiply the size."""
    adapter = new_adapter(model, list(VISION_LORA_TARGETS), r=rank, lora_alpha=2 * rank, name="vision", seed=seed)
    adapter.weights = {m: w for m, w in adapter.weights.items() if ".experts." not in m}
    return adapter


def run_vision_stage(
    stage_name: str,
    base: str | Path,
    out_dir: str | Path,
    steps: int | None = None,
    max_minutes: float | None = None,
    ship: bool = False,
    lora_rank: int | None = None,
    pretrain_minutes: float | None = None,
    pretrain_steps: int | None = None,
    tower_from: str | Path | None = None,
    resume_from: str | Path | None = None,
) -> SFTTrainer:
    """Train the stage into `out_dir` (resumable): the tower's pretraining if the stage (or `pretrain_*`) asks for
    it, in `out_dir/pretrain`, then stage 1; with a LoRA rank, its adapter lands in `out_dir/adapter`.

    `tower_from`: a seeing model whose pretrained tower this stage reuses instead of pretraining one. The tower's
    pretraining never reads the text model, so a retrained text model needs only stage 1 again.
    `resume_from`: a seeing model whose tower, projector and vision adapter this stage starts from (its text model
    trained further, say): stage 1 then adjusts what it learnt instead of learning it again."""
    stage = copy.deepcopy(VISION_STAGES[stage_name])
    if steps is not None:
        stage.sft.steps = steps
    if max_minutes is not None:
        stage.sft.max_minutes = max_minutes
    if lora_rank is not None:
        if lora_rank < 0:
            raise ValueError(f"lora_rank: must be >= 0, got {lora_rank}")
        stage.lora_rank = lora_rank
    if pretrain_minutes is not None or pretrain_steps is not None:
        stage.pretrain = stage.pretrain or TowerPretrain()
        if pretrain_minutes is not None:
            stage.pretrain.max_minutes = pretrain_minutes
        if pretrain_steps is not None:
            stage.pretrain.steps = pretrain_steps
    if stage.pretrain is not None and stage.pretrain.max_minutes == 0:
        stage.pretrain = None
    base_dir = model_dir(base)
    if ship and base_dir.resolve() not in (EMBEDDED_DIR.resolve(), TIED_DIR.resolve()):
        raise ValueError("--ship: a shipped tower belongs to a shipped model (--base kestrel-mini or the tied one)")
    # Text tensors are written back in the base's own dtype: bf16 → fp32 (training) → bf16 is exact.
    stage.sft.save_dtype = "bfloat16" if stored_dtype(base_dir) == torch.bfloat16 else "float32"
    torch.manual_seed(stage.sft.seed)
    model, config, tok = vision_stage_model(base_dir, stage.tower, stage.sft.seed)
    pretrained = None
    if tower_from is not None and resume_from is not None:
        raise ValueError("tower_from and resume_from: give one (resume_from takes the tower too)")
    if resume_from is not None:
        pretrained = reuse_tower(model, model_dir(resume_from))
    elif tower_from is not None:
        pretrained = reuse_tower(model, model_dir(tower_from))
    elif stage.pretrain is not None:
        state = TowerPretrainer(model, stage.pretrain, Path(out_dir) / "pretrain").train()
        log.info("tower pretrained: held-out accuracy %s", state.accuracy[-1][1])
        pretrained = pretraining_summary(state)
    if pretrained is not None:
        match_embedding_norm(model)  # the decoder reads the features at its embeddings' norm, as a fresh tower's
    train = vision_episodes(stage.sft.seed + 1, stage.tower.episodes, style="short", kinds=stage.train_kinds)
    held_out = vision_episodes(HELD_OUT_SEED, stage.eval_episodes, style="short")
    adapter = vision_adapter(model, stage.lora_rank, stage.sft.seed) if stage.lora_rank else None
    if resume_from is not None:
        resume_projector_and_adapter(model, adapter, model_dir(resume_from))
    trainer = SFTTrainer(config, tok, train, held_out, stage.sft, out_dir, model=model, adapter=adapter)
    if pretrained is not None:  # LLaVA's stage 1: a pretrained tower stays as it is, the projector learns
        for p in model.vision_tower.parameters():
            p.requires_grad_(False)
    state = trainer.train()
    log.info("trained %d steps in %.1f min; held-out loss %s", state.step, state.seconds / 60, state.eval_loss[-1])
    if ship and not stopped_early():
        ship_vision(trainer, base_dir, stage_name, target=base_dir, pretrained=pretrained)
    return trainer


def pretraining_summary(state: PretrainState) -> dict:
    """What a shipped model records of its tower's pretraining."""
    return {
        "steps": state.step,
        "minutes": round(state.seconds / 60, 1),
        "held_out_accuracy": {k: round(v, 3) for k, v in state.accuracy[-1][1].items()},
    }


def reuse_tower(model: CausalLM, source: Path) -> dict:
    """Load a seeing model's tower (same shape) into `model` and return the record of its pretraining."""
    summary_file = source / "training_summary.json"
    record = json.loads(summary_file.read_text()).get("vision", {}) if summary_file.exists() else {}
    pretraining = record.get("tower_pretraining")
    if pretraining is None:
        raise ValueError(f"tower_from: {source} records no pretrained tower (training_summary.json: vision)")
    seeing = trained_model(source)[0]
    if not seeing.has_vision:
        raise ValueError(f"tower_from: {source} has no vision tower")
    mine, theirs = model.vision_tower.state_dict(), seeing.vision_tower.state_dict()
    if {k: v.shape for k, v in mine.items()} != {k: v.shape for k, v in theirs.items()}:
        raise ValueError(f"tower_from: {source}'s tower ({seeing.cfg.vision}) is not this stage's shape")
    model.vision_tower.load_state_dict(theirs)
    log.info("tower taken from %s (pretrained %s steps)", source, pretraining["steps"])
    return pretraining | {"from": source.name}


def resume_projector_and_adapter(model: CausalLM, adapter: LoRAAdapter | None, source: Path) -> None:
    """Start this stage's projector and adapter from a seeing model's (same shapes, same adapted projections)."""
    seeing = trained_model(source)[0]
    model.mm_projector.load_state_dict(seeing.mm_projector.state_dict())
    if adapter is None:
        return
    saved = load_peft(source / ADAPTER_DIR)
    if saved.r != adapter.r or set(saved.weights) != set(adapter.weights):
        raise ValueError(f"resume_from: {source}'s vision adapter (rank {saved.r}) does not fit this stage's")
    dtype = next(iter(adapter.weights.values()))[0].dtype
    adapter.weights = {m: (a.to(dtype).clone(), b.to(dtype).clone()) for m, (a, b) in saved.weights.items()}
    log.info("projector and vision adapter taken from %s", source)


def ship_vision(
    trainer: SFTTrainer,
    base: Path,
    stage_name: str,
    target: Path = EMBEDDED_DIR,
    pretrained: dict | None = None,
) -> Path:
    """Install tower + projector (and the extended config and tokenizer) into `target`, after checking that the
    language-model tensors written are byte-identical to the base's; a stage's adapter goes to `vision-lora/`
    with the hashes of the weights it was trained against (`kestrel.engine.vision_adapter`)."""
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp)
        save_checkpoint(trainer.model, trainer.model_config_dict, staged, dtype=stored_dtype(base))
        save_tokenizer(trainer.tokenizer, staged)
        before, after = text_weights_sha256(base), text_weights_sha256(staged)
        if before != after:
            raise RuntimeError(f"the text model moved during the vision stage ({before} → {after}): not shipping")
        if trainer.adapter is not None:
            save_adapter(trainer.adapter, staged / ADAPTER_DIR, trainer.model_config_dict["model_type"])
            record_base(staged / ADAPTER_DIR, staged)
        summary_file = base / "training_summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        summary["vision"] = {
            "command": f"kestrel train vision --stage {stage_name} --ship",
            "steps": trainer.state.step,
            "minutes": round(trainer.state.seconds / 60, 1),
            "held_out_loss": round(trainer.state.eval_loss[-1][1], 4),
            "tower": asdict(VISION_STAGES[stage_name].tower),
            "lora_rank": trainer.adapter.r if trainer.adapter is not None else 0,
            "tower_pretraining": pretrained,
            "text_weights_sha256": after,
        }
        (staged / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        target.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target / ADAPTER_DIR, ignore_errors=True)  # an adapter of an earlier tower would not load
        shutil.copytree(staged, target, dirs_exist_ok=True)
    if (trainer.out / "loss_curve.png").exists():
        shutil.copy2(trainer.out / "loss_curve.png", target / "vision_loss_curve.png")
    return target
