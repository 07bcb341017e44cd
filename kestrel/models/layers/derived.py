"""Tensors derived from a parameter, kept between inference steps instead of recomputed every step.

A small-model decode step is bound by op launches: `-exp(A_log)` or a per-expert view of the stacked expert weights
is a handful of microseconds, paid per layer per step. The cached value is rebuilt when its parameter's storage or
version changes (an optimizer step, a replaced parameter) or a checkpoint is loaded into the model (`weights_changed`),
and never used where autograd or the compiler must see the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")
_generation = 0  # bumped by every checkpoint load: loaders write through `param.data`, which has its own version


def weights_changed() -> None:
    """Invalidate every derived tensor (called by `load_weights`, which writes parameters in place via `.data`)."""
    global _generation
    _generation += 1


def derived(owner: nn.Module, key: str, source: torch.Tensor, make: Callable[[torch.Tensor], T]) -> T:
    """make(source), reused while `source` keeps its storage and version and no checkpoint was loaded since
    (outside autograd and compilation)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return make(source)
    stamp = (_generation, source.data_ptr(), source._version)
    cache = owner.__dict__.setdefault("_derived", {})
    hit = cache.get(key)
    if hit is None or hit[0] != stamp:
        hit = cache[key] = (stamp, make(source))
    return hit[1]
