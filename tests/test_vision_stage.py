"""LLaVA stage 1 (`kestrel train vision`): a tower learns against the frozen kestrel-mini, whose language-model
tensors come out byte-identical, and the draft's target hash covers exactly those tensors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kestrel.chat_template import MEDIA_PAD, MEDIA_TOKENS
from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.models.checkpoint import VISION_PREFIXES, text_weights_sha256
from kestrel.tokenizer import load_tokenizer
from kestrel.train.vision_eval import vision_answer
from kestrel.train.vision_stage import run_vision_stage, ship_vision, with_media_tokens


def test_text_weights_hash_ignores_the_tower_and_sees_every_text_tensor(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["kimi_k3"]
    tensors = load_file(src / "model.safetensors")
    before = text_weights_sha256(src)
    with_tower = tmp_path / "with_tower"
    with_tower.mkdir()
    save_file(tensors | {"vision_tower.patch_embed.proj.weight": torch.ones(4, 3)}, with_tower / "model.safetensors")
    assert text_weights_sha256(with_tower) == before
    for name in sorted(tensors)[:: max(1, len(tensors) // 6)]:  # a one-ulp change anywhere in the text model shows
        moved = tmp_path / name
        moved.mkdir()
        t = tensors[name].clone()
        t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(float("inf"), dtype=t.dtype))
        save_file(tensors | {name: t}, moved / "model.safetensors")
        assert text_weights_sha256(moved) != before, name


@pytest.fixture(scope="module")
def stage_run(tiny_checkpoints, tmp_path_factory):
    """The tiny stage against a tiny random K3 text model (the same code path as kestrel-mini, in seconds)."""
    base = tiny_checkpoints["kimi_k3"]
    out = tmp_path_factory.mktemp("vision_stage")
    first = run_vision_stage("tiny", base, out, steps=1)
    resumed = run_vision_stage("tiny", base, out, steps=2)
    return first, resumed, out, base


def test_vision_stage_trains_the_tower_and_leaves_the_text_model_byte_identical(stage_run):
    first, resumed, out, base = stage_run
    assert first.state.step == 1 and resumed.state.step == 2 and len(resumed.state.train_loss) == 2
    assert (out / "loss_curve.png").exists()
    trainable = {n for n, p in resumed.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(VISION_PREFIXES) for n in trainable)
    assert all(p.grad is None for n, p in resumed.model.named_parameters() if n not in trainable)
    assert text_weights_sha256(out / "checkpoint") == text_weights_sha256(base)
    saved = load_file(out / "checkpoint" / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in saved) and any(k.startswith("mm_projector.") for k in saved)
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    assert config["image_token_id"] == load_tokenizer(out / "checkpoint").token_to_id(MEDIA_PAD)


def test_image_markers_are_appended_after_every_text_id_and_adding_them_again_moves_nothing():
    text = "<|im_user|>user<|im_middle|>3+4?<|im_end|><think>The answer is 42.</think>The answer is 42."
    from tokenizers import Tokenizer, models, pre_tokenizers

    def text_only() -> Tokenizer:  # a text model's tokenizer, without the markers
        tok = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "answer": 2, "is": 3, "42": 4}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        return tok

    words = "the answer is 42 or not"
    tok = with_media_tokens(text_only(), 9)
    assert [tok.token_to_id(t) for t in MEDIA_TOKENS] == [5, 6, 7, 8]
    assert tok.encode(words).ids == text_only().encode(words).ids
    with pytest.raises(ValueError, match="token ids"):
        with_media_tokens(text_only(), 7)
    shipped = load_tokenizer(EMBEDDED_DIR)  # kestrel-mini sees: its markers are its last four ids
    m = shipped.get_vocab_size()
    assert [shipped.token_to_id(t) for t in MEDIA_TOKENS] == list(range(m - 4, m))
    again = with_media_tokens(load_tokenizer(EMBEDDED_DIR), 1024)
    assert again.get_vocab_size() == m and again.encode(text).ids == shipped.encode(text).ids


def test_projector_starts_at_the_text_embedding_norm(tiny_checkpoints):
    from kestrel.models.vision.inputs import encode_images
    from kestrel.models.vision.preprocess import preprocess_image
    from kestrel.train.recipes import VISION_STAGES
    from kestrel.train.vision_data import render_image
    from kestrel.train.vision_stage import vision_stage_model

    model, _, _ = vision_stage_model(tiny_checkpoints["kimi_k3"], VISION_STAGES["tiny"].tower)
    images = [preprocess_image(render_image("shape", 100 + i)[0], model.cfg.vision) for i in range(4)]
    with torch.no_grad():
        ratio = (
            torch.cat(encode_images(model, images)).norm(dim=-1).mean()
            / model.model.embed_tokens.weight.norm(dim=-1).mean()
        )
    assert 0.5 < float(ratio) < 2.0


def test_ship_vision_installs_the_tower_and_keeps_the_text_summary(stage_run, tmp_path):
    _, resumed, _, base = stage_run
    target = tmp_path / "mini"
    shutil.copytree(base, target)
    (target / "training_summary.json").write_text(json.dumps({"eval": {"tools/tool_call_exact": 1.0}}))
    ship_vision(resumed, target, "tiny", target)
    config = json.loads((target / "config.json").read_text())
    summary = json.loads((target / "training_summary.json").read_text())
    assert config["vision_config"]["hidden_size"] == 32 and "eval" in summary and summary["vision"]["steps"] == 2
    assert summary["vision"]["text_weights_sha256"] == text_weights_sha256(base) == text_weights_sha256(target)


@pytest.mark.parametrize(
    ("kind", "answer"), [("color", "red"), ("shape", "star"), ("count", 3), ("number", 47), ("number", 0)]
)
def test_the_short_reply_style_reads_back_as_its_answer(kind, answer):
    from kestrel.train.vision_data import _reply

    reasoning, content = _reply(kind, answer, "short")
    assert vision_answer(kind, f"<think>{reasoning}</think>{content}") == answer


def test_a_vision_stage_with_an_adapter_trains_it_beside_the_frozen_text_model_and_resumes_it(
    tiny_checkpoints, tmp_path
):
    """`--lora-rank`: tower and a PEFT adapter learn, every text tensor stays byte-identical, the adapter trains only
    the language model's attention / dense projections, and a resumed run starts from the saved adapter."""
    from kestrel.models.lora import load_peft
    from kestrel.train.recipes import VISION_LORA_TARGETS

    base, out = tiny_checkpoints["kimi_k3"], tmp_path / "run"
    first = run_vision_stage("tiny", base, out, steps=1, lora_rank=2)
    saved = load_peft(out / "adapter")
    assert saved.r == 2 and set(saved.weights) == set(first.adapter.weights)
    assert all(".experts." not in m and m.rsplit(".", 1)[-1] in VISION_LORA_TARGETS for m in saved.weights)
    assert not any(m.startswith(VISION_PREFIXES) for m in saved.weights)
    assert any(b.abs().sum() > 0 for _, b in saved.weights.values()), "B starts at zero: one step must move it"
    assert text_weights_sha256(out / "checkpoint") == text_weights_sha256(base)

    again = run_vision_stage("tiny", base, out, steps=1, lora_rank=2)  # resumes at step 1: nothing left to train
    assert again.state.step == 1
    for module, (a, b) in load_peft(out / "adapter").weights.items():
        assert torch.equal(a, saved.weights[module][0]) and torch.equal(b, saved.weights[module][1]), module

    # Shipping installs the adapter as the checkpoint's vision-lora/, pinned to the weights it was trained against.
    from kestrel.engine.vision_adapter import ADAPTER_DIR, adapter_mismatch

    target = tmp_path / "shipped"
    shutil.copytree(base, target)
    ship_vision(again, target, "tiny", target)
    assert set(load_peft(target / ADAPTER_DIR).weights) == set(saved.weights) and adapter_mismatch(target) is None

    # A base that already sees (the shipped kestrel-mini) retrains from its text weights with a fresh tower.
    from kestrel.train.recipes import VISION_STAGES
    from kestrel.train.sft import trained_model
    from kestrel.train.vision_stage import vision_stage_model

    shipped = trained_model(target)[0].state_dict()
    model, config, _ = vision_stage_model(target, VISION_STAGES["tiny"].tower, seed=5)
    fresh = model.state_dict()
    assert set(fresh) == set(shipped) and config["vision_config"]["hidden_size"] == 32
    for name, tensor in shipped.items():
        if not name.startswith(VISION_PREFIXES):
            assert torch.equal(fresh[name], tensor), name
    assert any(not torch.equal(fresh[n], t) for n, t in shipped.items() if n.startswith("vision_tower."))


