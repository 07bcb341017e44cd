"""The default model when none is named."""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path.home() / ".cache" / "kestrel" / "builtin-tiny-k3"


def builtin_model_path() -> Path:
    """A tiny random K3.1-shaped checkpoint, made once by Kestrel itself (no download)."""
    from kestrel.models.checkpoint import make_model

    if not (BUILTIN_DIR / "config.json").exists():
        make_model("kimi_k3", "tiny", BUILTIN_DIR, seed=0)
    return BUILTIN_DIR
