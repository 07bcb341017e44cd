"""Byte-level BPE trained on the synthetic corpus, with digits kept as single tokens (arithmetic needs them)."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kestrel.chat_template import IM_END, MARKER_TOKENS, MEDIA_TOKENS, PAD, SPECIAL_TOKENS, render_chat
from kestrel.tokenizer import add_chat_tokens
from kestrel.train.data import Episode

CHAT_TOKENS = SPECIAL_TOKENS + MARKER_TOKENS + MEDIA_TOKENS


def corpus_texts(eps: Iterable[Episode]) -> Iterable[str]:
    """Rendered conversations with the chat tokens blanked out: those are added whole, never merged."""
    for ep in eps:
        text = render_chat(ep.messages, ep.tools, False, ep.reasoning_effort)
        for tok in CHAT_TOKENS:
            text = text.replace(tok, "\n")
        yield text


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    """Ids 0-2 are pad, bos and eos (<|im_end|>); the chat tokens come last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    n_added = len(CHAT_TOKENS) - 2  # PAD and IM_END are among the trainer's specials
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        special_tokens=[PAD, "<|bos|>", IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    add_chat_tokens(tok)
    return tok
