"""A checkpoint's `tiktoken.model` (Kimi K2 style) → a `tokenizers.Tokenizer`, without the `tiktoken` package.

The file is one `base64(token bytes) rank` line per token; ranks are the ids and the merge order. Byte-pair
encoding that merges by rank is what a BPE model with merges sorted by the rank of their result computes, so the
file converts to the same fast tokenizer the engine uses for `tokenizer.json` checkpoints (as transformers'
`TikTokenConverter` does). Special tokens sit above the ranks, named in `tokenizer_config.json`'s
`added_tokens_decoder`; unnamed ids in that range are reserved, as in K2's own tokenizer.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kestrel.tokenizer import BYTE_LEVEL

TIKTOKEN_FILE = "tiktoken.model"
# Kimi K2's split pattern (tokenization_kimi.py): Han runs, cased words with English contractions, 1-3 digits.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
RESERVED_SPECIALS = 256  # K2 reserves this many ids after the ranks for special tokens


class TiktokenFileError(ValueError):
    """A malformed tiktoken.model or tokenizer_config.json; the message names the file and line."""


_UNICODE_OF = {b: ch for ch, b in BYTE_LEVEL.items()}


def _unicode(token: bytes) -> str:
    return "".join(_UNICODE_OF[b] for b in token)


def read_ranks(file: str | Path) -> dict[bytes, int]:
    """`base64 rank` lines → {token bytes: rank}."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            b64, rank = line.split()
            ranks[base64.b64decode(b64, validate=True)] = int(rank)
        except ValueError as exc:
            raise TiktokenFileError(f"{file}:{n}: expected 'base64-token rank' ({exc})") from exc
    if len(set(ranks.values())) != len(ranks):
        raise TiktokenFileError(f"{file}: ranks are not unique")
    return ranks


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocabulary and the merges that rebuild every multi-byte token, in rank order."""
    merges: list[tuple[bytes, bytes, int]] = []
    for token, rank in ranks.items():
        local = [
            (token[:i], token[i:], rank) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks
        ]
        merges += sorted(local, key=lambda m: (ranks[m[0]], ranks[m[1]]))
    merges.sort(key=lambda m: m[2])
    vocab = {_unicode(token): rank for token, rank in ranks.items()}
    return vocab, [(_unicode(a), _unicode(b)) for a, b, _ in merges]


def _specials(folder: Path, first_id: int) -> dict[int, str]:
    """Special tokens by id: the config's `added_tokens_decoder`, reserved names for the rest of K2's range."""
    config_file = folder / "tokenizer_config.json"
    named: dict[int, str] = {}
    if config_file.exists():
        try:
            decoder = json.loads(config_file.read_text()).get("added_tokens_decoder") or {}
            named = {int(i): entry["content"] for i, entry in decoder.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TiktokenFileError(f"{config_file}: bad 'added_tokens_decoder' ({exc})") from exc
    if named and min(named) < first_id:
        raise TiktokenFileError(f"{config_file}: added token id {min(named)} collides with the tiktoken ranks")
    last = max([first_id + RESERVED_SPECIALS - 1, *named]) if named else first_id - 1
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(first_id, last + 1)}


def tiktoken_tokenizer(folder: str | Path, pattern: str = KIMI_PATTERN) -> Tokenizer:
    """The checkpoint's tiktoken.model (+ tokenizer_config.json specials) as a fast tokenizer."""
    folder = Path(folder)
    ranks = read_ranks(folder / TIKTOKEN_FILE)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenFileError(f"{folder / TIKTOKEN_FILE}: ranks must be 0..{len(ranks) - 1} without gaps")
    vocab, merges = vocab_and_merges(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = _specials(folder, len(ranks))
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    for i, content in specials.items():
        if (got := tok.token_to_id(content)) != i:
            raise TiktokenFileError(f"{folder}: special token {content!r} should be id {i}, is {got}")
    return tok
