"""fp32 scalar operands as cached 0-dim CPU tensors.

An op with a Python-float operand wraps it into a double tensor and copies that to the op's dtype (an `_to_copy`,
~1-2 us on CPU) every call; a small decode step made ~80 such copies. A 0-dim fp32 CPU tensor is a scalar operand on
any device (no transfer) and, for fp32 tensors, gives bit-identical results: the float was rounded to fp32 either way.
Use only where the other operand is fp32 (for bf16 the double would be rounded straight to bf16, not via fp32).
"""

from __future__ import annotations

import torch

_CACHE: dict[float, torch.Tensor] = {}


def fp32_scalar(value: float) -> torch.Tensor | float:
    """`value` as a shared 0-dim fp32 tensor; the float itself under torch.compile (a graph constant)."""
    if torch.compiler.is_compiling():
        return value
    out = _CACHE.get(value)
    if out is None:
        with torch.inference_mode(False):  # a normal tensor: autograd may save it later (an inference one it refuses)
            out = _CACHE[value] = torch.tensor(value, dtype=torch.float32)
    return out
