"""GRPO (`kestrel rl`): its arithmetic against hand-computed values and the real loop on a tiny kimi_k3 — a `kestrel
serve` subprocess, rollouts over HTTP with routing capture, replay in the trainer, the adapter upserted after every
step: logprobs bit-identical at every step, rollouts on the version just pushed, a resumed run equal to an
uninterrupted one, two data-parallel ranks equal to one, a dead rank stops the job. What it trains on (rewards,
prompts, recipes): test_rl_tasks.py."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import threading
import time

import httpx
import pytest
import torch
import torch.distributed as dist
from dist_harness import spawn_ranks

from kestrel.cli import main
from kestrel.config import ConfigError, load_model_config
from kestrel.dist.groups import ParallelLayout, single_groups
from kestrel.dist.launch import RankFailure, free_port
from kestrel.keepalive import SERVER_KEEPALIVE_S
from kestrel.models.builtin import TIED_DIR
from kestrel.models.checkpoint import make_model, text_weights_sha256
from kestrel.models.loader import load_model
from kestrel.models.lora import load_peft
from kestrel.server.serving import json_float
from kestrel.train.grpo import ClipConfig, group_advantages, informative_groups, k3, policy_loss
from kestrel.train.recipes import RL_RECIPES
from kestrel.train.rl import GRPOTrainer, RLJob, check_config, kl_anchor_groups, run_rl, train_rank
from kestrel.train.rl_ship import SUMMARY_FILE, ship_adapter
from kestrel.train.rl_tasks import (
    PARITY_TASKS,
    Task,
    TaskMix,
    mostly_even,
    parity_prompt,
)
from kestrel.train.rollout_client import (
    RETRIES,
    EngineProcess,
    RolloutClient,
    RolloutError,
    adapter_checksum,
    check_finite,
)
from kestrel.train.routing_replay import sequence_logprobs

TINY = RL_RECIPES["tiny"]


# -- the arithmetic -------------------------------------------------------------------------------------------------
def test_group_advantages_and_the_zero_variance_filter_match_hand_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    s = 1 / math.sqrt(3)  # group 0: mean 1/2, unbiased std sqrt(1/3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s, atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # all equal: no signal
    assert torch.allclose(adv[2], torch.tensor([-0.5, -0.5, -0.5, 1.5]), atol=1e-5)  # mean 1/4, std 1/2
    assert informative_groups(rewards).tolist() == [True, False, True]


def test_policy_loss_clips_low_and_high_separately_and_truncates_importance_weights():
    cfg = ClipConfig(clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    ratio = torch.tensor([1.5, 0.5, 1.1, 0.5])  # π_θ / π_old
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    rollout = old - torch.log(torch.tensor([3.0, 1.0, 0.5, 1.0]))  # π_old / π_rollout = 3 (capped to 2), 1, 0.5, 1
    logp = (old + ratio.log()).requires_grad_()
    terms = policy_loss(logp, old, rollout, adv, cfg)
    # Token by token: 1.5 > 1 + 0.28 with A > 0 -> clipped at 1.28; 0.5 < 1 - 0.2 with A < 0 -> clipped at 0.8;
    # 1.1 inside; 0.5 with A > 0 is not clipped (PPO only stops moves that help). Weights 2, 1, 0.5, 1.
    assert terms.loss.item() == pytest.approx(2 * -1.28 + 1 * 0.8 + 0.5 * -2.2 + 1 * -0.5, abs=1e-5)
    assert (terms.tokens, terms.clipped, terms.tis_truncated) == (4, 2, 1)
    assert terms.tis == pytest.approx(4.5, abs=1e-5)
    assert terms.ppo_kl == pytest.approx(-ratio.log().sum().item(), abs=1e-5)
    terms.loss.backward()
    # Clipped tokens pass no gradient; the others: -tis · A · ratio.
    assert torch.allclose(logp.grad, torch.tensor([0.0, 0.0, -0.5 * 2.0 * 1.1, -1.0 * 1.0 * 0.5]), atol=1e-5)


def test_policy_loss_equals_a_token_by_token_ppo_reference():
    """PPO's own form, -min(r·A, clip(r)·A), one token at a time in float64, against the vectorised loss."""
    gen = torch.Generator().manual_seed(3)
    n, cfg = 300, ClipConfig(clip_low=0.1, clip_high=0.3, tis_cap=1.5, kl_coef=0.2)
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    logp, rollout, ref = (old + torch.randn(n, generator=gen, dtype=torch.float64) * 0.3 for _ in range(3))
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    total, clipped = 0.0, 0
    for i in range(n):
        r, a = math.exp(logp[i] - old[i]), adv[i].item()
        capped = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
        clipped += capped * a < r * a
        weight = min(math.exp(old[i] - rollout[i]), cfg.tis_cap)
        d = ref[i].item() - logp[i].item()
        total += weight * -min(r * a, capped * a) + cfg.kl_coef * (math.exp(d) - d - 1)
    terms = policy_loss(logp, old, rollout, adv, cfg, ref)
    assert terms.loss.item() == pytest.approx(total, rel=1e-12) and terms.clipped == clipped > 0


