"""`kestrel` command line: make-model, generate (serve, bench, plan, train arrive with their issues)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

BUILTIN_DIR = Path.home() / ".cache" / "kestrel" / "builtin-tiny-k3"


def builtin_model_path() -> Path:
    """A tiny random K3.1-shaped checkpoint, made once by Kestrel itself (no download)."""
    from kestrel.models.checkpoint import make_model

    if not (BUILTIN_DIR / "config.json").exists():
        make_model("kimi_k3", "tiny", BUILTIN_DIR, seed=0)
    return BUILTIN_DIR


def cmd_make_model(args: argparse.Namespace) -> int:
    from kestrel.models.checkpoint import make_model
    from kestrel.models.loader import load_model, param_count

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    out = make_model(args.family, args.size, args.out, seed=args.seed, dtype=dtype)
    model, cfg = load_model(out)
    print(f"wrote {cfg.model_type} ({args.size}, {param_count(model) / 1e6:.2f}M parameters) to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kestrel.models.loader import load_model
    from kestrel.models.simple_cache import greedy_generate
    from kestrel.tokenizer import load_tokenizer

    path = Path(args.model) if args.model else builtin_model_path()
    model, cfg = load_model(path)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        print(f"error: {path} has no tokenizer.json; cannot encode --prompt", file=sys.stderr)
        return 2
    prompt = tokenizer.encode(args.prompt).ids
    tokens, _ = greedy_generate(model, prompt, args.max_tokens)
    print(args.prompt + tokenizer.decode(tokens))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random checkpoint in a family's real on-disk format")
    mm.add_argument("--family", required=True, choices=["kimi_linear", "deepseek_v32", "kimi_k3"])
    mm.add_argument("--size", default="tiny", choices=["tiny", "small"])
    mm.add_argument("--out", required=True)
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    mm.set_defaults(func=cmd_make_model)

    gen = sub.add_parser("generate", help="complete a prompt (default model: the built-in one)")
    gen.add_argument("model", nargs="?", default=None)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
