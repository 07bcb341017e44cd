"""Per-parameter loader functions: how one checkpoint tensor lands in a (possibly fused) parameter.

A layer tags a parameter with `set_loader(param, fn, shards)`; the checkpoint loader only maps names to
(parameter, shard) and calls the function. `shards` lists every shard the parameter needs to be complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

WeightLoader = Callable[[torch.Tensor, torch.Tensor, Any], None]
FULL = "full"
# A sharded parameter's `checkpoint_slice(shard, disk_shape)` returns this for a tensor its rank does not hold.
SKIP = "skip"


class ShapeMismatch(ValueError):
    pass


def _check(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ShapeMismatch(f"expected {tuple(dst.shape)}, got {tuple(src.shape)}")


def default_loader(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
    _check(param, tensor)
    param.data.copy_(tensor)


def reshape_loader(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
    """Same numbers, different shape on disk (A_log is [1,1,H,1] in Kimi checkpoints, [H] elsewhere)."""
    if param.numel() != tensor.numel():
        raise ShapeMismatch(f"expected {param.numel()} elements {tuple(param.shape)}, got {tuple(tensor.shape)}")
    param.data.copy_(tensor.reshape(param.shape))


def stacked_loader(index: dict[Any, int], parts: int) -> WeightLoader:
    """Fused along dim 0 from `parts` equal pieces (q/k/v convs); shard FULL takes the fused tensor."""

    def load(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
        if shard == FULL:
            return default_loader(param, tensor, shard)
        size = param.shape[0] // parts
        dst = param.data[index[shard] * size : (index[shard] + 1) * size]
        _check(dst, tensor)
        dst.copy_(tensor)

    return load


def sized_parts_loader(parts: dict[str, int]) -> WeightLoader:
    """Fused along dim 0 from named pieces of given sizes, in order (`FusedLinear`)."""
    offsets, start = {}, 0
    for name, size in parts.items():
        offsets[name] = (start, start + size)
        start += size

    def load(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
        if shard == FULL:
            return default_loader(param, tensor, shard)
        lo, hi = offsets[shard]
        dst = param.data[lo:hi]
        _check(dst, tensor)
        dst.copy_(tensor)

    return load


def expert_loader(halves: bool) -> WeightLoader:
    """Stacked experts [E, ...]: shard (e, None) for one expert, (e, 0|1) for the gate|up half of it."""

    def load(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
        if shard == FULL:
            return default_loader(param, tensor, shard)
        expert, half = shard
        dst = param.data[expert]
        if halves:
            size = dst.shape[0] // 2
            dst = dst[half * size : (half + 1) * size]
        _check(dst, tensor)
        dst.copy_(tensor)

    return load


def set_loader(param: torch.Tensor, fn: WeightLoader, shards: Iterable[Any] | None = None) -> None:
    param.weight_loader = fn  # type: ignore[attr-defined]
    param.weight_shards = frozenset(shards) if shards is not None else frozenset({FULL})  # type: ignore[attr-defined]


def loader_of(param: torch.Tensor) -> tuple[WeightLoader, frozenset]:
    return getattr(param, "weight_loader", default_loader), getattr(param, "weight_shards", frozenset({FULL}))


def slice_of(param: torch.Tensor, shard: Any, disk_shape: tuple[int, ...]) -> Any:
    """The part of a checkpoint tensor this rank reads: None (all of it), an index tuple, or SKIP (none)."""
    slicer = getattr(param, "checkpoint_slice", None)
    return slicer(shard, disk_shape) if slicer is not None else None