def test_kl_to_the_reference_is_k3_and_joins_the_loss_with_its_coefficient():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([math.log(2.0), -1.0])
    assert torch.allclose(k3(logp, ref), torch.tensor([1 - math.log(2.0), 0.0]), atol=1e-6)
    zero = torch.zeros(2)
    with_kl = policy_loss(logp, logp, logp, zero, ClipConfig(kl_coef=0.5), ref)
    assert with_kl.loss.item() == pytest.approx(0.5 * (1 - math.log(2.0)), abs=1e-6)
    assert with_kl.ref_k3 == pytest.approx(1 - math.log(2.0), abs=1e-6)


# -- the loop on a tiny model, against a real engine subprocess -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_model("kimi_k3", "tiny", tmp_path_factory.mktemp("rl") / "k3", seed=0))


@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    from kestrel.train.rl import engine_flags

    flags = engine_flags(TINY.config, load_model_config(tiny))
    with EngineProcess(tiny, flags, tmp_path_factory.mktemp("engine") / "engine.log") as proc:
        yield proc.url
    assert proc.returncode == 0 and "Traceback" not in proc.log_path.read_text()  # SIGINT: a clean stop


def _job(tiny, engine, out, name, steps=3, tasks=PARITY_TASKS) -> RLJob:
    config = dataclasses.replace(TINY.config, steps=steps, adapter_name=name)
    return RLJob(config, tasks, str(out), tiny, [engine], progress=False)


def _adapter(out) -> dict[str, torch.Tensor]:
    weights = load_peft(out / "adapter").weights
    return {f"{m}.{i}": t for m, ab in weights.items() for i, t in enumerate(ab)}


@pytest.fixture(scope="module")
def three_steps(tiny, engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("three")
    job = _job(tiny, engine, out, "straight")
    return job, train_rank(single_groups(), job), out


def test_every_step_has_bit_identical_logprobs_and_rollouts_on_the_adapter_just_pushed(three_steps, engine):
    job, state, out = three_steps
    assert [r["step"] for r in state.history] == [1, 2, 3]
    for i, row in enumerate(state.history):
        assert row["trained_tokens"] > 0 and 0 < row["kept_groups"] <= 1
        assert row["train_rollout_logprob_abs_diff"] == 0.0 and row["train_rollout_logprob_abs_diff_max"] == 0.0
        assert row["train_rollout_k3"] == 0.0 and row["tis_mean"] == 1.0
        assert row["adapter_version"] == str(i)  # what every rollout's meta_info said (checked in the step)
        assert row["rollout_tok_per_s"] > 0 and row["train_tok_per_s"] > 0
    assert any(row["ppo_kl"] != 0.0 for row in state.history)  # the second minibatch ran one step later
    assert any(row["clip_frac"] > 0 for row in state.history)  # lr 2e-2: some ratios leave [0.8, 1.28]
    assert all(row["ref_k3"] >= 0 for row in state.history) and state.history[-1]["ref_k3"] > 0  # moved off base
    assert [h["step"] for h in state.held_out] == [0, 2, 3]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3] and "held_out/parity/parity" in logged[1]
    assert logged[2]["held_out/parity/parity"] == state.held_out[-1]["parity/parity"]
    # The engine serves the last version pushed, the bytes of the saved adapter.
    served = httpx.get(engine + "/get_server_info").json()["lora_adapters"]["straight"]
    assert (served["lora_version"], served["checksum"]) == ("3", adapter_checksum(out / "adapter"))
    b = [t for k, t in _adapter(out).items() if k.endswith(".1")]
    assert max(t.abs().max().item() for t in b) > 0  # B started at zero: the adapter moved
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3 and (out / "rl_curves.png").stat().st_size
    shipped = ship_adapter(job, state, "tiny", out / "shipped")
    summary = json.loads((shipped / SUMMARY_FILE).read_text())
    assert summary["base_sha256"] == text_weights_sha256(job.model_path) and summary["steps"] == 3
    assert summary["base_model"] == str(job.model)  # a folder outside the package: recorded as given
    assert load_peft(shipped).checksum == adapter_checksum(out / "adapter")


