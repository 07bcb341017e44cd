"""Synthetic data, tokenizer, chat template agreement with transformers, and the SFT trainer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.chat_template import render_chat
from kestrel.models.loader import load_model
from kestrel.tokenizer import save_tokenizer
from kestrel.train.data import episodes
from kestrel.train.sft import encode_episode
from kestrel.train.synth.arithmetic import percent_trace
from kestrel.train.synth.tools import tool_episode
from kestrel.train.tokenizer import corpus_texts, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(corpus_texts(episodes(0, 1500)), 1024)


def test_episodes_are_deterministic_and_cover_every_kind():
    a, b = episodes(3, 300), episodes(3, 300)
    assert [e.messages for e in a] == [e.messages for e in b]
    assert {e.kind for e in a} == {"arithmetic", "tools", "smalltalk"}
    assert "15% of 240 is 36" in percent_trace(15, 240)


def test_tool_episode_uses_kimi_k2_call_format():
    import random

    ep = tool_episode(random.Random(0), category="get_weather")
    text = render_chat(ep.messages, ep.tools, False)
    args = json.dumps(ep.answer["arguments"], ensure_ascii=False)
    assert (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{args}<|tool_call_end|><|tool_calls_section_end|>" in text
    )
    assert any(t["function"]["name"] == "get_weather" for t in ep.tools)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_round_trips_arbitrary_utf8(tokenizer, text):
    # Special tokens are kept on decode: hypothesis also draws the module's own literals, such as "<|bos|>".
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_round_trips_every_rendered_episode(tokenizer):
    """Made-up names, unit symbols and non-ASCII places ("São Paulo", "°F") come back byte for byte."""
    from kestrel.train.evaluate import tool_cases

    eps = episodes(8, 300) + [ep for _, ep in tool_cases(4)]
    for ep in eps:
        text = render_chat(ep.messages, ep.tools, False, ep.reasoning_effort)
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("12345").ids
    assert [tokenizer.id_to_token(i) for i in ids] == list("12345")


def test_kestrel_template_equals_transformers_apply_chat_template(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tokenizer, tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for ep in episodes(5, 40):
        for gen in (True, False):
            ours = render_chat(ep.messages, ep.tools, gen, ep.reasoning_effort)
            theirs = hf.apply_chat_template(
                ep.messages,
                tools=ep.tools,
                add_generation_prompt=gen,
                tokenize=False,
                reasoning_effort=ep.reasoning_effort,
            )
            assert ours == theirs


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    for ep in episodes(6, 30):
        ids, mask = encode_episode(tokenizer, ep)
        whole = tokenizer.encode(render_chat(ep.messages, ep.tools, False, ep.reasoning_effort)).ids
        assert ids == whole
        learned = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        replies = " ".join(m.get("content") or "" for m in ep.messages if m["role"] == "assistant")
        assert "<|im_user|>" not in learned and "<|im_system|>" not in learned
        for m in ep.messages:
            if m["role"] == "assistant" and m.get("content"):
                assert m["content"] in learned
            if m["role"] == "user" and m["content"] not in replies:  # ("Goodbye" → "Goodbye! Have a ...")
                assert m["content"] not in learned


def test_short_training_lowers_held_out_loss_and_resumes(tmp_path):
    from kestrel.train.run import run_sft

    trainer = run_sft("tiny", tmp_path / "run", steps=40)
    first, last = trainer.state.eval_loss[0][1], trainer.state.eval_loss[-1][1]
    assert last < 0.75 * first, trainer.state.eval_loss
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000
    model, cfg = load_model(tmp_path / "run" / "checkpoint")  # the loader's format
    assert cfg.model_type == "kimi_k3"
    resumed = run_sft("tiny", tmp_path / "run", steps=50)
    assert resumed.state.step == 50 and resumed.state.train_loss[39][0] == 40
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["steps"] == 50


def test_stop_signal_asks_for_a_stop_once_then_interrupts_and_restores_the_handlers():
    import os
    import signal

    from kestrel.train.stop_signal import STOP, stopped_early

    before = signal.getsignal(signal.SIGTERM)
    with STOP.installed():
        assert STOP.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert STOP.requested == "SIGTERM"  # the handler ran; nothing was raised
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before and stopped_early()  # --ship refuses a signalled run
    with STOP.installed():
        assert not stopped_early()


def test_sigterm_stops_sft_after_its_step_with_the_checkpoint_saved(tmp_path):
    """`kestrel train sft` on SIGTERM: the step in flight finishes, the checkpoint and trainer state are saved at
    the step reached, the process exits 0 without a traceback."""
    import re
    import signal
    import subprocess
    import sys
    import time

    import torch

    out, err = tmp_path / "run", tmp_path / "stderr.log"
    cmd = [sys.executable, "-m", "kestrel.cli", "train", "sft", "--recipe", "tiny", "--out", str(out)]
    with open(err, "w") as stderr:
        proc = subprocess.Popen([*cmd, "--steps", "100000"], stdout=subprocess.PIPE, stderr=stderr, text=True)
    deadline = time.monotonic() + 180
    while max(map(int, re.findall(r" (\d+)/100000 ", err.read_text())), default=0) < 3:  # tqdm: 3 steps done
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    log = err.read_text()
    assert proc.returncode == 0 and "Traceback" not in log, log[-3000:]
    step = torch.load(out / "trainer_state.pt", weights_only=False)["state"]["step"]
    assert 3 <= step < 100000 and f"trained {step} steps" in stdout and "SIGTERM: stopping at step" in log
    assert (out / "checkpoint" / "config.json").exists()
