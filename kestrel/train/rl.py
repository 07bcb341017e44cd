"""`kestrel rl`: GRPO on verifiable rewards with a LoRA adapter over a frozen base, rollouts from live engines.

One step (every rank runs it on its share of the prompts; gradients are all-reduced):

1. draw `prompts_per_step` prompts from the recipe's tasks (one seeded stream, the same on every rank); rank r takes
   the groups g with g % world == r and asks the engines for `samples_per_prompt` samples of each (`/generate`, at
   the recipe's temperature, seeded, with logprobs and the routing capture), on the adapter version pushed last:
   every rollout's `meta_info` must name that version and checksum;
2. reward each sample (1 right / 0 wrong), normalise within its group, drop the groups whose rewards are all equal;
3. split the groups into `minibatches`; the first runs at the rollout's policy, the others one optimizer step
   later each, so their old logprobs are recomputed before any step. The trainer's forward replays the engine's
   routing (experts and DSA selections) and, with `deterministic`, runs batch-invariant: its old logprobs equal
   the engine's bit for bit (`train_rollout_logprob_abs_diff` is exactly 0);
4. per minibatch: the token-level loss of `kestrel.train.grpo`, divided by the minibatch's tokens over all ranks;
   gradients all-reduced, clipped, one AdamW step;
5. save the adapter (PEFT), push it to every engine as the next version.

Logged per step: reward (per task), kept groups, train/rollout logprob difference, its k3 KL, PPO-KL, clip
fraction, TIS weights, rollout vs training tokens/s; held-out accuracy every `eval_every` steps. Resumable from
`trainer_state.pt` + `adapter/`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from kestrel.config import ConfigError, load_model_config
from kestrel.dist import comm
from kestrel.dist.groups import Groups, ParallelLayout, single_groups
from kestrel.dist.launch import run_ranks
from kestrel.models.builtin import builtin_model_path
from kestrel.models.loader import load_model
from kestrel.models.lora import load_peft
from kestrel.tokenizer import load_tokenizer
from kestrel.train.grpo import ClipConfig, LossTerms, group_advantages, informative_groups, policy_loss
from kestrel.train.lora import attach_trainable, new_adapter, save_adapter
from kestrel.train.rl_curves import plot_curves
from kestrel.train.rl_tasks import Prompt, TaskMix, score
from kestrel.train.rollout_client import EngineProcess, RolloutClient, adapter_checksum, check_finite, check_versions
from kestrel.train.routing_replay import Rollout, sequence_logprobs
from kestrel.train.step_credit import Credit, step_credit
from kestrel.train.stop_signal import STOP

log = logging.getLogger(__name__)
STATE_FILE, ADAPTER_DIR = "trainer_state.pt", "adapter"


@dataclass
class RLConfig:
    steps: int = 40
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    minibatches: int = 2
    max_new_tokens: int = 160
    temperature: float = 1.0  # rollouts sample logits / temperature; the loss trains that tempered policy
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip: ClipConfig = field(default_factory=ClipConfig)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    micro_batch_tokens: int = 2048  # padded tokens per trainer forward (the KDA recurrence pads to the longest)
    eval_every: int = 10
    eval_n: int = 25  # held-out questions per category at each evaluation
    save_every: int = 5
    seed: int = 0
    max_minutes: float | None = None
    deterministic: bool = True  # batch-invariant trainer + --deterministic-inference engines: zero mismatch
    adapter_name: str = "policy"
    threads: int = 1  # torch threads of each trainer rank
    engine_threads: int | None = None  # torch threads of each engine the recipe starts (None: `threads`)
    engines: int = 1  # engines the run starts when given none; prompts are dealt to them in turn
    # Share of the zero-variance groups (dropped by dynamic filtering) still trained on the KL term alone. GRPO's
    # loss keeps every group, so its KL holds the behaviour the policy already gets right; DAPO drops them and has no
    # KL. With the filter and a KL, nothing holds what every sample gets right (`kl_anchor_groups`).
    kl_anchor_share: float = 0.0
    # A wrong trace's negative advantage applies from its first false step on, not to the right steps before it
    # (`kestrel.train.step_credit`; tasks without a `locate`, the tool calls, keep it on every token).
    step_credit: bool = False


def check_config(cfg: RLConfig, nproc: int = 1) -> None:
    """Refuse settings the loop cannot run, naming the field (before an engine starts or a rank spawns)."""

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"rl config field {name!r}: {why} (got {_field(cfg, name)!r})")

    for name in ("steps", "prompts_per_step", "minibatches", "max_new_tokens", "micro_batch_tokens", "save_every"):
        need(getattr(cfg, name) >= 1, name, "must be >= 1")
    need(cfg.samples_per_prompt >= 2, "samples_per_prompt", "must be >= 2 (advantages are normalised in the group)")
    need(cfg.minibatches <= cfg.prompts_per_step, "minibatches", "must be <= prompts_per_step (groups are split)")
    need(0 < cfg.temperature <= 2, "temperature", "must be in (0, 2] (the policy samples; 0 would be greedy)")
    need(cfg.lr > 0, "lr", "must be > 0")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.grad_clip > 0, "grad_clip", "must be > 0")
    need(0 <= cfg.clip.clip_low < 1, "clip.clip_low", "must be in [0, 1)")
    need(cfg.clip.clip_high >= 0, "clip.clip_high", "must be >= 0")
    need(cfg.clip.tis_cap >= 1, "clip.tis_cap", "must be >= 1 (a weight of 1 means the engine and trainer agree)")
    need(cfg.clip.kl_coef >= 0, "clip.kl_coef", "must be >= 0")
    need(0 <= cfg.kl_anchor_share <= 1, "kl_anchor_share", "must be in [0, 1]")
    need(cfg.kl_anchor_share == 0 or cfg.clip.kl_coef > 0, "kl_anchor_share", "needs clip.kl_coef > 0 (KL alone)")
    need(cfg.lora_rank >= 1, "lora_rank", "must be >= 1")
    need(len(cfg.lora_targets) > 0, "lora_targets", "must name at least one projection")
    need(cfg.eval_every >= 0, "eval_every", "must be >= 0 (0: never)")
    need(cfg.eval_n >= 1, "eval_n", "must be >= 1")
    need(cfg.max_minutes is None or cfg.max_minutes > 0, "max_minutes", "must be > 0")
    need(cfg.threads >= 1, "threads", "must be >= 1")
    need(cfg.engine_threads is None or cfg.engine_threads >= 1, "engine_threads", "must be >= 1")
    need(cfg.engines >= 1, "engines", "must be >= 1")
    need(bool(cfg.adapter_name) and "/" not in cfg.adapter_name, "adapter_name", "must be a non-empty name")
    if nproc < 1 or nproc > cfg.prompts_per_step:
        raise ConfigError(f"nproc: {nproc} data-parallel ranks; need 1 .. prompts_per_step ({cfg.prompts_per_step})")


def _field(cfg: RLConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@dataclass
class RLJob:
    """Everything a rank needs (picklable: spawned ranks receive it)."""

    config: RLConfig
    tasks: TaskMix
    out: str
    model: str | None = None  # checkpoint folder; None: the embedded kestrel-mini
    rollout_urls: list[str] = field(default_factory=list)
    sync_urls: list[str] | None = None
    device: str = "cpu"
    progress: bool = True

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else builtin_model_path()


@dataclass
class RLState:
    step: int = 0
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # one row of metrics per step
    held_out: list[dict[str, Any]] = field(default_factory=list)  # {"step": s, category: accuracy, ...}


def engine_flags(cfg: RLConfig, model_cfg) -> list[str]:
    """What a rollout engine needs: capture of the routing the trainer replays (on every answer, so a router in front
    cannot lose the request's ask), LoRA, zero-mismatch mode, fp32."""
    flags = ["--dtype", "float32", "--enable-lora", "--max-lora-rank", str(cfg.lora_rank)]
    flags += ["--max-running-requests", str(max(64, cfg.prompts_per_step * cfg.samples_per_prompt))]
    capture = [f"--enable-return-{c.replace('_', '-')}" for c in capture_fields(model_cfg)]
    flags += capture + (["--capture-by-default"] if capture else [])  # also behind sglang-router, which drops return_*
    return flags + (["--deterministic-inference"] if cfg.deterministic else [])


def rollout_seeds(cfg: RLConfig, step: int, groups: list[int]) -> list[int]:
    """The sampling seed of each group's first sample at a step (sample i uses seed + i): one stream per run seed,
    whatever rank or engine serves the group."""
    return [(cfg.seed * 1_000_003 + step) * 4096 + g * cfg.samples_per_prompt for g in groups]


def capture_fields(model_cfg) -> list[str]:
    """The routing records this model's replay consumes."""
    fields = ["routed_experts"] if "moe" in model_cfg.mlp_kinds else []
    return fields + (["indexer_topk"] if "dsa" in model_cfg.layer_kinds else [])


def kl_anchor_groups(cfg: RLConfig, step: int, groups: list[int], keep: torch.Tensor) -> torch.Tensor:
    """Which of `groups` (global indices; `keep` marks the informative ones) carry the KL term alone: a seeded draw
    per global group, the same whichever rank holds it, so N ranks anchor the groups one rank does."""
    draw = torch.rand(cfg.prompts_per_step, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step))
    return ~keep & (draw[groups] < cfg.kl_anchor_share)