def test_a_rollout_on_another_adapter_version_stops_the_step(tiny, engine, tmp_path, three_steps):
    trainer = GRPOTrainer(_job(tiny, engine, tmp_path, "swapped"), single_groups())
    trainer.push()
    other = three_steps[2] / "adapter"  # someone else's adapter upserted under the trainer's name
    trainer.client.push_adapter("swapped", other, "foreign", adapter_checksum(other))
    with pytest.raises(RolloutError, match="foreign"):
        trainer.train_step()
    trainer.client.close()


def test_a_non_finite_logprob_is_sent_as_null_and_stops_the_step():
    """A diverged policy's NaN / inf logprobs: the engine's JSON carries null (not an encoding error, HTTP 500) and
    the trainer stops naming the token, instead of training on NaN."""
    assert json_float(float("nan")) is None and json_float(float("-inf")) is None and json_float(-1.5) == -1.5
    ok = {"meta_info": {"id": "a", "output_token_logprobs": [[-0.5, 3, None]]}}
    check_finite([[ok]])
    bad = {"meta_info": {"id": "b", "output_token_logprobs": [[-0.5, 3, None], [None, 4, None]]}}
    with pytest.raises(RolloutError, match="rollout b: token 1 has a non-finite logprob"):
        check_finite([[ok, bad]])


class DroppingEngine:
    """A socket server on loopback that resets its first `drops` connections under the request (as an engine's
    keep-alive timer can) and answers the rest with one `/generate` result."""

    ANSWER = json.dumps({"text": "ok", "meta_info": {"id": "r0"}}).encode()

    def __init__(self, drops: int) -> None:
        self.drops, self.accepted = drops, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def __enter__(self) -> DroppingEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()  # ends the accept loop

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed by the test
                return
            with conn:
                conn.recv(65536)
                self.accepted += 1
                if self.accepted <= self.drops:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
                    continue
                head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(self.ANSWER)}"
                conn.sendall(head.encode() + b"\r\nconnection: close\r\n\r\n" + self.ANSWER)


def test_a_dropped_connection_is_sent_again_and_an_engine_that_never_answers_is_named():
    """The keep-alive race (a request sent on a connection as the engine closes it: "connection reset by peer")
    stopped a recipe run at step 10; now it costs one more request. An engine that resets every try still fails the
    step, naming its URL; the client also drops idle connections before `kestrel serve` does."""
    with DroppingEngine(drops=RETRIES) as flaky, contextlib.closing(RolloutClient([flaky.url])) as client:
        assert client.generate([[1, 2, 3]], n=1, max_new_tokens=4) == [[json.loads(DroppingEngine.ANSWER)]]
        assert flaky.accepted == RETRIES + 1
        assert client.http._transport._pool._keepalive_expiry < SERVER_KEEPALIVE_S
    with DroppingEngine(drops=RETRIES + 1) as dead, contextlib.closing(RolloutClient([dead.url])) as client:
        with pytest.raises(RolloutError, match=re.escape(f"{dead.url}/generate: no answer")):
            client.generate([[1, 2, 3]], n=1, max_new_tokens=4)
        assert dead.accepted == RETRIES + 1


