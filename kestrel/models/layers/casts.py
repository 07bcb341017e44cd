"""Dtype casts that cost nothing when the tensor already has the dtype.

`Tensor.to(dtype)` returns the tensor itself when nothing changes, but still passes through the dispatcher (~1 us);
a batch-1 decode step of a small fp32 model made ~90 such no-op calls. Comparing dtypes in Python first is ten times
cheaper, and the result is the same tensor either way.
"""

from __future__ import annotations

import torch


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()
