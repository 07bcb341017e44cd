"""Collectives over one axis group and point-to-point transfers, counting the bytes each rank hands to them (per
op, reset per step).

A group of one issues nothing and counts nothing, so model code calls these unconditionally. Counted bytes are
the payload this rank contributes: all_reduce and broadcast its tensor, all_gather and reduce_scatter and
all_to_all the tensor they send, send (point to point, between pipeline stages) its tensor.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

from kestrel.dist.groups import Group

BYTES: Counter[str] = Counter()
CALLS: Counter[str] = Counter()


def reset_counters() -> None:
    BYTES.clear()
    CALLS.clear()


def _count(op: str, t: torch.Tensor) -> None:
    BYTES[op] += t.numel() * t.element_size()
    CALLS[op] += 1


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, in place (the tensor is returned)."""
    if group.size == 1:
        return x
    _count("all_reduce", x)
    dist.all_reduce(x, group=group.device_group)
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's equal-shaped x along `dim`, in rank order."""
    if group.size == 1:
        return x
    _count("all_gather", x)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x, group=group.device_group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, each rank keeping its 1/size of dim 0 (dim 0 divisible by the group size)."""
    if group.size == 1:
        return x
    _count("reduce_scatter", x)
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=group.device_group)
    return out


def all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: Group) -> torch.Tensor:
    """Rows [sum(send_counts[:j]), +send_counts[j]) go to rank j; returns what every rank sent here, in rank order."""
    if group.size == 1:
        return x
    _count("all_to_all", x)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group.device_group)
    return out


def exchange_counts(counts: list[int], group: Group) -> list[int]:
    """all_to_all of one int per peer (what each rank sends to each other), over the CPU group."""
    if group.size == 1:
        return list(counts)
    send = torch.tensor(counts, dtype=torch.long)
    _count("all_to_all_counts", send)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.cpu_group)
    return recv.tolist()


def broadcast(x: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Broadcast x in place from the group's `src_index`-th rank over the device group."""
    if group.size == 1:
        return x
    _count("broadcast", x)
    dist.broadcast(x, src=group.ranks[src_index], group=group.device_group)
    return x


def broadcast_cpu(x: torch.Tensor, group: Group, src_index: int = 0) -> torch.Tensor:
    """Broadcast a CPU tensor from the group's `src_index`-th rank over the gloo metadata group."""
    if group.size == 1:
        return x
    _count("broadcast", x)
    dist.broadcast(x, src=group.ranks[src_index], group=group.cpu_group)
    return x


def send(x: torch.Tensor, dst: int, tag: int = 0):
    """Start sending x to global rank `dst` (point to point; pipeline stages). Returns the work: keep x unchanged and
    alive until `wait_all` has waited for it."""
    _count("send", x)
    return dist.isend(x.contiguous(), dst, tag=tag)


def recv(x: torch.Tensor, src: int, timeout_s: float, tag: int = 0) -> torch.Tensor:
    """Receive into x from global rank `src`; a sender that never sends fails this after `timeout_s`."""
    dist.irecv(x, src, tag=tag).wait(timedelta(seconds=timeout_s))
    return x


def wait_all(works: list, timeout_s: float) -> None:
    for work in works:
        work.wait(timedelta(seconds=timeout_s))
