"""KDA state slots, each holding the conv + recurrent state of every KDA layer.

A running request holds one; with the prefix cache it may hold a tail slot too (the state at its last page
boundary, kept for the finish-time checkpoint), and the radix tree keeps checkpoints in slots of its own.

`SlotAllocator` is integers for the scheduler; `StateStorage` holds the tensors for the model runner.
"""

from __future__ import annotations

import bisect

import torch

from kestrel.cache.free_list import FreeList
from kestrel.config import ModelConfig


class SlotAllocator(FreeList):
    """State-slot ids for the scheduler and the radix tree; zero slots for a model without KDA layers.

    Two-ended: a running request's slot is the lowest free id (`alloc_low`), checkpoints and snapshots take the
    highest (`alloc`). Requests admitted together then hold one run of slots in arrival order, and a decode batch
    over one run updates its KDA states in place in the pool (`PagedCacheView.decode_state_views`) instead of
    gathering and scattering them: at 32 decoding requests those copies were ~13% of the step.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # ascending: take() pops the highest, alloc_low the lowest

    def alloc(self) -> int | None:
        """The highest free slot (checkpoints, snapshots), or None."""
        got = self.take(1)
        return got[0] if got else None

    def alloc_low(self) -> int | None:
        """The lowest free slot (a running request's own state), or None."""
        if not self._free:
            return None
        slot = self._free.pop(0)
        self._allocated.add(slot)
        return slot

    def give_back(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._allocated:
                raise RuntimeError(f"{self.what} {i} freed twice or never allocated")
            self._allocated.remove(i)
            bisect.insort(self._free, i)

    def free(self, slot: int) -> None:
        self.give_back([slot])


def state_bytes_per_slot(cfg: ModelConfig, conv_dtype: torch.dtype) -> int:
    """Conv inputs (model dtype) + recurrent state (fp32) over all KDA layers."""
    c = cfg.kda_num_heads * cfg.kda_head_dim
    conv = 3 * c * (cfg.kda_conv_size - 1) * torch.tensor([], dtype=conv_dtype).element_size()
    rec = cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    return len(cfg.kda_layers) * (conv + rec)


class StateStorage:
    """conv [slots, 3C, kernel-1] and recurrent [slots, H, K, V] (fp32) per KDA layer."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device) -> None:
        c = cfg.kda_num_heads * cfg.kda_head_dim
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        self.conv = {
            layer: torch.zeros(num_slots, 3 * c, cfg.kda_conv_size - 1, dtype=dtype, device=device)
            for layer in cfg.kda_layers
        }
        self.recurrent = {
            layer: torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device) for layer in cfg.kda_layers
        }

    def reset(self, slots: list[int]) -> None:
        """Zero the given slots: a request starting from token 0 has an empty state."""
        if not slots:
            return
        idx = torch.tensor(slots, device=next(iter(self.conv.values())).device) if self.conv else None
        for layer in self.conv:
            self.conv[layer].index_fill_(0, idx, 0)
            self.recurrent[layer].index_fill_(0, idx, 0)

    def copy(self, src: int, dst: int) -> None:
        for layer in self.conv:
            self.conv[layer][dst] = self.conv[layer][src]
            self.recurrent[layer][dst] = self.recurrent[layer][src]

    def gather(self, slot: int) -> dict[str, torch.Tensor]:
        """One slot's conv + recurrent states of every KDA layer, on the CPU (host tier, disk tier)."""
        out = {}
        for layer in self.conv:
            # copy=True: on a CPU device `.cpu()` would return a view of the slot, which gets reused.
            out[f"conv.{layer}"] = self.conv[layer][slot].to("cpu", copy=True)
            out[f"recurrent.{layer}"] = self.recurrent[layer][slot].to("cpu", copy=True)
        return out

    def scatter(self, slot: int, state: dict[str, torch.Tensor]) -> None:
        for layer in self.conv:
            self.conv[layer][slot] = state[f"conv.{layer}"].to(self.conv[layer].device)
            self.recurrent[layer][slot] = state[f"recurrent.{layer}"].to(self.recurrent[layer].device)