def test_tower_pretraining_moves_only_tower_and_projector_resumes_and_feeds_stage_one(tiny_checkpoints, tmp_path):
    """`--pretrain-minutes`: the tower learns the kinds as a classifier (no decoder in the loop), resumes from its
    saved state, and stage 1 then starts from the pretrained tower (text tensors untouched throughout)."""
    from kestrel.train.recipes import VISION_STAGES
    from kestrel.train.vision_data import KINDS
    from kestrel.train.vision_pretrain import STATE_FILE, TowerPretrain, TowerPretrainer
    from kestrel.train.vision_stage import vision_stage_model

    base = tiny_checkpoints["kimi_k3"]
    model, _, _ = vision_stage_model(base, VISION_STAGES["tiny"].tower)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TowerPretrain(steps=2, batch_size=8, warmup_steps=1, eval_every=2, eval_images=8)
    state = TowerPretrainer(model, cfg, tmp_path / "pre").train()
    assert state.step == 2 and len(state.loss) == 2 and set(state.accuracy[-1][1]) == set(KINDS)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.startswith(VISION_PREFIXES) for n in moved)
    assert any(n.startswith("vision_tower.") for n in moved) and any(n.startswith("mm_projector.") for n in moved)

    fresh, _, _ = vision_stage_model(base, VISION_STAGES["tiny"].tower)
    cfg.steps = 3
    resumed = TowerPretrainer(fresh, cfg, tmp_path / "pre")
    assert resumed.state.step == 2
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in fresh.named_parameters())
    assert resumed.train().step == 3 and (tmp_path / "pre" / STATE_FILE).exists()

    out = tmp_path / "stage"
    trainer = run_vision_stage("tiny", base, out, steps=1, pretrain_steps=2)
    assert (out / "pretrain" / STATE_FILE).exists() and trainer.state.step == 1
    pretrained = torch.load(out / "pretrain" / STATE_FILE, weights_only=False)["tower"]
    for name, p in trainer.model.vision_tower.named_parameters():  # stage 1 leaves a pretrained tower as it is
        assert not p.requires_grad and torch.equal(p, pretrained[name]), name
    assert any(p.grad is not None for p in trainer.model.mm_projector.parameters())
    assert text_weights_sha256(out / "checkpoint") == text_weights_sha256(base)

    # `--tower-from`: a retrained text model reuses the shipped pretrained tower (the tower never read the text
    # model) and runs stage 1 only; the tower stays frozen and the record of its pretraining is carried over.
    source = tmp_path / "seeing"
    shutil.copytree(base, source)
    ship_vision(trainer, source, "tiny", source, pretrained={"steps": 2, "minutes": 0.0, "held_out_accuracy": {}})
    again = run_vision_stage("tiny", base, tmp_path / "again", steps=1, tower_from=source)
    assert not (tmp_path / "again" / "pretrain").exists() and again.state.step == 1
    for name, p in again.model.vision_tower.named_parameters():
        assert not p.requires_grad and torch.equal(p, pretrained[name]), name
    assert any(p.grad is not None for p in again.model.mm_projector.parameters())
    target = tmp_path / "reshipped"
    shutil.copytree(base, target)
    from kestrel.train.vision_stage import reuse_tower

    ship_vision(again, target, "tiny", target, pretrained=reuse_tower(again.model, source))
    record = json.loads((target / "training_summary.json").read_text())["vision"]["tower_pretraining"]
    assert record["steps"] == 2 and record["from"] == "seeing"
    with pytest.raises(ValueError, match="records no pretrained tower"):
        run_vision_stage("tiny", base, tmp_path / "none", steps=1, tower_from=base)


