from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kestrel.engine.detokenizer import IncrementalDetokenizer

EOS = "<|eos|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Streaming text one token at a time.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "Emoji: 😀 🎉 👍🏽 ❤️ 🚀 — done.",
    "def f(x):\n    return x * 2  # code too",
    "Stop strings like ### or </answer> end generation.",
]


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """A small byte-level BPE (vocab 400): rare characters split into several byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return tok


def stream(text: str, prompt: str = "", **kw) -> tuple[IncrementalDetokenizer, list[str], list[int]]:
    tok = tokenizer()
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, tok.encode(prompt).ids if prompt else [], **kw)
    deltas = [detok.push(i) for i in ids]
    return detok, deltas, ids


TEXT = st.text(
    alphabet=st.one_of(st.characters(codec="utf-8"), st.sampled_from(list("你好世界天气😀🎉👍🏽❤️🚀é \n#<>/"))),
    max_size=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXT, prompt=st.sampled_from(["", "Hi 你好", "😀"]))
def test_deltas_concatenate_to_decode(text, prompt):
    detok, deltas, ids = stream(text, prompt)
    tail = detok.flush()
    assert "".join(deltas) + tail == tokenizer().decode(ids)
    assert detok.text == tokenizer().decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert not detok.stopped


@settings(max_examples=100, deadline=None)
@given(text=TEXT, data=st.data(), include=st.booleans())
def test_stop_string_property(text, data, include):
    # Stop strings: either a substring of the text (usually spanning tokens) or an arbitrary short string.
    if text and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(text) - 1))
        stop = text[i : data.draw(st.integers(i + 1, min(len(text), i + 6)))]
    else:
        stop = data.draw(st.text(alphabet=st.sampled_from("ab#😀"), min_size=1, max_size=3))
    detok, deltas, _ = stream(text, stop=[stop], include_stop_str_in_output=include)
    out = "".join(deltas) + detok.flush()
    pos = text.find(stop)
    if pos < 0:
        assert out == text and not detok.stopped and detok.stop_reason is None
    else:
        assert out == text[: pos + (len(stop) if include else 0)]
        assert detok.stopped and detok.stop_reason == stop
    assert out == detok.text


def test_multibyte_characters_are_held_until_complete():
    tok = tokenizer()
    ids = tok.encode("🚀").ids
    assert len(ids) > 1, "emoji should be split into byte tokens by the small vocab"
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.push(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🚀"


def test_flush_releases_incomplete_character_like_decode():
    # Generation cut mid-character (max_tokens): flush emits what decode() would show.
    tok = tokenizer()
    ids = tok.encode("ok 🚀").ids[:-1]
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(detok.push(i) for i in ids)
    assert out in ("ok", "ok ")  # the space may share a token with the emoji's first byte
    assert out + detok.flush() == tok.decode(ids)


def test_stop_string_spanning_tokens_is_never_emitted():
    tok = tokenizer()
    text = "Hello world </answer> trailing text"
    ids = tok.encode(text).ids
    assert len(tok.encode("</answer>").ids) > 1
    detok = IncrementalDetokenizer(tok, [], stop=["</answer>"])
    emitted, pushed = "", 0
    while not detok.stopped:
        emitted += detok.push(ids[pushed])
        pushed += 1
        # never a partial "</ans..." prefix in the emitted stream
        assert "<" not in emitted
    assert detok.stop_reason == "</answer>"
    assert tok.decode(ids[:pushed]).endswith("</answer>")  # stopped on the token that completed it
    assert emitted == "Hello world "
    assert detok.push(ids[0]) == "" and detok.flush() == ""
    assert detok.text == "Hello world "


def test_include_stop_str_in_output():
    detok, deltas, _ = stream("say 你好 then ### more", stop=["###"], include_stop_str_in_output=True)
    assert "".join(deltas) == "say 你好 then ###"
    assert detok.stopped and detok.text == "say 你好 then ###"


def test_partial_prefix_released_by_flush():
    detok, deltas, _ = stream("the end </ans", stop=["</answer>"])
    assert "".join(deltas) == "the end "
    assert detok.flush() == "</ans"
    assert not detok.stopped and detok.text == "the end </ans"


def test_partial_prefix_released_when_disambiguated():
    detok, deltas, _ = stream("a </a> b", stop=["</answer>"])
    assert "".join(deltas) == "a </a> b"
    assert not detok.stopped


def test_earliest_stop_wins():
    detok, deltas, _ = stream("x END y STOP", stop=["STOP", "END"])
    assert "".join(deltas) == "x " and detok.stop_reason == "END"


def test_skip_special_tokens():
    tok = tokenizer()
    ids = [*tok.encode("hi").ids, tok.token_to_id(EOS)]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(skip.push(i) for i in ids) + skip.flush() == "hi"
    assert "".join(keep.push(i) for i in ids) + keep.flush() == "hi" + EOS


def test_rejects_empty_stop_string():
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer(), [], stop=[""])
