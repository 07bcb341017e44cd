"""Tokenizers: a checkpoint's own `tokenizer.json`, or a plain byte-level one for random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BYTE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")


def byte_level_tokenizer() -> Tokenizer:
    """Ids 0-2 are pad/bos/eos, then one token per byte (259 in all): any UTF-8 text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIALS)}
    vocab |= {ch: len(BYTE_SPECIALS) + i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    return tok


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to `ch`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table[ch]


def save_tokenizer(
    tok: Tokenizer, out_dir: str | Path, eos_token: str = "<|eos|>", chat_template: str | None = None
) -> None:
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": "<|pad|>",
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template:
        config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    file = Path(path) / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.exists() else None
