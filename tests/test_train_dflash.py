"""The DFlash distillation trainer: learns, resumes where it stopped, writes a loadable draft and a loss curve."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kestrel.models.checkpoint import text_weights_sha256
from kestrel.models.loader import load_model
from kestrel.spec.draft import load_draft, save_draft
from kestrel.train.dflash import DFlashTrainConfig, DFlashTrainer, block_loss, ship_draft


def _cfg(steps: int) -> DFlashTrainConfig:
    return DFlashTrainConfig(
        num_prompts=6,
        held_out_prompts=2,
        max_new_tokens=12,
        num_layers=1,
        anchors_per_seq=6,
        seqs_per_step=2,
        steps=steps,
        eval_every=2,
        save_every=2,
        lr=3e-3,
        warmup_steps=1,
    )


def test_dflash_trainer_learns_resumes_and_writes_a_loadable_draft(tiny_checkpoints, tmp_path):
    target = tiny_checkpoints["kimi_k3"]
    out = tmp_path / "run"
    first = DFlashTrainer(target, out, _cfg(2))
    first.train()
    assert (out / "distill_data.json").exists() and first.state.step == 2
    # Every sequence is the target's own greedy continuation of a chat prompt.
    seq, prompt_len = first.data[0]
    assert len(seq) > prompt_len
    resumed = DFlashTrainer(target, out, _cfg(12))
    assert resumed.state.step == 2  # picked up the saved state, data and weights
    state = resumed.train()
    assert state.step == 12 and (out / "loss_curve.png").exists()
    losses = [loss for _, loss in state.train_loss]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # it learns
    cfg = json.loads((out / "checkpoint" / "config.json").read_text())
    assert cfg["target_sha256"] == text_weights_sha256(target) and cfg["num_hidden_layers"] == 1
    model, _ = load_model(target)
    draft = load_draft(out / "checkpoint", model)
    seq, plen = resumed.data[3]
    hidden = dict(zip(draft.cfg.target_layer_ids, resumed.hidden[3].float().chunk(len(draft.cfg.target_layer_ids), -1)))
    loss, accept = block_loss(draft, seq, hidden, [plen - 1], 4, 4.0)
    assert loss.isfinite() and 1 <= float(accept[0]) <= 4


def test_warm_start_begins_from_the_given_draft_and_refuses_another_shape(tiny_checkpoints, tmp_path):
    """--init-draft: step 0 holds the given draft's weights (same held-out acceptance), then trains on; a draft of
    another version of the target warm-starts too and the result records this target's hash; a draft of another
    shape is refused by the field that differs."""
    target = tiny_checkpoints["kimi_k3"]
    first = DFlashTrainer(target, tmp_path / "first", _cfg(4))
    first.train()
    warm = DFlashTrainer(
        target, tmp_path / "warm", dataclasses.replace(_cfg(2), init_draft=str(first.out / "checkpoint"))
    )
    for (name, a), b in zip(warm.draft.named_parameters(), first.draft.parameters()):
        assert torch.equal(a, b), name
    assert warm.evaluate() == pytest.approx(first.evaluate())
    warm.train()
    assert warm.state.step == 2
    # Shipping records the run's data and the summary of the draft it continued (here: a draft with none).
    shipped = ship_draft(warm, tmp_path / "shipped")
    summary = json.loads((shipped / "training_summary.json").read_text())
    assert summary["num_prompts"] == 6 and summary["warm_start"] == {"path": str(first.out / "checkpoint")}
    twice = DFlashTrainer(target, tmp_path / "twice", dataclasses.replace(_cfg(1), init_draft=str(shipped)))
    twice.train()
    history = json.loads((ship_draft(twice, tmp_path / "shipped2") / "training_summary.json").read_text())
    assert history["warm_start"] == summary and history["steps"] == 1
    other = tmp_path / "other"
    save_draft(first.draft, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg | {"target_sha256": "0" * 64}))
    rebased = DFlashTrainer(target, tmp_path / "rebased", dataclasses.replace(_cfg(2), init_draft=str(other)))
    assert torch.equal(next(rebased.draft.parameters()), next(first.draft.parameters()))
    assert rebased.draft.cfg.target_sha256 == text_weights_sha256(target) != "0" * 64
    (other / "config.json").write_text(json.dumps(cfg | {"block_size": cfg["block_size"] + 1}))
    with pytest.raises(ValueError, match="block_size"):
        DFlashTrainer(target, tmp_path / "refused", dataclasses.replace(_cfg(2), init_draft=str(other)))


def test_a_seeded_answer_file_is_extended_with_the_missing_prompts_only(tmp_path, monkeypatch):
    """A folder whose `distill_data.json` covers the first prompts (a copied earlier run) generates answers only for
    the rest, in prompt order; a file covering more prompts than asked is cut to them."""
    from types import SimpleNamespace

    from kestrel.train import dflash

    asked: list[list[str]] = []

    def fake_answers(path, prompts, max_new_tokens):
        asked.append(list(prompts))
        return [([7, len(asked), i], 1) for i in range(len(prompts))]

    monkeypatch.setattr(dflash, "target_answers", fake_answers)
    kept = [[[1, 2, 3], 1], [[4, 5], 1], [[6], 1]]
    (tmp_path / "distill_data.json").write_text(json.dumps(kept))
    trainer = SimpleNamespace(
        out=tmp_path, target_path=tmp_path, cfg=DFlashTrainConfig(num_prompts=5), state=dflash.DFlashTrainState()
    )
    data = DFlashTrainer._data(trainer)
    assert asked == [dflash.chat_prompts(0, 5)[3:]]
    assert data[:3] == [tuple(x) for x in kept] and data[3:] == [([7, 1, 0], 1), ([7, 1, 1], 1)]
    assert json.loads((tmp_path / "distill_data.json").read_text()) == [list(x) for x in data]
    trainer.cfg = DFlashTrainConfig(num_prompts=2)
    assert DFlashTrainer._data(trainer) == data[:2] and len(asked) == 1


def test_ship_installs_a_draft_beside_the_shipped_model_it_records_and_refuses_others(tiny_checkpoints, tmp_path):
    """`--ship` puts the embedded model's draft in its asset and the tied candidate's in its `dflash/` (a test of the
    candidate checks that draft's hash); a draft of any other model is refused before anything trains."""
    from kestrel.models.builtin import EMBEDDED_DIR, TIED_DIR
    from kestrel.spec.draft import EMBEDDED_DRAFT_DIR
    from kestrel.train.dflash import run_dflash, shipped_draft_dir

    assert shipped_draft_dir(EMBEDDED_DIR) == EMBEDDED_DRAFT_DIR
    assert shipped_draft_dir(TIED_DIR) == TIED_DIR / "dflash"
    other = tiny_checkpoints["kimi_k3"]
    assert shipped_draft_dir(other) is None
    with pytest.raises(ValueError, match="a shipped draft belongs to a shipped model"):
        run_dflash(str(other), tmp_path / "run", steps=1, ship=True)
    assert not (tmp_path / "run").exists()
