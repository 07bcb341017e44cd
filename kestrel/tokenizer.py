"""Tokenizers: a checkpoint's own `tokenizer.json` (or K2's `tiktoken.model`), or a byte-level one for random
checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kestrel.chat_template import IM_END, JINJA_TEMPLATE, MARKER_TOKENS, MEDIA_PAD, MEDIA_TOKENS, PAD, SPECIAL_TOKENS

# Ids 0-2: pad, bos, eos (= <|im_end|>), so the make-model presets' pad/bos/eos ids 0/1/2 mean these.
BYTE_SPECIALS = (PAD, "<|bos|>", IM_END)
BYTE_VOCAB_SIZE = len(BYTE_SPECIALS) + 256 + len(SPECIAL_TOKENS) - 2 + len(MARKER_TOKENS) + len(MEDIA_TOKENS)
BYTE_IMAGE_TOKEN_ID = BYTE_VOCAB_SIZE - len(MEDIA_TOKENS) + MEDIA_TOKENS.index(MEDIA_PAD)  # <|media_pad|>


def add_chat_tokens(tok: Tokenizer) -> None:
    """Chat control tokens (dropped from output text), the reasoning / tool-call markers (kept), and the image
    markers (control tokens, added last so that older tokenizers' ids stay)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MEDIA_TOKENS])


def byte_level_tokenizer() -> Tokenizer:
    """Pad/bos/eos, one token per byte, then the chat tokens: any UTF-8 text and any chat round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab |= {ch: len(BYTE_SPECIALS) + i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|bos|>"])
    add_chat_tokens(tok)
    return tok


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character a byte-level vocabulary writes for each byte → that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


BYTE_LEVEL = _byte_level_table()


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to `ch`."""
    return BYTE_LEVEL[ch]


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json and chat_template.jinja carrying the Kimi chat template."""
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": PAD,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "chat_template": JINJA_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(JINJA_TEMPLATE)  # where transformers >= 5 looks first


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, else its tiktoken.model (Kimi K2 ships only that), else None."""
    file = Path(path) / "tokenizer.json"
    if file.exists():
        return Tokenizer.from_file(str(file))
    from kestrel.tiktoken_file import TIKTOKEN_FILE, tiktoken_tokenizer

    return tiktoken_tokenizer(path) if (Path(path) / TIKTOKEN_FILE).exists() else None
