"""Accuracy and memory of the low-precision formats on the embedded model (kestrel-mini), against the unquantized
run, in one process:

* FP8 KV (`--kv-cache-dtype fp8_e4m3`), NVFP4 KV with MXFP4 index keys (`nvfp4`), and MXFP4 routed experts (the
  checkpoint rewritten by `kestrel make-model --from ... --weight-format mxfp4`), each against the baseline
  (same checkpoint, `auto` KV = the fp32 engine dtype, dense experts).
* Greedy tokens: the baseline generates on held-out arithmetic and tool prompts; each format then reads the
  baseline's sequences (teacher forcing through its own KV pool and experts) and we report the fraction of
  generated positions whose argmax equals the baseline token and the mean KL(baseline ‖ format) of the next-token
  distributions. Free-running: the fraction of the baseline's generated tokens each format reproduces position by
  position when it generates on its own.
* `kestrel eval --task arithmetic|tools` scores per format and their deltas to the baseline (points = 100 × share).
* Memory: KV token capacity of the engine per format at the same --mem-fraction of the same free-memory reading
  (read once, so every engine sizes from the same number), for kestrel-mini and for a DSA stack at K3.1 widths,
  with the NVFP4 / FP8 ratio next to the planner's; MXFP4 experts' resident bytes vs bf16.

    .venv/bin/python benchmarks/quant_accuracy.py --threads 2 -n 100
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import write_result

import kestrel.engine.capacity as capacity_module
from kestrel import LLM, SamplingParams
from kestrel.chat_template import render_chat
from kestrel.models.builtin import builtin_model_path
from kestrel.models.checkpoint import convert_checkpoint, make_model
from kestrel.models.layers.moe_mxfp4 import expert_bytes
from kestrel.plan import kv_bytes_per_token_layer, resolve_model
from kestrel.train.data import arithmetic_episode, tool_episode
from kestrel.train.evaluate import HELD_OUT_SEED, eval_arithmetic, eval_tools

RESULTS = Path(__file__).resolve().parent / "results" / "quant_accuracy.json"
KV_FORMATS = ("fp8_e4m3", "nvfp4")
PLAN_FORMAT = {"fp8_e4m3": "fp8", "nvfp4": "nvfp4"}


def prompts(n: int, tokenizer) -> list[list[int]]:
    """Held-out chat prompts (half arithmetic, half tool calls), distinct from the eval's own questions."""
    rng = random.Random(HELD_OUT_SEED + 77)
    texts = []
    for i in range(n):
        if i % 2:
            ep = tool_episode(rng)
            texts.append(render_chat(ep.messages[:1], ep.tools, True, ep.reasoning_effort))
        else:
            ep = arithmetic_episode(rng, rng.choice(["add", "sub", "mul", "pct"]))
            texts.append(render_chat(ep.messages[:1], None, True, "high"))
    return [tokenizer.encode(t).ids for t in texts]


