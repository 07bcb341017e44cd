"""The default model when none is named: the embedded `kestrel-mini`, trained by Kestrel and shipped in the repo."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_DIR = Path(__file__).resolve().parent.parent / "assets" / "kestrel-mini"
FALLBACK_DIR = Path.home() / ".cache" / "kestrel" / "builtin-tiny-k3"


def builtin_model_path() -> Path:
    """`kestrel/assets/kestrel-mini`; a tiny random K3.1-shaped checkpoint if a source tree lacks it."""
    if (EMBEDDED_DIR / "config.json").exists():
        return EMBEDDED_DIR
    from kestrel.models.checkpoint import make_model

    if not (FALLBACK_DIR / "config.json").exists():
        make_model("kimi_k3", "tiny", FALLBACK_DIR, seed=0)
    return FALLBACK_DIR
