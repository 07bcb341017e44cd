"""The default model when none is named: the embedded `kestrel-mini`, trained by Kestrel and shipped in the repo."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "assets" / "kestrel-mini"
FALLBACK_DIR = Path.home() / ".cache" / "kestrel" / "builtin-tiny-k3"
EMBEDDED_NAME = "kestrel-mini"
# The tied-head retrain on the wider SFT data: GRPO's base (its draft and vision adapter inside it), beside the default.
TIED_DIR = EMBEDDED_DIR.parent / "kestrel-mini-tied"


def model_dir(name_or_path: str | Path) -> Path:
    """A trainer's `--target` / `--base` / `init_from`: "kestrel-mini" is the embedded model, anything else a folder."""
    return EMBEDDED_DIR if str(name_or_path) == EMBEDDED_NAME else Path(name_or_path)


def builtin_model_path() -> Path:
    """`kestrel/assets/kestrel-mini`; a tiny random K3.1-shaped checkpoint if a source tree lacks it."""
    if (EMBEDDED_DIR / "config.json").exists():
        return EMBEDDED_DIR
    from kestrel.models.checkpoint import make_model

    if not (FALLBACK_DIR / "config.json").exists():
        make_model("kimi_k3", "tiny", FALLBACK_DIR, seed=0)
    return FALLBACK_DIR
