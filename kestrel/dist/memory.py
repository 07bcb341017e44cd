"""What one rank actually allocates: weight bytes, KV bytes per token and KDA state bytes per request slot.

`kestrel plan` predicts these per layout; tests and `benchmarks/parallel_layouts.py` read the real ones here.
"""

from __future__ import annotations

import torch

from kestrel.cache.kv_pool import KVStorage
from kestrel.cache.state_pool import StateStorage


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fp32_params(model: torch.nn.Module) -> int:
    """Parameters kept in fp32 whatever the model dtype (router, KDA A_log and dt_bias)."""
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)


def kv_bytes_per_token(kv: KVStorage) -> int:
    """Bytes one token slot takes over every MLA/DSA layer of this rank's pool."""
    tensors = [*kv.latent.values(), *kv.rope_key.values(), *(t for t in kv.index_key.values() if t is not None)]
    return sum(t.shape[1] * t.element_size() for t in tensors)


def state_bytes_per_slot(states: StateStorage | None) -> int:
    """Bytes one KDA state slot takes over every KDA layer of this rank's pool."""
    if states is None:
        return 0
    tensors = [*states.conv.values(), *states.recurrent.values()]
    return sum(t[0].numel() * t.element_size() for t in tensors)
