"""Tensors derived from a parameter, kept between inference steps instead of recomputed every step.

A small-model decode step is bound by op launches: `-exp(A_log)` or a per-expert view of the stacked expert weights
is a handful of microseconds, paid per layer per step. The cached value is rebuilt when its parameter's storage or
version changes (a weight reload, an optimizer step), and never used where autograd or the compiler must see the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def derived(owner: nn.Module, key: str, source: torch.Tensor, make: Callable[[torch.Tensor], T]) -> T:
    """make(source), reused while `source` keeps its storage and version (outside autograd and compilation)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return make(source)
    stamp = (source.data_ptr(), source._version)
    cache = owner.__dict__.setdefault("_derived", {})
    hit = cache.get(key)
    if hit is None or hit[0] != stamp:
        hit = cache[key] = (stamp, make(source))
    return hit[1]