def test_the_reference_pass_is_the_base_and_the_policy_pass_is_the_engine(tiny, engine, tmp_path, three_steps):
    shutil.copytree(three_steps[2], tmp_path, dirs_exist_ok=True)  # resumes with the trained adapter
    trainer = GRPOTrainer(_job(tiny, engine, tmp_path, "probe", steps=4), single_groups())
    assert trainer.state.step == 3
    trainer.push()
    batch = [(r, 0.0) for group in trainer.rollouts(trainer.prompts(3), [0, 1], 3) for r, _ in group]
    base, _ = load_model(tiny, torch.float32)
    base.batch_invariant = True
    base.train()
    t = TINY.config.temperature
    assert t != 1.0  # the loss trains the tempered policy the engine sampled from
    with torch.no_grad():
        base_raw, base_tempered = torch.cat(sequence_logprobs(base, [r for r, _ in batch], temperatures=(1.0, t)), -1)
        ref, (raw, policy) = trainer._reference(batch), trainer._raw_and_policy(batch)
    trainer.client.close()
    assert torch.equal(ref, base_tempered) and not torch.equal(ref, base_raw)  # the adapter off: exactly the base
    engine_lp = torch.tensor([lp for r, _ in batch for lp in r.logprobs], dtype=policy.dtype)
    assert torch.equal(raw, engine_lp) and not torch.equal(raw, base_raw)  # the adapter is on, as on the engine
    assert torch.equal(policy, torch.cat(sequence_logprobs(trainer.model, [r for r, _ in batch], temperatures=(t,))))


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny, engine, tmp_path, three_steps):
    _, straight, straight_out = three_steps
    first = train_rank(single_groups(), _job(tiny, engine, tmp_path, "resumed", steps=2))
    assert [r["step"] for r in first.history] == [1, 2]
    state = train_rank(single_groups(), _job(tiny, engine, tmp_path, "resumed", steps=3))
    assert [r["step"] for r in state.history] == [1, 2, 3] and state.step == 3  # the count went on from 2
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
    assert [r["reward"] for r in state.history] == [r["reward"] for r in straight.history]
    mine, ref = _adapter(tmp_path), _adapter(straight_out)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)


