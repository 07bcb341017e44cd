"""`kestrel` command line: make-model, generate (serve, bench, plan, train arrive with their issues)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import torch

from kestrel.config import EngineConfig


def cmd_make_model(args: argparse.Namespace) -> int:
    from kestrel.models.checkpoint import make_model
    from kestrel.models.loader import load_model, param_count

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    out = make_model(args.family, args.size, args.out, seed=args.seed, dtype=dtype)
    model, cfg = load_model(out)
    print(f"wrote {cfg.model_type} ({args.size}, {param_count(model) / 1e6:.2f}M parameters) to {out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kestrel import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    if llm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json; cannot encode --prompt", file=sys.stderr)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    print(args.prompt + out.outputs[0].text)
    return 0


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """One flag per `EngineConfig` field (`--page-size`, `--max-running-requests`, ...)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        default = defaults.get(f.name, f.default)
        kind = float if "float" in str(f.type) else int if "int" in str(f.type) else str
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default, dest=f.name)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}


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
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    add_engine_args(gen, max_total_tokens=4096)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
