"""Modules that only Kestrel's own layers call: calling one runs its `forward` directly.

`nn.Module.__call__` goes through hook dispatch (two Python frames and eight hook-dict checks, ~1 us) even when no
hook exists; a batch-1 decode step of a small model calls ~100 norms, routers, expert blocks and attention layers,
and skipping that dispatch made the step ~3% faster (same-process A/B, kimi_linear small). The cost is that hooks
cannot run here, so registering one raises instead of being silently skipped: hook a module inside (LoRA hooks
`nn.Linear` projections, which stay ordinary modules).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class HooklessModule(nn.Module):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "forward" in cls.__dict__:
            cls.__call__ = cls.__dict__["forward"]  # type: ignore[method-assign]

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__} is a HooklessModule (called without hook dispatch): hook a submodule")

    register_forward_hook = register_forward_pre_hook = _refuse  # type: ignore[assignment]
    register_full_backward_hook = register_full_backward_pre_hook = register_backward_hook = _refuse  # type: ignore[assignment]
