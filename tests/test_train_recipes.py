"""Recipe model configs: the tied-embedding option builds, trains and round-trips through safetensors tied."""

from __future__ import annotations

import pytest
import torch

from kestrel.config import model_config_from_dict
from kestrel.models.checkpoint import init_random_, save_checkpoint
from kestrel.models.loader import build_model, load_weights
from kestrel.train.recipes import RECIPES, k3_mini_config
from kestrel.train.sft import lm_loss, packed_batch


def test_tied_config_shares_head_and_survives_save_load(tmp_path) -> None:
    config = k3_mini_config(128, hidden=64, layers=4, experts=4, tie_embeddings=True)
    model = init_random_(build_model(model_config_from_dict(config), torch.float32), 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = [1, 9, 10, 11, 3, 9, 10, 11]
    batch, targets = packed_batch([(ids, [False] * 5 + [True] * 3)], model.device)
    lm_loss(model, batch, targets).backward()
    unused_row = model.model.embed_tokens.weight.grad[100]  # token 100 is never an input: only the head reaches it
    assert unused_row.abs().sum() > 0
    save_checkpoint(model, config, tmp_path)
    fresh = build_model(model_config_from_dict(config), torch.float32)
    load_weights(fresh, tmp_path)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    torch.testing.assert_close(fresh.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_untied_by_default_and_probe_arms_differ_only_in_tying() -> None:
    untied = model_config_from_dict(k3_mini_config(128, hidden=64, layers=4, experts=4))
    assert not untied.tie_word_embeddings
    probe, tied = RECIPES["copy-probe"], RECIPES["copy-probe-tied"]
    assert not probe.tie_embeddings and tied.tie_embeddings
    assert (probe.hidden, probe.layers, probe.data, probe.sft) == (tied.hidden, tied.layers, tied.data, tied.sft)
    assert probe.sft is not tied.sft  # run_sft edits a recipe's SFTConfig in place


def test_mini_tied_is_mini_plus_the_three_copy_fixes() -> None:
    mini, tied = RECIPES["mini"], RECIPES["mini-tied"]
    assert not mini.tie_embeddings and tied.tie_embeddings
    assert mini.sft.dense_warmup_steps == 0 and tied.sft.dense_warmup_steps > 0
    assert tied.data[: len(mini.data)] == mini.data and [s.name for s in tied.data[len(mini.data) :]] == ["copy_random"]
    same = ("hidden", "layers", "experts", "vocab_target", "train_episodes", "eval_episodes")
    assert [getattr(mini, f) for f in same] == [getattr(tied, f) for f in same]
    assert tied.sft is not mini.sft and tied.sft.steps > mini.sft.steps  # the fixes need a longer schedule


def test_continued_recipe_starts_from_the_base_and_warms_up_dense_then_sparse(tmp_path, monkeypatch) -> None:
    from dataclasses import replace

    import kestrel.train.sft as sft
    from kestrel.train import run

    base = run.run_sft("tiny", tmp_path / "base", steps=6)
    tiny = RECIPES["tiny"]
    continued = replace(
        tiny,
        name="tiny-continued",
        init_from=str(tmp_path / "base" / "checkpoint"),
        sft=replace(tiny.sft, steps=4, dense_warmup_steps=2),
    )
    monkeypatch.setitem(run.RECIPES, "tiny-continued", continued)
    flags: list[bool] = []
    real = sft.set_dense_warmup
    monkeypatch.setattr(sft, "set_dense_warmup", lambda model, on: (flags.append(on), real(model, on))[1])
    trainer = run.run_sft("tiny-continued", tmp_path / "continued")
    assert flags == [True, True, False, False]  # dense for dense_warmup_steps, sparse after
    assert trainer.tokenizer.get_vocab() == base.tokenizer.get_vocab()
    # Same held-out set, the base's final weights: the continued run's step-0 loss is the base's last one.
    assert abs(trainer.state.eval_loss[0][1] - base.state.eval_loss[-1][1]) < 1e-5
    assert trainer.state.step == 4 and trainer.model_config_dict == base.model_config_dict
    monkeypatch.setitem(run.RECIPES, "tiny-continued", replace(continued, tie_embeddings=True))
    with pytest.raises(ValueError, match="tie_embeddings"):  # the shape comes from the base, not the recipe
        run.run_sft("tiny-continued", tmp_path / "tied")


def test_mini_continued_continues_the_embedded_model_with_the_copy_fixes() -> None:
    mini, continued = RECIPES["mini"], RECIPES["mini-continued"]
    assert continued.init_from == "kestrel-mini" and not continued.tie_embeddings  # the base's untied head
    assert continued.sft.dense_warmup_steps > 0 and continued.sft.max_minutes == mini.sft.max_minutes
    assert [s.name for s in continued.data[len(mini.data) :]] == ["copy_random"]


def test_mini_wide_continues_the_tied_candidate_on_the_wider_phrasings() -> None:
    """`mini-wide` = the tied candidate's mix with arithmetic from `WIDE_MIX`, started from the candidate's weights
    (tied head), step-budgeted so a loaded machine trains the same model."""
    from kestrel.models.builtin import TIED_DIR
    from kestrel.train.data import WIDE_MIX

    tied, wide = RECIPES["mini-tied"], RECIPES["mini-wide"]
    assert wide.init_from == str(TIED_DIR) and wide.tie_embeddings
    assert wide.data[: len(WIDE_MIX)] == WIDE_MIX and wide.data[len(WIDE_MIX) :] == tied.data[len(WIDE_MIX) :]
    assert [s.name for s in wide.data] == [s.name for s in tied.data]
    assert wide.data[0] != tied.data[0] and wide.data[1:] == tied.data[1:]
    assert wide.sft.max_minutes is None and wide.sft.dense_warmup_steps == 0 and wide.sft.lr < tied.sft.lr
