"""AgentX-style serving benchmark: synthetic agent sessions replayed against any OpenAI-compatible endpoint.

A session is one agent working through `turns` steps over a growing context: a long system prompt shared by every
session (so prefix caches can help), then per turn a user message carrying a tool result, and an assistant reply of a
requested length (`max_tokens` = `min_tokens`, `ignore_eos`) whose text joins the history for the next turn. The
workload (texts and lengths) is a pure function of the seed; the replies are whatever the server returns.

For each concurrency level c, `sessions_per_level` sessions (default c) run with at most c at a time; levels run in
order. Per request: TTFT (first content or reasoning text), inter-token latencies (gaps between text chunks) and
per-user speed (output tokens / (end - first token)); per level: percentiles and output tokens / wall time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from kestrel.keepalive import CLIENT_KEEPALIVE_S

# Common English and tool-output words: mostly one token each in BPE vocabularies, so n words ≈ n tokens.
WORDS = tuple(
    """the of and to in is that for it as with was on be by this are or from at an not have which but all were
    when we there can more if out so what up its about into than them only other new some time could these two may
    then first any like now my such make over our even most after also made many before must through back years
    where much your way well down should because each just those people how too good very great still own see men
    work long here between both under never same another know while last might us off without again place around
    however small found thought went say part once high upon every general hand against during left number course
    file line error value return function class import module path test result status request response server
    client cache token page slot layer model batch queue thread memory buffer index key query table column row
    config option default true false none null list dict string int float bytes json yaml build run step check
    pass fail warning info debug trace stack frame call args kwargs output input read write open close send recv
    0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024""".split()
)
LOGNORMAL_SIGMA = 1.0  # output lengths: median × e^±1 covers the middle 68%; P90 ≈ 3.6 × median


@dataclass(frozen=True)
class Workload:
    """Sizes of the synthetic sessions, in tokens (≈ words)."""

    turns: int = 4
    system_tokens: int = 2000
    tool_tokens_min: int = 100
    tool_tokens_max: int = 2000
    output_tokens_median: int = 150
    min_output_tokens: int = 16
    max_output_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if not 1 <= self.tool_tokens_min <= self.tool_tokens_max:
            raise ValueError("tool_tokens_min and tool_tokens_max must satisfy 1 <= min <= max")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("min_output_tokens and max_output_tokens must satisfy 1 <= min <= max")
        if self.system_tokens < 0 or self.output_tokens_median < 1:
            raise ValueError("system_tokens must be >= 0 and output_tokens_median >= 1")


@dataclass(frozen=True)
class Turn:
    user: str  # the tool result (and, on the first turn, the task)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    index: int
    system: str
    turns: tuple[Turn, ...]


def _words(rng: random.Random, n: int, per_line: int = 16) -> str:
    picked = rng.choices(WORDS, k=n)
    return "\n".join(" ".join(picked[i : i + per_line]) for i in range(0, n, per_line))


def system_prompt(seed: int, workload: Workload) -> str:
    rules = _words(random.Random(f"{seed}/system"), workload.system_tokens)
    return f"You are a coding agent. Follow the rules below.\n{rules}"


def make_session(seed: int, index: int, workload: Workload, system: str | None = None) -> Session:
    """Session `index` of the workload for `seed` (independent of every other session, so levels can grow)."""
    rng = random.Random(f"{seed}/session/{index}")
    lo, hi = math.log(workload.tool_tokens_min), math.log(workload.tool_tokens_max)
    turns = []
    for t in range(workload.turns):
        tool = _words(rng, round(math.exp(rng.uniform(lo, hi))))
        task = f"Task {index}: {_words(rng, 12)}\n\n" if t == 0 else ""
        out = round(rng.lognormvariate(math.log(workload.output_tokens_median), LOGNORMAL_SIGMA))
        out = min(max(out, workload.min_output_tokens), workload.max_output_tokens)
        turns.append(Turn(f"{task}Tool result {t + 1}:\n{tool}", out))
    return Session(index, system if system is not None else system_prompt(seed, workload), tuple(turns))


def request_body(session: Session, turn: int, replies: list[str], model: str | None) -> dict[str, Any]:
    """The streamed chat request of `turn`, given the assistant replies of the turns before it."""
    messages = [{"role": "system", "content": session.system}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": session.turns[t].user})
        if t < turn:
            messages.append({"role": "assistant", "content": replies[t]})
    n = session.turns[turn].max_tokens
    body: dict[str, Any] = {"model": model} if model else {}
    return body | {
        "messages": messages,
        "max_tokens": n,
        "min_tokens": n,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass
class RequestRecord:
    """One request. Times in seconds; `start` is relative to the start of its level."""

    concurrency: int
    session: int
    turn: int
    max_tokens: int
    start: float = 0.0
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (prefix-cache hits)
    speed: float | None = None  # output tokens / (end - first token)
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any], record: RequestRecord) -> str:
    """POST one streamed chat completion, filling `record`; returns the reply text (content, else reasoning)."""
    content, reasoning = [], []
    chunks, completion_tokens = 0, None
    t0 = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            record.status = r.status_code
            if not 200 <= r.status_code < 300:
                record.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    record.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    break
                if event.get("usage"):
                    completion_tokens = event["usage"].get("completion_tokens")
                    record.prompt_tokens = event["usage"].get("prompt_tokens")
                    record.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text, think = delta.get("content") or "", delta.get("reasoning_content") or ""
                    if not (text or think or delta.get("tool_calls")):
                        continue
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        record.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    content.append(text)
                    reasoning.append(think)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    record.latency = end - t0
    record.output_tokens = completion_tokens if completion_tokens is not None else chunks
    if first is not None:
        record.ttft = first - t0
        if end > first and record.output_tokens:
            record.speed = record.output_tokens / (end - first)
    elif record.error is None:
        record.error = "no output tokens"
    return "".join(content) or "".join(reasoning)


async def _run_session(client, session: Session, model, concurrency: int, t_level: float, records, bar) -> None:
    replies: list[str] = []
    for turn in range(len(session.turns)):
        record = RequestRecord(concurrency, session.index, turn, session.turns[turn].max_tokens)
        record.start = time.perf_counter() - t_level
        replies.append(await stream_chat(client, request_body(session, turn, replies, model), record))
        records.append(record)
        bar.update(len(session.turns) - turn if not record.ok else 1)
        if not record.ok:  # an agent whose step failed stops; its later turns are not sent
            return


async def run_level(
    client: httpx.AsyncClient, sessions: list[Session], concurrency: int, model: str | None, progress: bool = True
) -> tuple[list[RequestRecord], float]:
    """Run `sessions` with at most `concurrency` at a time; returns the records and the level's wall time."""
    pending, records = list(sessions), []
    total = sum(len(s.turns) for s in sessions)
    with tqdm(total=total, desc=f"concurrency {concurrency}", unit="req", disable=not progress) as bar:
        t_level = time.perf_counter()

        async def worker() -> None:
            while pending:
                await _run_session(client, pending.pop(0), model, concurrency, t_level, records, bar)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))
        wall = time.perf_counter() - t_level
    return records, wall


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (None for no values)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(concurrency: int, sessions: int, records: list[RequestRecord], wall: float) -> dict[str, Any]:
    """Per-level figures. Latency percentiles are the slow tail (P90 = 90% of requests were at least this fast); so
    is speed P90: the per-user speed that 90% of requests reached, i.e. the 10th percentile of speeds."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [gap for r in ok for gap in r.itl]
    speed = [r.speed for r in ok if r.speed is not None]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "sessions": sessions,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "itl_p50_s": percentile(itl, 50),
        "itl_p90_s": percentile(itl, 90),
        "speed_p50_tok_s": percentile(speed, 50),
        "speed_p90_tok_s": percentile(speed, 10),
        "mean_prompt_tokens": (
            sum(r.prompt_tokens for r in ok) / len(ok) if ok and all(r.prompt_tokens is not None for r in ok) else None
        ),
        "prefix_cache_hit_rate": _hit_rate(ok),
    }


def _hit_rate(records: list[RequestRecord]) -> float | None:
    """Share of prompt tokens the server reported as cached (None when it reports no cached tokens)."""
    known = [r for r in records if r.prompt_tokens and r.cached_tokens is not None]
    return sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known) if known else None


def meets_slo(level: dict[str, Any], ttft_p90: float | None, speed_p90: float | None) -> bool | None:
    """P90 TTFT <= ttft_p90 and P90 speed >= speed_p90 (each if given), with no failed request; None without SLOs."""
    if ttft_p90 is None and speed_p90 is None:
        return None
    if level["errors"] or level["ttft_p90_s"] is None:
        return False
    if ttft_p90 is not None and level["ttft_p90_s"] > ttft_p90:
        return False
    return speed_p90 is None or (level["speed_p90_tok_s"] is not None and level["speed_p90_tok_s"] >= speed_p90)


@dataclass
class BenchConfig:
    base_url: str
    concurrency: list[int]
    seed: int = 0
    model: str | None = None  # None: the first model /v1/models lists
    sessions_per_level: int | None = None  # None: as many as the level's concurrency
    workload: Workload = field(default_factory=Workload)
    slo_ttft_p90: float | None = None
    slo_speed_p90: float | None = None
    api_key: str | None = None
    timeout: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency must be a non-empty list of values >= 1, got {self.concurrency}")
        if self.sessions_per_level is not None and self.sessions_per_level < 1:
            raise ValueError(f"sessions_per_level must be >= 1, got {self.sessions_per_level}")

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


async def _served_model(client: httpx.AsyncClient) -> str | None:
    """The first model /v1/models lists; raises ConnectionError when nothing answers (else every request would
    just be counted as an error, and a sweep of errors looks like a result)."""
    try:
        r = await client.get("/v1/models")
    except httpx.TransportError as exc:
        url = str(client.base_url).rstrip("/")
        raise ConnectionError(f"cannot reach the server at {url}: {exc or type(exc).__name__}") from None
    try:
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError):
        return None


async def _sweep(cfg: BenchConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(
        max_connections=max(cfg.concurrency) + 4,
        max_keepalive_connections=max(cfg.concurrency),
        keepalive_expiry=CLIENT_KEEPALIVE_S,  # sessions idle between turns: drop a connection before the server does
    )
    async with httpx.AsyncClient(base_url=cfg.root_url, headers=headers, timeout=cfg.timeout, limits=limits) as client:
        served = await _served_model(client)
        model = cfg.model or served
        system = system_prompt(cfg.seed, cfg.workload)
        levels, records, next_session = [], [], 0
        for c in cfg.concurrency:
            n = cfg.sessions_per_level or c
            sessions = [make_session(cfg.seed, next_session + i, cfg.workload, system) for i in range(n)]
            next_session += n
            level_records, wall = await run_level(client, sessions, c, model, cfg.progress)
            level_records.sort(key=lambda r: (r.session, r.turn))
            levels.append(summarize(c, n, level_records, wall))
            levels[-1]["meets_slo"] = meets_slo(levels[-1], cfg.slo_ttft_p90, cfg.slo_speed_p90)
            records += level_records
    passing = [lv["concurrency"] for lv in levels if lv["meets_slo"]]
    config = asdict(cfg) | {"model": model, "base_url": cfg.root_url}
    config.pop("api_key")
    return {
        "benchmark": "agentx",
        "config": config,
        "levels": levels,
        "max_concurrency_meeting_slo": max(passing) if passing else None,
        "requests": [asdict(r) for r in records],
    }


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Sweep the concurrency levels in order; returns config, per-level summary and per-request records."""
    return asyncio.run(_sweep(cfg))