def test_two_data_parallel_ranks_train_the_adapter_one_rank_does(tiny, engine, tmp_path, three_steps):
    _, straight, straight_out = three_steps
    (state, _) = spawn_ranks(train_rank, ParallelLayout(tp=2), _job(tiny, engine, tmp_path, "dp2"))
    assert [r["reward"] for r in state.history] == [r["reward"] for r in straight.history]
    assert all(row["train_rollout_logprob_abs_diff_max"] == 0.0 for row in state.history)
    # The all-reduced gradients are one rank's summed in another order: fp32 rounding (a missing all-reduce or a
    # rank-local token mean would change their norm by ~2x).
    for two, one in zip(state.history, straight.history):
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    # AdamW's m / sqrt(v) magnifies that rounding where a gradient is near zero: after 6 updates at lr 2e-2 the
    # adapters agree to 5e-5 (of weights up to 0.25); a wrong gradient moves them by ~lr per update.
    mine, ref = _adapter(tmp_path), _adapter(straight_out)
    worst = max((mine[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= TINY.config.lr / 40, worst


def test_kl_anchors_are_zero_variance_groups_drawn_the_same_on_any_rank_split():
    cfg = dataclasses.replace(TINY.config, prompts_per_step=64, kl_anchor_share=0.5)
    keep = torch.arange(64) % 3 == 0
    one = kl_anchor_groups(cfg, 5, list(range(64)), keep)
    assert not (one & keep).any() and 0.3 < one[~keep].float().mean() < 0.7
    split = [kl_anchor_groups(cfg, 5, list(range(r, 64, 2)), keep[r::2]) for r in (0, 1)]  # two ranks' groups
    assert torch.equal(torch.stack(split, 1).reshape(-1), one)
    assert not torch.equal(kl_anchor_groups(cfg, 6, list(range(64)), keep), one)  # a fresh draw each step
    assert not kl_anchor_groups(dataclasses.replace(cfg, kl_anchor_share=0.0), 5, list(range(64)), keep).any()
    assert torch.equal(kl_anchor_groups(dataclasses.replace(cfg, kl_anchor_share=1.0), 5, list(range(64)), keep), ~keep)


def always_right(ep, text, ids) -> float:
    return 1.0


def test_kl_anchors_train_every_filtered_group_on_the_kl_term_alone(tiny, engine, tmp_path):
    """kl_anchor_share 1: every group is trained (the informative ones on the loss, the rest on the KL alone; a
    minibatch needs an informative group to step); the rollouts are the filtered run's, and the anchors' KL moves
    the adapter."""
    mix = TaskMix((PARITY_TASKS.tasks[0], Task("sure", 1.0, parity_prompt, always_right)), PARITY_TASKS.held_out)
    runs = {}
    for share in (0.0, 1.0):
        job = _job(tiny, engine, tmp_path / str(share), f"anchored{share}", steps=2, tasks=mix)
        job = dataclasses.replace(job, config=dataclasses.replace(job.config, kl_anchor_share=share, minibatches=1))
        runs[share] = train_rank(single_groups(), job).history
    (filtered, anchored) = runs.values()
    assert anchored[0]["reward"] == filtered[0]["reward"]  # the same rollouts at the first step
    for row, plain in zip(anchored, filtered, strict=True):
        assert row["kept_groups"] + row["kl_anchor_groups"] == 1.0 and plain["kl_anchor_groups"] == 0.0
        assert row["trained_tokens"] == row["rollout_tokens"] and row["train_rollout_logprob_abs_diff_max"] == 0.0
    assert anchored[0]["kl_anchor_groups"] > 0 and anchored[0]["trained_tokens"] > filtered[0]["trained_tokens"]
    mine, ref = _adapter(tmp_path / "1.0"), _adapter(tmp_path / "0.0")
    assert max((mine[k] - ref[k]).abs().max().item() for k in ref) > 0


def second_half(text: str) -> int | None:
    """A stand-in locator: every completion's "first false step" is halfway through its text."""
    return len(text) // 2 if len(text) > 1 else None


def test_step_credit_trains_a_wrong_rollout_only_from_its_located_step(tiny, engine, tmp_path):
    """The same rollouts with and without step credit: the wrong ones located, their tokens before the step left
    out of the policy gradient (still counted in the token mean), so the adapters differ."""
    t = PARITY_TASKS.tasks[0]
    mix = TaskMix((Task(t.name, t.weight, t.make, t.reward, second_half),), PARITY_TASKS.held_out)
    runs = {}
    for on in (False, True):
        job = _job(tiny, engine, tmp_path / str(on), f"credit{on}", steps=1, tasks=mix)
        runs[on] = train_rank(
            single_groups(), dataclasses.replace(job, config=dataclasses.replace(job.config, step_credit=on))
        )
    plain, credited = runs[False].history[0], runs[True].history[0]
    assert credited["reward"] == plain["reward"] and credited["trained_tokens"] == plain["trained_tokens"]
    assert plain["step_credit_located"] is None and credited["step_credit_located"] > 0
    assert credited["step_credit_unblamed_tokens"] > 0
    mine, ref = _adapter(tmp_path / "True"), _adapter(tmp_path / "False")
    assert max((mine[k] - ref[k]).abs().max().item() for k in ref) > 0


def test_two_engines_the_run_starts_sample_what_one_engine_does(tiny, engine, tmp_path, three_steps):
    """`engines=2`: the run starts two engines, deals the prompts to both and pushes each adapter to both; with
    batch-invariant engines the rollouts, rewards and gradients are one engine's to the last bit."""
    _, straight, _ = three_steps
    job = _job(tiny, engine, tmp_path, "two", steps=2)
    job = dataclasses.replace(job, rollout_urls=[], config=dataclasses.replace(job.config, engines=2))
    state = run_rl(job)
    same = ("reward", "grad_norm", "rollout_tokens")
    for two, one in zip(state.history, straight.history[:2], strict=True):
        assert [two[k] for k in same] == [one[k] for k in same] and two["train_rollout_logprob_abs_diff_max"] == 0.0
    for name in ("engine.log", "engine1.log"):
        log = (tmp_path / name).read_text()
        assert log.count('"POST /generate') > 0 and log.count('"POST /load_lora_adapter') == 3, name  # versions 0-2
        assert "Finished server process" in log and "Traceback" not in log, name  # each stopped cleanly


def dies_on_rank_one(ep, text, ids) -> float:
    """A reward that kills data-parallel rank 1 (a rank crashing mid-step)."""
    if dist.is_initialized() and dist.get_rank() == 1:
        os._exit(3)
    return mostly_even(ep, text, ids)


def test_a_rank_that_dies_stops_the_job(tiny, engine, tmp_path):
    tasks = TaskMix((Task("parity", 1.0, parity_prompt, dies_on_rank_one),))
    start = time.monotonic()
    with pytest.raises((RankFailure, RuntimeError)):
        run_rl(_job(tiny, engine, tmp_path, "dying", tasks=tasks), nproc=2, dist_timeout=30)
    assert time.monotonic() - start < 60


def test_cli_rl_starts_its_own_engine_trains_on_two_ranks_and_stops_it(tiny, tmp_path, capsys):
    out = tmp_path / "cli"
    # --nproc 2: the launcher's ranks; rank 1's loop ends while rank 0 still saves, which is a finish, not a death.
    assert main(["rl", "--recipe", "tiny", "--model", tiny, "--steps", "1", "--nproc", "2", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.split("\nadapter: ")[0])
    assert summary["steps"] == 1 and summary["train_rollout_logprob_abs_diff_max"] == 0.0
    log = (out / "engine.log").read_text()
    assert "Finished server process" in log and "Traceback" not in log  # stopped cleanly (SIGINT)
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "trainer_state.pt").exists()


def test_cli_rl_trains_against_the_engines_it_is_given(tiny, engine, tmp_path, capsys):
    out = tmp_path / "given"
    argv = ["rl", "--recipe", "tiny", "--model", tiny, "--rollout-url", engine, "--out", str(out), "--steps", "1"]
    # The trainer on 2 threads, the engine on 1: batch-invariant logprobs do not depend on the thread count either.
    argv += ["--threads", "2", "--minibatches", "1"]
    assert main([*argv, "--eval-every", "0", "--kl-coef", "0", "--samples-per-prompt", "3"]) == 0
    saved = json.loads((out / "rl_config.json").read_text())
    assert (saved["steps"], saved["eval_every"], saved["samples_per_prompt"], saved["clip"]["kl_coef"]) == (1, 0, 3, 0)
    assert (saved["threads"], saved["minibatches"]) == (2, 1)
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["ref_k3"] is None and row["train_rollout_logprob_abs_diff"] == 0.0
    assert row["train_rollout_logprob_abs_diff_max"] == 0.0 and row["trained_tokens"] > 0
    assert not (out / "engine.log").exists()  # no engine of its own


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"samples_per_prompt": 1}, "samples_per_prompt"),
        ({"minibatches": 5}, "minibatches"),
        ({"lr": 0.0}, "lr"),
        ({"clip": ClipConfig(clip_low=1.0)}, "clip.clip_low"),
        ({"clip": ClipConfig(tis_cap=0.5)}, "clip.tis_cap"),
        ({"clip": ClipConfig(kl_coef=-1.0)}, "clip.kl_coef"),
        ({"kl_anchor_share": 1.5}, "kl_anchor_share"),
        ({"kl_anchor_share": 0.5, "clip": ClipConfig(kl_coef=0.0)}, "kl_anchor_share"),
        ({"lora_targets": ()}, "lora_targets"),
        ({"engine_threads": 0}, "engine_threads"),
        ({"engines": 0}, "engines"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(change, name):
    with pytest.raises(ConfigError, match=f"'{re.escape(name)}'"):
        check_config(dataclasses.replace(TINY.config, **change))


def test_cli_rl_refuses_bad_options_before_starting_an_engine(tiny, tmp_path, capsys):
    out = tmp_path / "bad"
    base = ["rl", "--recipe", "tiny", "--model", tiny, "--out", str(out)]
    for argv, named in [
        (["--samples-per-prompt", "1"], "'samples_per_prompt'"),
        (["--clip-low", "1.5"], "'clip.clip_low'"),
        (["--nproc", "0"], "nproc"),
        (["--nproc", "5"], "nproc"),
        (["--rollout-url", "localhost:30000"], "--rollout-url"),
        (["--device", "cuda:7"], "device"),
    ]:
        assert main(base + argv) == 2, argv
        assert named in capsys.readouterr().err, argv
    assert not (out / "engine.log").exists()
    # An engine that does not answer: the URL named, exit 1, no traceback.
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert main([*base, "--rollout-url", nowhere, "--steps", "1"]) == 1
    assert nowhere in capsys.readouterr().err


def test_rollouts_behind_sglang_router_use_the_adapter_pushed_to_every_worker(tiny, engine, tmp_path):
    """`--rollout-url ROUTER --sync-url W0 W1`: sglang-router spreads the rollouts over two workers, each serves the
    version just pushed (checked per rollout in the step), and the mismatch stays exactly 0."""
    pytest.importorskip("sglang_router", reason="sglang-router not installed: pip install -e '.[router]'")
    from process_harness import free_port as router_port
    from process_harness import router_cmd, start, stop

    from kestrel.train.rl import engine_flags

    def finished(url: str) -> float:
        lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("kestrel_requests_finished_total"))

    flags = engine_flags(TINY.config, load_model_config(tiny))
    with EngineProcess(tiny, flags, tmp_path / "w1.log") as second:
        workers = [engine, second.url]
        port = router_port()
        cmd = router_cmd(port, "--worker-urls", *workers, "--policy", "round_robin")
        router = start(
            [*cmd, "--prometheus-port", str(router_port())], tmp_path / "router.log", f"http://127.0.0.1:{port}/health"
        )
        try:
            before = [finished(u) for u in workers]
            job = dataclasses.replace(
                _job(tiny, engine, tmp_path / "out", "routed", steps=2),
                rollout_urls=[f"http://127.0.0.1:{port}"],
                sync_urls=workers,
            )
            state = train_rank(single_groups(), job)
            served = [finished(u) - b for u, b in zip(workers, before, strict=True)]
            infos = [httpx.get(u + "/get_server_info").json()["lora_adapters"]["routed"] for u in workers]
        finally:
            stop(router, signal.SIGTERM)
    assert second.returncode == 0 and "Traceback" not in (tmp_path / "w1.log").read_text()
    assert [r["adapter_version"] for r in state.history] == ["0", "1"]
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in state.history)
    assert min(served) > 0, served  # both workers answered rollouts
    checksum = adapter_checksum(tmp_path / "out" / "adapter")
    assert all((i["lora_version"], i["checksum"]) == ("2", checksum) for i in infos)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_kestrel_rl_after_its_step_saved_with_its_engine_stopped(tiny, tmp_path, sig):
    """SIGINT or SIGTERM: the step in flight finishes, the state is saved (resumable: as many steps as metric rows),
    the engine the run started is stopped cleanly, and the process exits 0 without a traceback."""
    import subprocess
    import sys

    out = tmp_path / "signalled"
    cmd = [sys.executable, "-m", "kestrel.cli", "rl", "--recipe", "tiny", "--model", tiny, "--out", str(out)]
    cmd += ["--steps", "1000", "--eval-every", "0"]
    err = tmp_path / "stderr.log"  # a file: a full pipe would block the trainer
    with open(err, "w") as stderr_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr_file, text=True)
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=90)
    stderr = err.read_text()
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    steps = metrics.read_text().count("\n")
    assert json.loads(stdout.split("\nadapter: ")[0])["steps"] == steps
    assert torch.load(out / "trainer_state.pt", weights_only=False)["state"]["step"] == steps
    log = (out / "engine.log").read_text()
    assert "Finished server process" in log and "Traceback" not in log  # stopped by the trainer, not orphaned
    url = re.search(r"Uvicorn running on (http://\S+)", log).group(1)
    with pytest.raises(httpx.TransportError):  # nothing answers where the engine served
        httpx.get(url + "/health", timeout=5)


