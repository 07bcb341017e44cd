"""The curves of a GRPO run as one PNG: reward, held-out accuracy, train/rollout mismatch, KL and clipping, speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_curves(state: Any, path: Path) -> Path:
    """`state`: an RLState (history rows per step, held-out rows per evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = state.history
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    ax = axes[0, 0]
    ax.plot(steps, [r["reward"] for r in rows], "k-", lw=2, label="all")
    for key in sorted(k for k in (rows[0] if rows else {}) if k.startswith("reward/")):
        ax.plot(steps, [r[key] for r in rows], lw=1, alpha=0.7, label=key.split("/", 1)[1])
    ax.set_title("rollout reward (mean of samples)")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    if state.held_out:
        at = [h["step"] for h in state.held_out]
        for key in sorted(k for k in state.held_out[0] if k != "step"):
            ax.plot(at, [h.get(key) for h in state.held_out], "o-", label=key)
        ax.legend(fontsize=7)
    ax.set_title("held-out accuracy (greedy)")
    ax = axes[0, 2]
    ax.plot(steps, [r["train_rollout_logprob_abs_diff"] for r in rows], label="mean |Δ logprob|")
    ax.plot(steps, [r["train_rollout_logprob_abs_diff_max"] for r in rows], label="max |Δ logprob|")
    ax.plot(steps, [r["train_rollout_k3"] for r in rows], label="k3 KL")
    ax.set_title("train vs rollout logprobs (same policy version)")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    ax.plot(steps, [r["ppo_kl"] for r in rows], label="PPO-KL (old ‖ new)")
    if rows and rows[0].get("ref_k3") is not None:
        ax.plot(steps, [r["ref_k3"] for r in rows], label="k3 KL to the base")
    ax.set_title("policy movement")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    ax.plot(steps, [r["clip_frac"] for r in rows], label="clip fraction")
    ax.plot(steps, [r["kept_groups"] for r in rows], label="groups kept (reward variance > 0)")
    ax.set_title("clipping and dynamic filtering")
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    ax.plot(steps, [r["rollout_tok_per_s"] for r in rows], label="rollout (generated tokens/s)")
    ax.plot(steps, [r["train_tok_per_s"] for r in rows], label="training (input tokens/s)")
    ax.set_title("throughput")
    ax.legend(fontsize=7)
    for a in axes.flat:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