SLO_MARK = {True: "yes", False: "no", None: "-"}


def percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def format_table(result: dict[str, Any]) -> str:
    def f(v, scale=1.0, fmt=".2f"):
        return "-" if v is None else format(v * scale, fmt)

    head = (
        f"{'conc':>5} {'reqs':>5} {'err':>4} {'TTFT p50/p90 s':>15} {'ITL p50/p90 ms':>15} "
        f"{'speed p50/p90 tok/s':>20} {'throughput tok/s':>17} {'cached':>7} {'SLO':>4}"
    )
    lines = [head, "-" * len(head)]
    for lv in result["levels"]:
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests']:>5} {lv['errors']:>4} "
            f"{f(lv['ttft_p50_s']) + '/' + f(lv['ttft_p90_s']):>15} "
            f"{f(lv['itl_p50_s'], 1e3, '.1f') + '/' + f(lv['itl_p90_s'], 1e3, '.1f'):>15} "
            f"{f(lv['speed_p50_tok_s'], fmt='.1f') + '/' + f(lv['speed_p90_tok_s'], fmt='.1f'):>20} "
            f"{f(lv['throughput_tok_s'], fmt='.1f'):>17} {percent(lv.get('prefix_cache_hit_rate')):>7} "
            f"{SLO_MARK[lv['meets_slo']]:>4}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Aggregate throughput against per-user speed P90, one point per concurrency (the AgentX figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [
        (lv["speed_p90_tok_s"], lv["throughput_tok_s"], lv["concurrency"])
        for lv in result["levels"]
        if lv["speed_p90_tok_s"] is not None and lv["throughput_tok_s"] is not None
    ]
    fig, ax = plt.subplots(figsize=(7, 5))
    if points:
        xs, ys, cs = zip(*points)
        ax.plot(xs, ys, "o-", color="tab:blue")
        for x, y, c in points:
            ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    ax.margins(0.15)
    ax.set_xlabel("per-user speed P90 (output tokens/s reached by 90% of requests)")
    ax.set_ylabel("aggregate output throughput (tokens/s)")
    cfg = result["config"]
    ax.set_title(f"AgentX sweep: {cfg['model'] or cfg['base_url']} (seed {cfg['seed']})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """`out_dir/bench_serve.json` and `out_dir/bench_serve.png`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / "bench_serve.json", out / "bench_serve.png"
    json_path.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")
    plot(result, png_path)
    return json_path, png_path