def test_resume_from_starts_tower_projector_and_adapter_from_a_seeing_model(tiny_checkpoints, tmp_path):
    """`--resume-from`: after the text model trains further, stage 1 starts from the seeing model's tower (frozen),
    projector and vision adapter instead of fresh ones; an adapter of another rank is refused by name."""
    from kestrel.engine.vision_adapter import ADAPTER_DIR
    from kestrel.models.lora import load_peft
    from kestrel.train.recipes import VISION_STAGES
    from kestrel.train.sft import trained_model
    from kestrel.train.vision_stage import resume_projector_and_adapter, vision_adapter, vision_stage_model

    base = tiny_checkpoints["kimi_k3"]
    first = run_vision_stage("tiny", base, tmp_path / "first", steps=1, lora_rank=2)
    source = tmp_path / "seeing"
    shutil.copytree(base, source)
    ship_vision(first, source, "tiny", source, pretrained={"steps": 2, "minutes": 0.0, "held_out_accuracy": {}})
    seeing, saved = trained_model(source)[0], load_peft(source / ADAPTER_DIR)

    model, _, _ = vision_stage_model(base, VISION_STAGES["tiny"].tower, seed=7)
    adapter = vision_adapter(model, 2, seed=7)
    resume_projector_and_adapter(model, adapter, source)
    for name, tensor in seeing.mm_projector.state_dict().items():
        assert torch.equal(model.mm_projector.state_dict()[name], tensor), name
    assert set(adapter.weights) == set(saved.weights)
    for module, (a, b) in saved.weights.items():
        assert torch.equal(adapter.weights[module][0], a.float()) and torch.equal(adapter.weights[module][1], b.float())
    with pytest.raises(ValueError, match="rank 2"):
        resume_projector_and_adapter(model, vision_adapter(model, 4), source)

    resumed = run_vision_stage("tiny", base, tmp_path / "resumed", steps=1, lora_rank=2, resume_from=source)
    for name, p in resumed.model.vision_tower.named_parameters():
        assert not p.requires_grad and torch.equal(p, seeing.vision_tower.state_dict()[name]), name
    assert text_weights_sha256(tmp_path / "resumed" / "checkpoint") == text_weights_sha256(base)
    with pytest.raises(ValueError, match="give one"):
        run_vision_stage("tiny", base, tmp_path / "both", steps=1, tower_from=source, resume_from=source)


def test_ship_refuses_a_base_that_is_not_a_shipped_model(tiny_checkpoints, tmp_path):
    """The vision stage ships into the base's own folder only for the shipped models, and says so before training."""
    with pytest.raises(ValueError, match="a shipped tower belongs to a shipped model"):
        run_vision_stage("tiny", tiny_checkpoints["kimi_k3"], tmp_path / "run", steps=1, ship=True)
    assert not (tmp_path / "run" / "checkpoint").exists()
