"""What every benchmark writes beside its figures: the environment they were measured in, as one JSON file."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def write_result(out: Path, benchmark: str, **fields: Any) -> None:
    """`fields` plus torch version, platform and thread count, as indented JSON at `out` (folders made)."""
    result = {
        "benchmark": benchmark,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        **fields,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
