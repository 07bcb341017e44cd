"""A K2-style `tiktoken.model` checkpoint tokenizer, built offline, against a rank-order byte-pair-merge oracle."""

from __future__ import annotations

import base64
import json
from collections import Counter

import pytest
import regex

from kestrel.tiktoken_file import KIMI_PATTERN, TiktokenFileError, tiktoken_tokenizer
from kestrel.tokenizer import load_tokenizer

CORPUS = (
    "Hello world! The weather in Beijing is sunny; the weather in Shanghai isn't. "
    "Kestrel serves DeepSeek-V3 and Kimi K2 models. 12345 tokens, 2026 words.\n"
    "北京天气晴朗 上海下雨了 hello hello HELLO world's weather"
)
# V1: set intersection (`&&`) inside classes, as the Rust regex engine of tiktoken reads the pattern.
SPLIT = regex.compile(KIMI_PATTERN, flags=regex.V1)
SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 3}  # offsets above the ranks; offset 2 stays reserved


def _train_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A tiny BPE trainer: 256 byte ranks, then the most frequent adjacent pair within pre-split chunks."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in chunk.encode()) for chunk in SPLIT.findall(text))
    for _ in range(merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += count
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def _oracle_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's algorithm: per pre-split chunk, merge the adjacent pair whose union has the lowest rank."""
    ids = []
    for chunk in SPLIT.findall(text):
        parts = [bytes([b]) for b in chunk.encode()]
        while True:
            cands = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not cands:
                break
            _, i = min(cands)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


@pytest.fixture(scope="module")
def k2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k2_tok")
    ranks = _train_ranks(CORPUS, 120)
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    decoder = {str(len(ranks) + off): {"content": name, "special": True} for name, off in SPECIALS.items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    return folder, ranks


@pytest.mark.parametrize(
    "text",
    [CORPUS, "hello world", "The weather's fine, isn't it?\n\n  x = 42000;", "北京 weather 天气 ok", "   ", "ÿ€😀"],
)
def test_encoding_equals_rank_order_merges_and_round_trips(k2_folder, text):
    folder, ranks = k2_folder
    tok = load_tokenizer(folder)
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == _oracle_encode(text, ranks)
    assert tok.decode(ids) == text


def test_merges_actually_compress(k2_folder):
    folder, ranks = k2_folder
    ids = tiktoken_tokenizer(folder).encode("hello world weather", add_special_tokens=False).ids
    assert len(ids) < len(b"hello world weather") // 2 and max(ids) >= 256


def test_special_tokens_keep_their_ids_and_are_skipped_in_text(k2_folder):
    folder, ranks = k2_folder
    tok = tiktoken_tokenizer(folder)
    for name, off in SPECIALS.items():
        assert tok.token_to_id(name) == len(ranks) + off
    assert tok.token_to_id(f"<|reserved_token_{len(ranks) + 2}|>") == len(ranks) + 2
    ids = tok.encode("[BOS]hello<|im_end|>", add_special_tokens=False).ids
    assert ids[0] == len(ranks) and ids[-1] == len(ranks) + 3
    assert tok.decode(ids, skip_special_tokens=True) == "hello"


def test_malformed_file_names_the_line(tmp_path):
    (tmp_path / "tiktoken.model").write_text("aGk= 0\nnot-base64!! 1\n")
    with pytest.raises(TiktokenFileError, match=r"tiktoken.model:2"):
        tiktoken_tokenizer(tmp_path)


def test_a_k2_checkpoint_with_only_tiktoken_model_serves_completions(tmp_path):
    """make-model kimi_k2, its tokenizer.json swapped for a tiktoken.model: the server tokenizes with it."""
    import httpx
    from server_harness import running_server

    from kestrel.models.checkpoint import make_model

    path = make_model("kimi_k2", "tiny", tmp_path / "k2", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    ranks = _train_ranks(CORPUS, 60)
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    decoder = {str(len(ranks) + off): {"content": name, "special": True} for name, off in SPECIALS.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    config = json.loads((path / "config.json").read_text())
    config |= {"bos_token_id": len(ranks), "eos_token_id": len(ranks) + 1, "pad_token_id": len(ranks) + 1}
    (path / "config.json").write_text(json.dumps(config))
    prompt = "Hello world! The weather in Beijing"
    expected = _oracle_encode(prompt, ranks)
    assert len(expected) < len(prompt.encode())
    with running_server(str(path)) as (url, name):
        body = {"model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    assert resp["usage"]["prompt_tokens"] == len(expected)
    assert resp["usage"]["completion_tokens"] == 6 and isinstance(resp["choices"][0]["text"], str)
