"""A finished GRPO run in figures (the summary `kestrel rl` prints) and installed as the shipped adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kestrel.train.rl import ADAPTER_DIR, RLJob, RLState

SHIPPED_ADAPTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "kestrel-mini-rl"
SUMMARY_FILE = "training_summary.json"


def summarize(state: RLState) -> dict[str, Any]:
    """The run in figures: held-out accuracy before and after, the mismatch, throughput (medians over steps)."""
    rows = state.history
    diff_key = "train_rollout_logprob_abs_diff_max"

    def median(key: str) -> float | None:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    return {
        "steps": state.step,
        "minutes": round(state.seconds / 60, 1),
        "reward_first_last": [rows[0]["reward"], rows[-1]["reward"]] if rows else None,
        "held_out_before": state.held_out[0] if state.held_out else None,
        "held_out_after": state.held_out[-1] if state.held_out else None,
        diff_key: max((r[diff_key] for r in rows), default=None),
        "rollout_tok_per_s_median": median("rollout_tok_per_s"),
        "train_tok_per_s_median": median("train_tok_per_s"),
    }


def _asset_name(path: Path) -> str:
    """A shipped model by its asset name (the summary must not record this machine's paths), others as given."""
    return path.name if path.resolve().parent == SHIPPED_ADAPTER_DIR.parent else str(path)


def ship_adapter(job: RLJob, state: RLState, recipe: str, target: Path = SHIPPED_ADAPTER_DIR) -> Path:
    """Install the trained adapter (PEFT files + curves) under the package, recording the sha256 of the base's text
    weights (`text_weights_sha256`, as the DFlash draft does): a test fails when the base changes and the adapter was
    not retrained."""
    from kestrel.models.checkpoint import text_weights_sha256

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(Path(job.out) / ADAPTER_DIR, target)
    shutil.copy(Path(job.out) / "rl_curves.png", target / "rl_curves.png")
    base = "kestrel-mini" if job.model is None else _asset_name(Path(job.model))
    summary = {"recipe": recipe, "command": f"kestrel rl --recipe {recipe} --ship", "base_model": base}
    summary["base_sha256"] = text_weights_sha256(job.model_path)
    (target / SUMMARY_FILE).write_text(json.dumps(summary | summarize(state), indent=2) + "\n")
    return target
