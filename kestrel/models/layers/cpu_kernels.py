"""Kestrel's compiled CPU kernels (`*_cpu.cpp` here), built once per Python environment, loaded by every process.

Why: a decode step or a verify block of a small model spends its time on op dispatch, not arithmetic. A few loops
that PyTorch would run as dozens of tiny ATen ops a layer are written in C++ instead: KDA's token loop and its conv
(`kda_cpu.cpp`, used by `kda_kernel`), the routed experts of a decode-sized batch (`experts_cpu.cpp`, used by `moe`)
and MLA decode attention read from the KV pool (`mla_cpu.cpp`, used by `mla`); `cpu_common.cpp` holds what they
share.

Built by `torch.utils.cpp_extension` (g++ and ninja) into torch's extensions folder (one build per Python
environment) by `make setup`, or else the first time an engine starts on CPU (~25 s, then a cached load of well under
a second). Used only for fp32 CPU tensors outside autograd, the compiler and batch-invariant mode (whose trainer
must see the very same ops); everything else, a machine without a compiler, and `KESTREL_CPU_KERNELS=0` run the
PyTorch ops. Each kernel agrees with the ops it replaces to fp32 rounding (tests/test_cpu_kernels.py), and decode
steps and verify blocks take the same arithmetic, so their outputs stay identical to each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from kestrel.models.layers import batch_invariant

log = logging.getLogger(__name__)
# One translation unit, in this order: cpu_common.cpp first (the shared helpers the others use).
SOURCES = [
    Path(__file__).with_name(name) for name in ("cpu_common.cpp", "kda_cpu.cpp", "experts_cpu.cpp", "mla_cpu.cpp")
]
FUNCTIONS = [
    "kda_steps_fp32",
    "kda_varlen_fp32",
    "kda_segment_fp32",
    "kda_decode_fp32",
    "kda_conv_qkv_fp32",
    "expert_pairs_up_fp32",
    "expert_pairs_down_fp32",
    "mla_decode_fp32",
]
ENV_SWITCH = "KESTREL_CPU_KERNELS"
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


def build_name() -> str:
    """The extension's name, one per Python environment: torch keys its build folder by name and rebuilds when the
    build's include paths change, so two checkouts' venvs sharing one name rebuilt each other's kernels (~25-55 s
    at the next engine start, enough to miss a health check)."""
    return "kestrel_cpu_kernels_" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]


def _build() -> ModuleType | None:
    from torch.utils.cpp_extension import load_inline

    t0 = time.perf_counter()
    try:
        mod = load_inline(
            build_name(),
            cpp_sources=[path.read_text() for path in SOURCES],
            functions=FUNCTIONS,
            # -fopenmp: at::parallel_for's inline OpenMP region (torch's own libgomp serves it at run time)
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
        )
    except Exception as exc:  # no compiler or ninja: the PyTorch ops serve instead
        log.warning("Kestrel CPU kernels unavailable (%s: %s); using the PyTorch ops", type(exc).__name__, exc)
        return None
    log.info("Kestrel CPU kernels ready in %.1f s", time.perf_counter() - t0)
    return mod


def inference_on_cpu(x: torch.Tensor) -> bool:
    """The conditions every kernel shares: a CPU tensor outside autograd, the compiler and batch-invariant mode."""
    return (
        not torch.is_grad_enabled()
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not batch_invariant.active()
    )


def fp32_contiguous(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
