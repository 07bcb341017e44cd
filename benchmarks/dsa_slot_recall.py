"""Can a tool call's argument see the user's words? DSA top-k recall of the slot span, on a trained checkpoint.

kestrel-mini's only global-attention layers are DSA layers with a top-64 indexer, and its tool episodes run ~300
tokens (tool schemas first, the user turn last). While the model writes the call's argument (`"city": "Austin"`),
it can copy the city only if the indexer selects the user turn's `Austin` tokens. This prints, per DSA layer, the
fraction of (argument token, user-slot token) pairs inside the selected top-k: 1.0 means every slot token is
visible; chance is about top-k / position.

    .venv/bin/python benchmarks/dsa_slot_recall.py [CHECKPOINT] --episodes 40
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kestrel.models.builtin import EMBEDDED_DIR
from kestrel.models.forward_batch import ForwardBatch
from kestrel.models.loader import load_model
from kestrel.tokenizer import load_tokenizer
from kestrel.train.data import HELD_OUT, MINI_MIX, episodes
from kestrel.train.sft import encode_episode


def char_starts(pieces: list[str]) -> list[int]:
    starts, at = [], 0
    for piece in pieces:
        starts.append(at)
        at += len(piece)
    return starts


def token_span(starts: list[int], pieces: list[str], begin: int, end: int) -> list[int]:
    """Tokens overlapping characters [begin, end)."""
    return [i for i, s in enumerate(starts) if s < end and s + len(pieces[i]) > begin]


def slot_spans(tok, ep) -> tuple[list[int], list[list[int]], list[list[int]]] | None:
    """(ids, per slot: user-turn tokens, per slot: argument tokens) of one tool episode, or None."""
    ids, _ = encode_episode(tok, ep)
    pieces = [tok.decode([i]) for i in ids]
    text, starts = "".join(pieces), char_starts(pieces)
    user_at = text.find(ep.messages[0]["content"])
    call_at = text.find("<|tool_call_argument_begin|>", user_at)
    if user_at < 0 or call_at < 0:
        return None
    sources, targets = [], []
    for value in map(str, (ep.meta.get("slots") or {}).values()):
        src, arg = text.find(value, user_at), text.find(value, call_at)
        if 0 <= src < call_at and arg >= 0:
            sources.append(token_span(starts, pieces, src, src + len(value)))
            targets.append(token_span(starts, pieces, arg, arg + len(value)))
    return (ids, sources, targets) if sources else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", default=str(EMBEDDED_DIR))
    ap.add_argument("--episodes", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; checkpoint: {args.checkpoint}")
    tok = load_tokenizer(args.checkpoint)
    model, _ = load_model(args.checkpoint)
    model.eval()
    recall: dict[int, list[float]] = {}
    lengths, done = [], 0
    for ep in episodes(7, 20 * args.episodes, MINI_MIX, HELD_OUT):
        spans = slot_spans(tok, ep) if ep.kind == "tools" else None
        if spans is None:
            continue
        ids, sources, targets = spans
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.arange(len(ids)), extend_lens=[len(ids)], prefix_lens=[0]
        )
        batch.index_topk = {}
        with torch.no_grad():
            model(batch)
        for layer, positions in batch.index_topk.items():
            for src, tgt in zip(sources, targets):
                # The token before each argument token predicts it: those are the queries that must see the source.
                queries = [t - 1 for t in tgt]
                hits = [sum(s in set(positions[q].tolist()) for s in src) / len(src) for q in queries]
                recall.setdefault(layer, []).append(statistics.mean(hits))
        lengths.append(len(ids))
        done += 1
        if done >= args.episodes:
            break
    topk = next(layer.self_attn.indexer.topk for layer in model.model.layers if layer.kind == "dsa")
    print(f"{done} held-out tool episodes, median length {statistics.median(lengths)} tokens, index top-k {topk}")
    print("| DSA layer | slot tokens selected (mean over slots) |")
    print("|---|---|")
    for layer, values in sorted(recall.items()):
        print(f"| {layer} | {statistics.mean(values):.3f} |")


if __name__ == "__main__":
    main()