def _reduce(values: list[float], groups: Groups, device, op=dist.ReduceOp.SUM) -> list[float]:
    x = torch.tensor(values, dtype=torch.float64, device=device)
    if groups.world.size > 1:
        dist.all_reduce(x, op=op, group=groups.world.device_group)
    return x.tolist()


def micro_batches(rollouts: list[tuple[Rollout, Credit]], budget: int) -> list[list[tuple[Rollout, Credit]]]:
    """Rollouts sorted by length, packed while (count x longest) stays within `budget` padded tokens."""
    out: list[list[tuple[Rollout, Credit]]] = []
    for item in sorted(rollouts, key=lambda ra: len(ra[0].input_ids)):
        if out and (len(out[-1]) + 1) * len(item[0].input_ids) <= budget:
            out[-1].append(item)
        else:
            out.append([item])
    return out


class GRPOTrainer:
    """One rank's trainer: the model with its adapter, the optimizer, the engines' client."""

    def __init__(self, job: RLJob, groups: Groups) -> None:
        check_config(job.config, groups.world.size)
        self.job, self.cfg, self.groups = job, job.config, groups
        self.rank, self.world = groups.rank, groups.world.size
        self.out = Path(job.out)
        torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(self.cfg.seed)
        self.device = torch.device(job.device)
        self.model, self.model_cfg = load_model(job.model_path, torch.float32, self.device)
        self.model.batch_invariant = self.cfg.deterministic
        self.model.train()  # the trainer's forward (DSA indexers take their training path; no dropout exists)
        self.tok = load_tokenizer(job.model_path)
        if self.tok is None:
            raise ValueError(f"model: {job.model_path} has no tokenizer.json (RL prompts are rendered chats)")
        adapter = new_adapter(
            self.model, list(self.cfg.lora_targets), self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.adapter_name
        )
        self.adapter = adapter
        self.manager, self.params = attach_trainable(self.model, adapter)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=self.cfg.lr, betas=(0.9, 0.99), weight_decay=self.cfg.weight_decay
        )
        self.state = RLState()
        self.client = RolloutClient(job.rollout_urls, job.sync_urls)
        self.capture = capture_fields(self.model_cfg)
        self.version: tuple[str, str] = ("", "")
        self._resume()

    # -- checkpoints --------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        state_file = self.out / STATE_FILE
        if not state_file.exists():
            return
        saved = torch.load(state_file, weights_only=False)
        adapter = load_peft(self.out / ADAPTER_DIR)
        with torch.no_grad():
            for module, (a, b) in self.adapter.weights.items():
                a.copy_(adapter.weights[module][0]), b.copy_(adapter.weights[module][1])
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        self.state = RLState(**saved["state"])
        if self.rank == 0:
            log.info("resumed from step %d", self.state.step)

    def save(self) -> None:
        """Rank 0: the adapter (PEFT), the optimizer, RNG and metrics (every rank holds the same)."""
        if self.rank != 0:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        save_adapter(self.adapter, self.out / ADAPTER_DIR, self.model_cfg.model_type, str(self.job.model_path))
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        torch.save(state | {"state": asdict(self.state)}, self.out / STATE_FILE)
        (self.out / "rl_config.json").write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")

    # -- the engines' adapter ----------------------------------------------------------------------------------
    def push(self) -> None:
        """Rank 0 saves the adapter and upserts it on every engine as version `step`; every rank learns the
        version and checksum (broadcast) its next rollouts must report."""
        version = str(self.state.step)
        digest = torch.zeros(32, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            path = self.out / "adapters" / f"step-{version}"
            save_adapter(self.adapter, path, self.model_cfg.model_type, str(self.job.model_path))
            checksum = adapter_checksum(path)
            self.client.push_adapter(self.cfg.adapter_name, path, version, checksum)
            for old in (self.out / "adapters").glob("step-*"):  # the engines read an adapter once, at load
                if old != path:
                    shutil.rmtree(old)
            digest = torch.tensor(list(bytes.fromhex(checksum)), dtype=torch.uint8, device=self.device)
        comm.broadcast(digest, self.groups.world)
        self.version = (version, bytes(digest.cpu().tolist()).hex())

    # -- one step -------------------------------------------------------------------------------------------------
    def prompts(self, step: int) -> list[Prompt]:
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        return self.job.tasks.sample(rng, self.cfg.prompts_per_step, self.tok)

    def rollouts(self, prompts: list[Prompt], mine: list[int], step: int) -> list[list[tuple[Rollout, str]]]:
        n = self.cfg.samples_per_prompt
        results = self.client.generate(
            [prompts[g].ids for g in mine],
            n,
            self.cfg.max_new_tokens,
            rollout_seeds(self.cfg, step, mine),
            temperature=self.cfg.temperature,
            lora=self.cfg.adapter_name,
            capture=self.capture,
        )
        check_versions(results, *self.version)
        check_finite(results)
        return [
            [(Rollout.from_generate(r, prompts[g].ids, self.model_cfg), r["text"]) for r in group]
            for g, group in zip(mine, results)
        ]

    def _logprobs(self, batch: list[tuple[Rollout, float]]) -> torch.Tensor:
        """The policy's logprobs of the output tokens: at the rollout temperature, the distribution they were drawn
        from."""
        rollouts, t = [r for r, _ in batch], self.cfg.temperature
        return torch.cat(sequence_logprobs(self.model, rollouts, replay=True, temperatures=(t,)))

    def _raw_and_policy(self, batch: list[tuple[Rollout, float]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw, policy) logprobs of one forward: the raw ones compare with the engine's (which reports logprobs of
        the raw logits, as vLLM does), the policy ones (logits / temperature) are what the loss trains."""
        if self.cfg.temperature == 1.0:
            lp = self._logprobs(batch)
            return lp, lp
        temperatures = (1.0, self.cfg.temperature)
        both = torch.cat(sequence_logprobs(self.model, [r for r, _ in batch], True, temperatures), dim=-1)
        return both[0], both[1]

    @torch.no_grad()
    def _reference(self, batch: list[tuple[Rollout, float]]) -> torch.Tensor:
        """The base's policy logprobs (the adapter switched off) with the same replayed routing."""
        self.manager.apply_to_all(None)
        try:
            return self._logprobs(batch)
        finally:
            self.manager.apply_to_all(self.manager.slot_of(self.cfg.adapter_name))

    def train_step(self) -> dict[str, Any]:
        cfg, step = self.cfg, self.state.step
        prompts = self.prompts(step)
        mine = [g for g in range(cfg.prompts_per_step) if g % self.world == self.rank]
        t0 = time.perf_counter()
        sampled = self.rollouts(prompts, mine, step)
        rollout_s = time.perf_counter() - t0

        tasks = self.job.tasks.tasks
        names = [t.name for t in tasks]
        per_task = [0.0] * (2 * len(tasks))  # (reward sum, samples) per task
        rows = []
        for g, group in zip(mine, sampled):
            task, ep = self.job.tasks.task(prompts[g].task), prompts[g].episode
            rows.append([task.reward(ep, text, r.output_ids) for r, text in group])
            per_task[2 * names.index(task.name)] += sum(rows[-1])
            per_task[2 * names.index(task.name) + 1] += len(rows[-1])
        rewards = torch.tensor(rows, dtype=torch.float64).reshape(len(mine), cfg.samples_per_prompt)
        advantages = group_advantages(rewards)
        keep = informative_groups(rewards)
        anchors = kl_anchor_groups(cfg, step, mine, keep)  # advantage 0: the KL term alone
        generated = sum(len(r.output_ids) for group in sampled for r, _ in group)

        # Minibatch m holds the global groups [m·P/M, (m+1)·P/M): the same split whatever the number of ranks.
        batches: list[list[tuple[Rollout, Credit]]] = [[] for _ in range(cfg.minibatches)]
        # The loss's normaliser: anchors add their KL, not weight (a minibatch without an informative group skips).
        informative_tokens = [0] * cfg.minibatches
        blamed = [0, 0, 0]  # with step credit: wrong rollouts trained, of them located, their tokens before the step
        for i, g in enumerate(mine):
            if keep[i] or anchors[i]:
                m = g * cfg.minibatches // cfg.prompts_per_step
                locate = self.job.tasks.task(prompts[g].task).locate if cfg.step_credit and keep[i] else None
                credits = [
                    step_credit(self.tok, r.output_ids, float(a), locate)
                    for (r, _), a in zip(sampled[i], advantages[i])
                ]
                batches[m] += [(r, c) for (r, _), c in zip(sampled[i], credits)]
                informative_tokens[m] += sum(len(r.output_ids) for r, _ in sampled[i]) if keep[i] else 0
                if locate is not None:
                    wrong = [c for c in credits if c.advantage < 0]
                    blamed[0] += len(wrong)
                    blamed[1] += sum(c.from_token > 0 for c in wrong)
                    blamed[2] += sum(c.from_token for c in wrong)

        t1 = time.perf_counter()
        micro = [micro_batches(batch, cfg.micro_batch_tokens) for batch in batches]
        with torch.no_grad():  # old logprobs: minibatch 0's own forward runs at the rollout's policy
            olds = [[None if m == 0 else self._raw_and_policy(mb) for mb in mbs] for m, mbs in enumerate(micro)]
            refs = [[self._reference(mb) for mb in mbs] for mbs in micro] if cfg.clip.kl_coef else None
        model_tokens = 0

        sums = dict(tokens=0.0, clipped=0.0, ppo_kl=0.0, ref_k3=0.0, tis=0.0, tis_truncated=0.0, diff=0.0, diff_k3=0.0)
        diff_max, grad_norms = 0.0, []
        for m in range(cfg.minibatches):
            (total,) = _reduce([informative_tokens[m]], self.groups, self.device)
            if total == 0:
                continue
            self.optimizer.zero_grad(set_to_none=False)
            for j, mb in enumerate(micro[m]):
                raw, logp = self._raw_and_policy(mb)
                old_raw, old = (raw.detach(), logp.detach()) if olds[m][j] is None else olds[m][j]
                engine = torch.tensor([lp for r, _ in mb for lp in r.logprobs], dtype=old.dtype, device=self.device)
                # The engine reports raw logprobs; its tempered one is the trainer's shifted by their difference
                # (exact when they agree, as under --deterministic-inference, where every TIS weight is 1).
                rollout = old - (old_raw - engine)
                per_token = [x for r, c in mb for x in c.per_token(len(r.output_ids))]
                adv = torch.tensor(per_token, dtype=old.dtype, device=self.device)
                terms = policy_loss(logp, old, rollout, adv, cfg.clip, None if refs is None else refs[m][j])
                (terms.loss / total).backward()
                self._accumulate(sums, terms, old_raw, engine)
                diff_max = max(diff_max, (old_raw - engine).abs().max().item())
                model_tokens += sum(len(r.input_ids) for r, _ in mb)
            self._all_reduce_grads()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)))
            self.optimizer.step()
        train_s = time.perf_counter() - t1

        stats = _reduce(
            [float(rewards.sum()), float(rewards.numel()), float(keep.sum()), float(generated), float(model_tokens)]
            + [float(anchors.sum())]
            + [float(b) for b in blamed]
            + per_task
            + list(sums.values()),
            self.groups,
            self.device,
        )
        maxima = _reduce([diff_max, rollout_s, train_s], self.groups, self.device, dist.ReduceOp.MAX)
        diff_max, rollout_s, train_s = maxima
        reward_sum, reward_n, kept, generated, model_tokens, anchored, wrong, located, unblamed = stats[:9]
        task_stats, s = stats[9 : 9 + len(per_task)], dict(zip(sums, stats[9 + len(per_task) :]))
        tok = max(s["tokens"], 1.0)
        row: dict[str, Any] = {
            "step": step + 1,
            "adapter_version": self.version[0],  # the version every rollout of this step reported
            "reward": reward_sum / reward_n,
            "kept_groups": kept / cfg.prompts_per_step,
            "kl_anchor_groups": anchored / cfg.prompts_per_step,
            # step credit: the share of wrong traces trained whose first false step was found, and the tokens before
            # it (advantage 0) per wrong trace
            "step_credit_located": located / wrong if cfg.step_credit and wrong else None,
            "step_credit_unblamed_tokens": unblamed / wrong if cfg.step_credit and wrong else None,
            "train_rollout_logprob_abs_diff": s["diff"] / tok,
            "train_rollout_logprob_abs_diff_max": diff_max,
            "train_rollout_k3": s["diff_k3"] / tok,
            "ppo_kl": s["ppo_kl"] / tok,
            "clip_frac": s["clipped"] / tok,
            "ref_k3": s["ref_k3"] / tok if cfg.clip.kl_coef else None,
            "tis_mean": s["tis"] / tok,
            "tis_truncated": s["tis_truncated"] / tok,
            "grad_norm": max(grad_norms, default=0.0),
            "trained_tokens": int(s["tokens"]),
            "rollout_tokens": int(generated),
            "rollout_s": rollout_s,
            "train_s": train_s,
            "rollout_tok_per_s": generated / max(rollout_s, 1e-9),
            "train_tok_per_s": model_tokens / max(train_s, 1e-9),
        }
        row |= {f"reward/{t.name}": task_stats[2 * i] / max(task_stats[2 * i + 1], 1) for i, t in enumerate(tasks)}
        return row

    @staticmethod
    def _accumulate(sums: dict[str, float], terms: LossTerms, old: torch.Tensor, rollout: torch.Tensor) -> None:
        d = rollout - old  # log π_rollout - log π_train at the same policy version
        sums["tokens"] += terms.tokens
        sums["clipped"] += terms.clipped
        sums["ppo_kl"] += terms.ppo_kl
        sums["ref_k3"] += terms.ref_k3
        sums["tis"] += terms.tis
        sums["tis_truncated"] += terms.tis_truncated
        sums["diff"] += d.abs().sum().item()
        sums["diff_k3"] += (torch.exp(d) - d - 1).sum().item()

    def _all_reduce_grads(self) -> None:
        """Sum the adapter's gradients over the data-parallel ranks (one flat buffer, one collective)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.groups.world)
        for p, g in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad = g.view_as(p).clone()

    # -- held-out accuracy ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Rank 0: greedy answers to the held-out questions through the engines, on the current adapter."""
        cases = self.job.tasks.held_out_prompts(self.cfg.eval_n, self.tok)
        by_budget: dict[int, list[int]] = {}
        for i, (_, _, _, budget) in enumerate(cases):
            by_budget.setdefault(budget, []).append(i)
        texts: dict[int, str] = {}
        for budget, idx in by_budget.items():
            results = self.client.generate(
                [cases[i][1].ids for i in idx], 1, budget, temperature=0.0, lora=self.cfg.adapter_name, logprobs=False
            )
            check_versions(results, *self.version)
            texts |= {i: group[0]["text"] for i, group in zip(idx, results)}
        right = [correct(p.episode, texts[i]) for i, (_, p, correct, _) in enumerate(cases)]
        return score([key for key, *_ in cases], right)

    def _evaluate_all_ranks(self) -> dict[str, float]:
        """Rank 0 evaluates (the others wait); its scores, recorded in the state (empty on other ranks)."""
        scores: dict[str, float] = {}
        if self.rank == 0 and self.job.tasks.held_out:
            scores = self.evaluate()
            self.state.held_out.append({"step": self.state.step} | scores)
            log.info("held-out at step %d: %s", self.state.step, scores)
        _barrier(self.groups, self.device)
        return scores

    # -- the loop ---------------------------------------------------------------------------------------------------
    def train(self) -> RLState:
        cfg = self.cfg
        start = time.perf_counter() - self.state.seconds
        self.push()
        # The step of the last evaluation, the same on every rank (only rank 0 records scores): resumed from the
        # saved state, which every rank loads.
        evaluated_at = self.state.held_out[-1]["step"] if self.state.held_out else None
        if evaluated_at is None and cfg.eval_every:
            self._evaluate_all_ranks()  # step 0: the base (the adapter starts at zero)
            evaluated_at = self.state.step
        quiet = self.rank != 0 or not self.job.progress
        bar = tqdm(total=cfg.steps, initial=self.state.step, desc="grpo", dynamic_ncols=True, disable=quiet)
        metrics = (self.out / "metrics.jsonl").open("a") if self.rank == 0 else None
        signalled = False
        try:
            while self.state.step < cfg.steps:
                over = cfg.max_minutes is not None and time.perf_counter() - start > cfg.max_minutes * 60
                # Summed over ranks so all agree; only rank 0 takes signals (spawned ranks ignore SIGINT / SIGTERM).
                over, signalled = _reduce([float(over), float(STOP.requested is not None)], self.groups, self.device)
                if signalled:
                    log.warning("%s: stopping at step %d, saving", STOP.requested or "a signal", self.state.step)
                    break
                if over:
                    log.warning("time budget of %.1f min reached at step %d", cfg.max_minutes, self.state.step)
                    break
                row = self.train_step()
                self.state.step += 1
                self.state.seconds = time.perf_counter() - start
                row["minutes"] = self.state.seconds / 60
                self.state.history.append(row)
                self.push()
                if cfg.eval_every and (self.state.step % cfg.eval_every == 0 or self.state.step == cfg.steps):
                    row |= {f"held_out/{k}": v for k, v in self._evaluate_all_ranks().items()}
                    evaluated_at = self.state.step
                if metrics is not None:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                bar.set_postfix(
                    reward=f"{row['reward']:.3f}",
                    diff=f"{row['train_rollout_logprob_abs_diff']:.1e}",
                    clip=f"{row['clip_frac']:.3f}",
                    kept=f"{row['kept_groups']:.2f}",
                )
                bar.update(1)
                if self.state.step % cfg.save_every == 0:
                    self.save()
            if cfg.eval_every and evaluated_at != self.state.step and not signalled:  # stopped by the time budget
                self._evaluate_all_ranks()
            self.state.seconds = time.perf_counter() - start
            self.save()
            if self.rank == 0:
                plot_curves(self.state, self.out / "rl_curves.png")
        finally:
            bar.close()
            if metrics is not None:
                metrics.close()
            self.client.close()
        return self.state


