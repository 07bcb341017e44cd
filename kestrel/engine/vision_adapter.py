"""The vision adapter a checkpoint may ship beside its tower: image requests run on it, text requests never do.

A tiny frozen decoder barely reads image features by itself; a LoRA adapter on its attention and dense projections,
trained together with the projector, teaches it to (Phi-4-multimodal ships its vision LoRA beside the base the same
way). The checkpoint keeps it in `vision-lora/` (PEFT format) with `base_weights.json`, the sha256 of the text and
the vision tensors it was trained against. The engine serves it under the name `vision`: a request with images that
names no adapter runs on it, so the text model's answers to text stay byte-for-byte the base's. An adapter whose
recorded base differs from the checkpoint's weights is not loaded (a warning says why): it would read features it
never saw.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kestrel.models.checkpoint import text_weights_sha256, vision_weights_sha256

log = logging.getLogger(__name__)
VISION_ADAPTER = "vision"  # the name image requests' default adapter is served under
ADAPTER_DIR = "vision-lora"  # beside the checkpoint's safetensors
BASE_FILE = "base_weights.json"


def base_weights(checkpoint: str | Path) -> dict[str, str]:
    """What a vision adapter records of the checkpoint it was trained against."""
    return {
        "text_weights_sha256": text_weights_sha256(checkpoint),
        "vision_weights_sha256": vision_weights_sha256(checkpoint),
    }


def record_base(adapter_dir: str | Path, checkpoint: str | Path) -> None:
    """Write `base_weights.json` into the adapter's folder."""
    (Path(adapter_dir) / BASE_FILE).write_text(json.dumps(base_weights(checkpoint), indent=2) + "\n")


def adapter_mismatch(checkpoint: str | Path) -> str | None:
    """Why the checkpoint's vision adapter does not belong to its weights (None: it does)."""
    record_file = Path(checkpoint) / ADAPTER_DIR / BASE_FILE
    if not record_file.is_file():
        return f"{record_file} is missing"
    try:
        recorded = json.loads(record_file.read_text())
    except ValueError as exc:
        return f"{record_file} is not JSON ({exc})"
    actual = base_weights(checkpoint)
    for key, value in actual.items():
        if recorded.get(key) != value:
            return f"{key}: trained on {str(recorded.get(key))[:12]}…, the checkpoint has {value[:12]}…"
    return None


def vision_adapter_dir(checkpoint: str | Path, has_vision: bool) -> Path | None:
    """The checkpoint's vision adapter folder if it has one that was trained on these weights, else None."""
    folder = Path(checkpoint) / ADAPTER_DIR
    if not has_vision or not folder.is_dir():
        return None
    why = adapter_mismatch(checkpoint)
    if why is not None:
        log.warning("not loading the vision adapter %s: %s (retrain it on this checkpoint)", folder, why)
        return None
    return folder
