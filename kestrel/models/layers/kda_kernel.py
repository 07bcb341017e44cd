"""The compiled CPU form of KDA's token loop (`kda_cpu.cpp`), built once per machine and used where it applies.

Why: a decode step or a verify block of a small model spends its KDA time on dispatch, not arithmetic. Each token of
`kda_steps` is five ATen ops on a [K, V] state per head (~25 us a token and layer at K = V = 64, one thread); the C++
loop keeps each head's state in cache and runs the same arithmetic for all tokens in ~4 us (a 7-token verify block of
4 heads: 163 -> 29 us; one decode token: 36 -> 7 us). `benchmarks/kda_kernel.py` measures it.

Built by `torch.utils.cpp_extension` (g++ and ninja) into torch's extensions folder the first time an engine with KDA
layers starts on CPU (~25 s, then a cached load). Used only for fp32 CPU states outside autograd, the compiler and
batch-invariant mode (whose trainer must see the very same ops); everything else, a machine without a compiler, and
`KESTREL_KDA_CPU_KERNEL=0` run the PyTorch ops. The two agree to fp32 rounding (tests/test_kda_kernel.py), and every
engine path (decode, verify, short prefill) takes the same one, so their outputs stay identical to each other.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from kestrel.models.layers import batch_invariant

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kda_cpu.cpp")
ENV_SWITCH = "KESTREL_KDA_CPU_KERNEL"
_built: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def module() -> ModuleType | None:
    """The built extension (building it on first call), or None where it cannot be built or is switched off."""
    if not enabled():
        return None
    if "module" not in _built:
        _built["module"] = _build()
    return _built["module"]


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load_inline

    t0 = time.perf_counter()
    try:
        mod = load_inline(
            "kestrel_kda_cpu",
            cpp_sources=SOURCE.read_text(),
            functions=["kda_steps_fp32"],
            extra_cflags=["-O3", "-march=native"],
        )
    except Exception as exc:  # no compiler or ninja: the PyTorch ops serve instead
        log.warning("KDA CPU kernel unavailable (%s: %s); using the PyTorch ops", type(exc).__name__, exc)
        return None
    log.info("KDA CPU kernel ready in %.1f s", time.perf_counter() - t0)
    return mod


def applies(q: torch.Tensor, state: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether `steps` may serve this call: fp32 contiguous CPU state (and output buffers), no autograd, compiler
    or batch-invariant mode. Builds the kernel on first use."""
    if torch.is_grad_enabled() or q.device.type != "cpu" or torch.compiler.is_compiling() or batch_invariant.active():
        return False
    if state.dtype != torch.float32 or not state.is_contiguous():
        return False
    if outs and any(s.dtype != torch.float32 or not s.is_contiguous() or s.shape != state.shape for s in outs):
        return False
    return module() is not None


def steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep: dict[int, torch.Tensor],
    final: torch.Tensor,
) -> torch.Tensor:
    """Outputs [B, T, H, V] of T tokens from `state` (one token may come as [B, H, ...]: outputs [B, H, V]); the
    state after token t is written into keep[t] and the final one into `final` (which may be `state`). Call only where
    `applies` said yes."""
    q, k, v, g, beta = (_fp32(x) for x in (q, k, v, g, beta))
    return _built["module"].kda_steps_fp32(q, k, v, g, beta, state, list(keep), list(keep.values()), final)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