def _barrier(groups: Groups, device) -> None:
    _reduce([0.0], groups, device)


def train_rank(groups: Groups, job: RLJob) -> RLState:
    """One rank's whole run (rank 0 also evaluates, saves and pushes)."""
    return GRPOTrainer(job, groups).train()


def _follow(groups: Groups, job: RLJob) -> None:
    train_rank(groups, job)


def run_rl(job: RLJob, nproc: int = 1, dist_timeout: float = 1800.0) -> RLState:
    """Start the config's `engines` engines unless `job.rollout_urls` names some, then train on `nproc` data-parallel
    ranks (one process each, spawned as `kestrel serve --tp` spawns its ranks; gloo on CPU, NCCL on CUDA; a rank that
    dies stops all)."""
    check_config(job.config, nproc)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    with STOP.installed():  # SIGINT / SIGTERM: finish the step, save, stop the engine, return
        if job.rollout_urls:
            return _train(job, nproc, dist_timeout)
        flags = engine_flags(job.config, load_model_config(job.model_path))
        threads = job.config.engine_threads or job.config.threads
        with contextlib.ExitStack() as engines:  # stopped in reverse order, each with SIGINT
            urls = [
                engines.enter_context(EngineProcess(job.model, flags, out / engine_log_name(i), threads)).url
                for i in range(job.config.engines)
            ]
            return _train(replace(job, rollout_urls=urls), nproc, dist_timeout)


def engine_log_name(index: int) -> str:
    """The log file of the index-th engine a run starts: engine.log, engine1.log, ..."""
    return f"engine{index or ''}.log"


def _train(job: RLJob, nproc: int, dist_timeout: float) -> RLState:
    if nproc == 1:
        return train_rank(single_groups(), job)
    layout = ParallelLayout(tp=nproc)  # only the world group is used: every rank holds the whole model
    return run_ranks(
        layout,
        functools.partial(train_rank, job=job),
        functools.partial(_follow, job=job),
        torch.device(job.device),
        dist_timeout,
        followers_finish=True,  # rank 1.. end their loop while rank 0 still saves and plots
    )