def generate(llm: LLM, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def teacher_forced_logits(llm: LLM, prompt: list[int], output: list[int]) -> torch.Tensor:
    """fp32 logits [len(output), V] predicting each of `output`'s tokens, read through `llm`'s own cache and weights."""
    runner = llm.engine.runner
    captured: list[torch.Tensor] = []
    execute = runner.execute

    def spy(plan, routed=False):
        logits, batch = execute(plan, routed)
        captured.extend(logits.prompt.values())
        return logits, batch

    runner.execute = spy
    try:
        seq = prompt + output
        llm.generate([seq], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        del runner.execute
    logits = torch.cat(captured)  # rows of every prefill chunk, in order: position i predicts token i + 1
    return logits[len(prompt) - 1 : len(seq) - 1].float()


def compare(base: LLM, other: LLM, batch, base_out, other_out) -> dict[str, float]:
    agree = total = 0
    kls = []
    for p, o in zip(batch, base_out):
        if not o:
            continue
        # float64: the KL of nearly equal distributions is below fp32's resolution of the log-probabilities.
        ref = torch.log_softmax(teacher_forced_logits(base, p, o).double(), dim=-1)
        got = torch.log_softmax(teacher_forced_logits(other, p, o).double(), dim=-1)
        agree += int((got.argmax(-1) == torch.tensor(o)).sum())
        total += len(o)
        kls += (ref.exp() * (ref - got)).sum(-1).tolist()
    free = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(base_out, other_out))
    return {
        "teacher_forced_identical_tokens": agree / total,
        "mean_kl": statistics.fmean(kls),
        "max_kl": max(kls),
        "free_running_identical_tokens": free / sum(len(o) for o in base_out),
        "identical_sequences": sum(x == y for x, y in zip(base_out, other_out)) / len(base_out),
        "generated_tokens": total,
    }


def evals(llm: LLM, n: int) -> dict[str, float]:
    scores = {f"arithmetic/{k}": v for k, v in eval_arithmetic(llm, n).items()}
    return scores | {f"tools/{k}": v for k, v in eval_tools(llm, n).items()}


def capacities(path: str, free: int, mem_fraction: float, formats) -> dict[str, int]:
    """Engine KV token capacity per format, every engine sizing from the same free-memory reading."""
    saved = capacity_module.free_memory_bytes
    capacity_module.free_memory_bytes = lambda device: free
    try:
        out = {}
        for fmt in formats:
            llm = LLM(
                path, kv_cache_dtype=fmt, mem_fraction=mem_fraction, max_running_requests=4, max_model_len=1 << 24
            )
            out[fmt] = llm.engine.pages.num_pages * llm.engine.config.page_size
            del llm
        return out
    finally:
        capacity_module.free_memory_bytes = saved


def planner_ratio(path: str) -> float:
    cfg = resolve_model(path)
    per = {
        f: sum(kv_bytes_per_token_layer(cfg, cfg.layer_kinds[i], PLAN_FORMAT[f]) for i in cfg.attention_layers)
        for f in KV_FORMATS
    }
    return per["fp8_e4m3"] / per["nvfp4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts for the token / KL comparison")
    ap.add_argument("--max-tokens", type=int, default=96, help="baseline tokens generated per prompt")
    ap.add_argument("-n", type=int, default=100, help="questions per eval task (kestrel eval's -n)")
    ap.add_argument("--mem-fraction", type=float, default=0.002, help="same fraction for every format")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.time()
    mini = str(builtin_model_path())
    tmp = Path(tempfile.mkdtemp(prefix="kestrel-quant-"))
    mx_path = str(convert_checkpoint(mini, tmp / "mini-mxfp4", "mxfp4"))
    print(f"torch {torch.__version__} | threads {torch.get_num_threads()} | kestrel-mini | fp32 engine dtype")

    base = LLM(mini)
    variants = {
        "fp8_e4m3 KV": LLM(mini, kv_cache_dtype="fp8_e4m3"),
        "nvfp4 KV": LLM(mini, kv_cache_dtype="nvfp4"),
        "mxfp4 experts": LLM(mx_path),
    }
    batch = prompts(args.prompts, base.tokenizer)
    base_out = generate(base, batch, args.max_tokens)
    base_scores = evals(base, args.n)
    print(f"baseline: {sum(map(len, base_out))} generated tokens; eval {base_scores}", flush=True)
    accuracy = {}
    for name, llm in variants.items():
        row = compare(base, llm, batch, base_out, generate(llm, batch, args.max_tokens))
        scores = evals(llm, args.n)
        row["eval"] = scores
        row["eval_delta_points"] = {k: 100 * (scores[k] - base_scores[k]) for k in scores}
        accuracy[name] = row
        print(
            f"{name}: identical tokens {row['teacher_forced_identical_tokens']:.4f} (teacher-forced), "
            f"{row['free_running_identical_tokens']:.4f} (free-running), mean KL {row['mean_kl']:.2e}, "
            f"eval deltas {row['eval_delta_points']}",
            flush=True,
        )
    packed, bf16 = expert_bytes(variants["mxfp4 experts"].engine.model)

    free = capacity_module.free_memory_bytes(torch.device("cpu"))
    k31 = make_model(
        "deepseek_v32",
        "tiny",
        tmp / "k31-dsa",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        index_head_dim=128,
        max_position_embeddings=1 << 24,
        num_hidden_layers=2,
    )
    memory = {}
    for label, path in (("kestrel-mini", mini), ("dsa-k31-widths", str(k31))):
        cap = capacities(path, free, args.mem_fraction, ("auto", *KV_FORMATS))
        ratio = cap["nvfp4"] / cap["fp8_e4m3"]
        memory[label] = {"capacity_tokens": cap, "nvfp4_over_fp8": ratio, "planner_nvfp4_over_fp8": planner_ratio(path)}
        print(
            f"{label}: KV tokens {cap}; NVFP4/FP8 {ratio:.3f} (planner {memory[label]['planner_nvfp4_over_fp8']:.3f})"
        )
    print(f"MXFP4 routed experts: {packed} B resident vs {bf16} B in bf16 ({packed / bf16:.3f}x)")

    print(f"\n{'format':>14} | {'same tok (TF)':>13} | {'same tok (free)':>15} | {'mean KL':>9} | eval deltas (points)")
    print("-" * 100)
    for name, r in accuracy.items():
        deltas = ", ".join(f"{k} {v:+.1f}" for k, v in r["eval_delta_points"].items())
        print(
            f"{name:>14} | {r['teacher_forced_identical_tokens']:>13.4f} | "
            f"{r['free_running_identical_tokens']:>15.4f} | {r['mean_kl']:>9.2e} | {deltas}"
        )
    write_result(
        args.out,
        "quant_accuracy",
        model="kestrel-mini",
        engine_dtype="float32",
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        eval_n=args.n,
        mem_fraction=args.mem_fraction,
        free_memory_bytes=free,
        baseline_eval=base_scores,
        accuracy=accuracy,
        memory=memory,
        mxfp4_expert_bytes={"resident": packed, "bf16": bf16, "ratio": packed / bf16},
        seconds=time.time() - t_start,
    )


if __name__ == "__main__":
    main()
