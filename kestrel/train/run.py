"""`kestrel train sft --recipe NAME`: data → tokenizer → model → SFT → checkpoint (+ ship as the embedded model)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kestrel.chat_template import MEDIA_PAD
from kestrel.models.builtin import EMBEDDED_DIR, model_dir
from kestrel.models.checkpoint import save_checkpoint
from kestrel.tokenizer import save_tokenizer
from kestrel.train.data import HELD_OUT, episodes
from kestrel.train.recipes import RECIPES, k3_mini_config, with_vision_tower
from kestrel.train.sft import SFTTrainer, trained_model
from kestrel.train.stop_signal import stopped_early
from kestrel.train.tokenizer import corpus_texts, train_tokenizer
from kestrel.train.vision_data import vision_episodes

log = logging.getLogger(__name__)
HELD_OUT_SEED = 10_000  # the held-out loss is measured on held-out phrasings and slot values, another stream


def run_sft(
    recipe_name: str,
    out_dir: str | Path,
    steps: int | None = None,
    max_minutes: float | None = None,
    ship: bool = False,
) -> SFTTrainer:
    recipe = RECIPES[recipe_name]
    torch.manual_seed(recipe.sft.seed)
    if steps is not None:
        recipe.sft.steps = steps
    if max_minutes is not None:
        recipe.sft.max_minutes = max_minutes
    train = episodes(recipe.sft.seed, recipe.train_episodes, recipe.data)
    held_out = episodes(HELD_OUT_SEED, recipe.eval_episodes, recipe.data, HELD_OUT)
    if recipe.vision is not None:  # the visual task, from its own seeds (eval's held-out images are others still)
        train += vision_episodes(recipe.sft.seed + 1, recipe.vision.episodes)
        held_out += vision_episodes(HELD_OUT_SEED + 1, max(recipe.eval_episodes // 4, 4))
    out = Path(out_dir)
    if recipe.init_from is not None:
        if recipe.vision is not None:
            raise ValueError(f"recipe {recipe_name}: init_from with a vision mix is `kestrel train vision`'s job")
        model, config, tok = trained_model(model_dir(recipe.init_from))
        if bool(config.get("tie_word_embeddings", False)) != recipe.tie_embeddings:  # the shape is the base's
            raise ValueError(f"recipe {recipe_name}: tie_embeddings={recipe.tie_embeddings}, its init_from is not")
        trainer = SFTTrainer(config, tok, train, held_out, recipe.sft, out, model=model)
        return finish_sft(trainer, ship)
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer(corpus_texts(train[:20000]), recipe.vocab_target)
        tok_dir.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, tok_dir)
    vocab = -(-tok.get_vocab_size() // 64) * 64
    config = k3_mini_config(vocab, recipe.hidden, recipe.layers, recipe.experts, recipe.tie_embeddings)
    if recipe.vision is not None:
        config = with_vision_tower(config, recipe.vision, tok.token_to_id(MEDIA_PAD))
    return finish_sft(SFTTrainer(config, tok, train, held_out, recipe.sft, out), ship)


def finish_sft(trainer: SFTTrainer, ship: bool) -> SFTTrainer:
    state = trainer.train()
    log.info("trained %d steps in %.1f min; held-out loss %s", state.step, state.seconds / 60, state.eval_loss[-1])
    if ship and not stopped_early():
        ship_embedded(trainer)
    return trainer


def ship_embedded(trainer: SFTTrainer, target: Path = EMBEDDED_DIR) -> Path:
    """Write the trained model as bf16 safetensors + tokenizer under the package: the default model."""
    if target.exists():
        shutil.rmtree(target)
    save_checkpoint(trainer.model, trainer.model_config_dict, target, dtype=torch.bfloat16)
    save_tokenizer(trainer.tokenizer, target)
    summary = {
        "steps": trainer.state.step,
        "minutes": round(trainer.state.seconds / 60, 1),
        "held_out_loss": trainer.state.eval_loss[-1][1],
    }
    (target / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return target
