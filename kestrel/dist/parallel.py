"""Parallel twins of the model's layers: each holds this rank's shard and reads only that shard from disk.

They replace layers of an already-built model (`tensor_parallel.shard_model`), so model code never branches on
the layout. Every sharded parameter carries `checkpoint_slice(shard, disk_shape)`: the index this rank reads
through safetensors' `get_slice` (or `SKIP` for a tensor that is not this rank's at all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kestrel.dist import comm
from kestrel.dist.groups import Group
from kestrel.models.layers.linear import FusedLinear
from kestrel.models.weight_loaders import ShapeMismatch, set_loader, stacked_loader

Slicer = Callable[[Any, tuple[int, ...]], Any]


def shard_range(size: int, group: Group, what: str) -> tuple[int, int]:
    """(start, length) of this rank's contiguous equal share of `size`."""
    if size % group.size:
        raise ValueError(f"{what}: {size} does not split evenly over {group.size} ranks")
    n = size // group.size
    return group.rank * n, n


def dim_slicer(dim: int, start: int, length: int, full: int | None = None) -> Slicer:
    """Read [start, start + length) of `dim` (a negative dim counts from the end). With `full`, the dim is the one
    of that size (e.g. A_log's heads stored as [1, 1, H, 1])."""

    def slicer(shard: Any, disk_shape: tuple[int, ...]) -> tuple:
        d = dim % len(disk_shape) if full is None else list(disk_shape).index(full)
        return tuple(slice(start, start + length) if i == d else slice(None) for i in range(len(disk_shape)))

    return slicer


def set_slicer(param: torch.Tensor, slicer: Slicer) -> None:
    param.checkpoint_slice = slicer  # type: ignore[attr-defined]


def empty_param(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    """An uninitialised parameter of `like`'s dtype and device (meta while sharding)."""
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device=like.device), requires_grad=False)


class ColumnParallelLinear(nn.Linear):
    """y = x W_rᵀ: this rank's rows of W (output features); `gather` all-gathers the full output."""

    def __init__(self, base: nn.Linear, group: Group, gather: bool = False) -> None:
        start, n = shard_range(base.out_features, group, "output features")
        super().__init__(base.in_features, n, bias=base.bias is not None, device=base.weight.device)
        self.to(base.weight.dtype)
        self.group, self.gather = group, gather
        for p in (self.weight, self.bias):
            if p is not None:
                set_slicer(p, dim_slicer(0, start, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return comm.all_gather(y, self.group, dim=-1) if self.gather else y


class RowParallelLinear(nn.Linear):
    """y = Σ_ranks x_r W_rᵀ + b: this rank's columns of W (input features), summed over the group."""

    def __init__(self, base: nn.Linear, group: Group) -> None:
        start, n = shard_range(base.in_features, group, "input features")
        super().__init__(n, base.out_features, bias=base.bias is not None, device=base.weight.device)
        self.to(base.weight.dtype)
        self.group = group
        self.reduce = True  # False: return this rank's partial sum (a caller reduces it, e.g. reduce-scatter)
        set_slicer(self.weight, dim_slicer(1, start, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = comm.all_reduce(y, self.group)
        elif self.group.rank != 0:
            return y  # the bias joins the sum once, from the group's first rank
        return y + self.bias if self.bias is not None else y


class ParallelFusedLinear(FusedLinear):
    """A `FusedLinear` whose parts are either split over the group (head-major outputs) or replicated."""

    def __init__(self, base: FusedLinear, group: Group, split: set[str]) -> None:
        biased = frozenset(getattr(base.bias, "weight_shards", ())) if base.bias is not None else frozenset()
        ranges = {name: shard_range(size, group, name) if name in split else (0, size) for name, size in base.parts.items()}
        super().__init__(base.in_features, {name: n for name, (_, n) in ranges.items()}, biased)
        self.to(device=base.weight.device, dtype=base.weight.dtype)
        self.split = set(split)

        def slicer(shard: Any, disk_shape: tuple[int, ...]) -> tuple | None:
            if shard not in self.split:
                return None
            start, n = ranges[shard]
            return (slice(start, start + n),) + (slice(None),) * (len(disk_shape) - 1)

        for p in (self.weight, self.bias):
            if p is not None:
                set_slicer(p, slicer)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's ceil(V / n) rows of the table (the last rank zero-padded); lookups summed over the group."""

    def __init__(self, base: nn.Embedding, group: Group) -> None:
        vocab = base.num_embeddings
        per = -(-vocab // group.size)
        super().__init__(per, base.embedding_dim, device=base.weight.device, dtype=base.weight.dtype)
        self.group, self.vocab = group, vocab
        self.start = group.rank * per
        self.real = max(0, min(per, vocab - self.start))
        set_vocab_shard(self.weight, self.start, self.real)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.real)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return comm.all_reduce(out, self.group)


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary rows, all-gathered (and the padding cut) before sampling."""

    def __init__(self, base: nn.Linear, group: Group) -> None:
        vocab = base.out_features
        per = -(-vocab // group.size)
        super().__init__(base.in_features, per, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.group, self.vocab = group, vocab
        set_vocab_shard(self.weight, group.rank * per, max(0, min(per, vocab - group.rank * per)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(super().forward(x), self.group, dim=-1)[..., : self.vocab]


def set_vocab_shard(weight: torch.Tensor, start: int, real: int) -> None:
    """Rows [start, start + real) of the checkpoint land in the first `real` rows; padding rows read zero."""

    def load(param: torch.Tensor, tensor: torch.Tensor, shard: Any) -> None:
        if tuple(tensor.shape) != (real, param.shape[1]):
            raise ShapeMismatch(f"expected {(real, param.shape[1])}, got {tuple(tensor.shape)}")
        param.data[:real].copy_(tensor)
        param.data[real:].zero_()

    set_loader(weight, load)
    set_slicer(weight, dim_slicer(0, start, real))


def split_conv1d(base: nn.Conv1d, parts: int, group: Group) -> nn.Conv1d:
    """Depthwise conv of `parts` stacked channel blocks (KDA q|k|v), each block split over the group."""
    block = base.out_channels // parts
    start, n = shard_range(block, group, "conv channels")
    local = parts * n
    conv = nn.Conv1d(local, local, base.kernel_size[0], groups=local, bias=False, device=base.weight.device)
    conv.to(base.weight.dtype)
    set_loader(conv.weight, stacked_loader({"q": 0, "k": 1, "v": 2}, parts), {"q", "k", "v"})
    set_slicer(conv.weight, dim_slicer(0, start, n))
    return conv


def split_vector(param: nn.Parameter, group: Group, what: str) -> nn.Parameter:
    """A per-head or per-channel vector split over the group (dt_bias, A_log); keeps its loader."""
    full = param.shape[0]
    start, n = shard_range(full, group, what)
    out = empty_param((n,), param)
    for attr in ("weight_loader", "weight_shards"):
        if hasattr(param, attr):
            setattr(out, attr, getattr(param, attr))
    set_slicer(out, dim_slicer(0, start, n, full=full))
    return out