def test_the_shipped_adapter_was_trained_on_todays_base_and_serves_by_name():
    """kestrel/assets/kestrel-mini-rl (`kestrel rl --recipe mini --ship`): PEFT files, the curves, and the sha256 of
    the base it was trained on; a changed base fails here until the adapter is retrained. Served by name, it keeps
    the held-out gain its summary claims on the first set_timer requests (the category it lifted most)."""
    from kestrel import LLM, SamplingParams
    from kestrel.train import evaluate
    from kestrel.train.rl_ship import SHIPPED_ADAPTER_DIR

    summary = json.loads((SHIPPED_ADAPTER_DIR / SUMMARY_FILE).read_text())
    for name in ("adapter_config.json", "adapter_model.safetensors", "rl_curves.png"):
        assert (SHIPPED_ADAPTER_DIR / name).is_file(), name
    assert summary["base_model"] == TIED_DIR.name and summary["recipe"] == "mini"
    assert summary["base_sha256"] == text_weights_sha256(TIED_DIR), (
        "kestrel-mini-tied changed: retrain the adapter (`kestrel rl --recipe mini --ship`)"
    )
    assert summary["steps"] == RL_RECIPES["mini"].config.steps and summary["minutes"] <= 40
    assert summary["train_rollout_logprob_abs_diff_max"] == 0.0

    cases = [ep for key, ep in evaluate.tool_cases(40) if key == "set_timer"]
    prompts = [evaluate.prompt_text(ep) for ep in cases]
    llm = LLM(str(TIED_DIR), max_running_requests=64, lora_paths=[f"rl={SHIPPED_ADAPTER_DIR}"])
    right = {}
    for lora in (None, "rl"):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128), use_tqdm=False, lora_name=lora)
        right[lora] = sum(evaluate.tool_call_correct(ep, o.outputs[0].text) for ep, o in zip(cases, outs))
    assert right["rl"] > right[None], right
