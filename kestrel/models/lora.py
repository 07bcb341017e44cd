"""LoRA adapters as a separate term beside the frozen base: y = x Wᵀ + (alpha/r) · (x Aᵀ) Bᵀ, never merged into W.

One `LoRAManager` per model holds every loaded adapter in a numbered slot and a hook on each projection an
adapter targets. A forward applies adapters segment-wise: the batch's rows are grouped by slot once per step
(`set_rows`, one row mask per slot) and each hooked projection adds, per slot present, one masked low-rank product
(a loop over the adapters present, not over requests). On a fused projection (`FusedLinear`: KDA q|k|v|f_a|b|g,
MLA q_a|kv_a|..., MLP gate|up) an adapter on one part adds only to that part's output columns.

Targets (checkpoint module names' last component): every projection whose `forward` computes x Wᵀ. Miles' recipe
adapts the attention projections, the dense MLP and the shared and routed experts over a frozen base; kept frozen
and not targetable here: the MoE router (`mlp.gate`, a scoring matrix whose top-k is not differentiable and
which routing replay must see unchanged), the DSA indexer (`indexer.wk`, `indexer.weights_proj`, `indexer.wq_b`:
it only chooses positions and trains on its own distillation loss), and `kv_b_proj` (the absorbed MLA forms read
its weight directly, so an activation-side term would miss them). Routed experts take per-expert A and B on
gate_proj / up_proj / down_proj (names `...mlp.experts.<e>.<proj>`, Kimi's w1 / w3 / w2 on disk), added to each
(token, expert) pair's outputs inside the grouped expert computation. On disk an adapter is PEFT's format:
`adapter_config.json` + `adapter_model.safetensors` with tensors `base_model.model.<module>.lora_A.weight`
[r, in] and `.lora_B.weight` [out, r].
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load, save_file
from torch import nn

from kestrel.models.layers.linear import FusedLinear
from kestrel.models.layers.moe import Experts, segment_linear

TARGETABLE = frozenset(
    {
        # KDA
        "q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj", "f_b_proj", "g_b_proj", "o_proj",
        # MLA (q_proj / g_proj / o_proj above)
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
        # dense MLP and shared experts; latent-MoE projections
        "gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj",
    }
)  # fmt: skip
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass
class LoRAAdapter:
    """One adapter: `weights[module] = (A [r, in], B [out, r])` under Kestrel module names."""

    name: str
    r: int
    lora_alpha: float
    target_modules: list[str]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    checksum: str = ""  # sha256 (hex) of the adapter_model.safetensors bytes it was read from

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
_KIMI_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def lora_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str | tuple[int, str] | None]]:
    """Every targetable projection: Kestrel module name → (module, part of a FusedLinear, (expert, projection) of
    the routed experts, or None)."""
    out: dict[str, tuple[nn.Module, str | tuple[int, str] | None]] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if type(module) is Experts:  # per-expert A and B (MXFP4-packed experts are not targetable)
            for e in range(module.gate_up_proj.shape[0]):
                out |= {f"{name}.{e}.{proj}": (module, (e, proj)) for proj in EXPERT_PROJS}
        elif isinstance(module, FusedLinear):
            for part in module.parts:
                if part in TARGETABLE:
                    out[f"{parent}.{part}"] = (module, part)
        elif type(module) is nn.Linear and leaf in TARGETABLE and ".indexer." not in name:
            out[name] = (module, None)
    return out


def in_out(module: nn.Module, part: str | tuple[int, str] | None) -> tuple[int, int]:
    """(in, out) features of one target (A is [r, in], B is [out, r])."""
    if isinstance(part, tuple):
        inter, hidden = module.down_proj.shape[2], module.down_proj.shape[1]
        return (inter, hidden) if part[1] == "down_proj" else (hidden, inter)
    return module.in_features, module.parts[part] if part is not None else module.out_features


def validate(adapter: LoRAAdapter, model: nn.Module, max_rank: int | None = None) -> None:
    """ValueError naming the first module or field that does not fit `model`."""
    if adapter.r <= 0:
        raise ValueError(f"adapter {adapter.name!r}: r must be positive, got {adapter.r}")
    if max_rank is not None and adapter.r > max_rank:
        raise ValueError(f"adapter {adapter.name!r}: r={adapter.r} exceeds --max-lora-rank {max_rank}")
    if not adapter.weights:
        raise ValueError(f"adapter {adapter.name!r}: no lora_A/lora_B tensors")
    targets = lora_targets(model)
    for module, (a, b) in adapter.weights.items():
        if module not in targets:
            raise ValueError(f"adapter {adapter.name!r}: {module} is not a LoRA-targetable projection of this model")
        d_in, d_out = in_out(*targets[module])
        if tuple(a.shape) != (adapter.r, d_in) or tuple(b.shape) != (d_out, adapter.r):
            raise ValueError(
                f"adapter {adapter.name!r}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, "
                f"expected {(adapter.r, d_in)} / {(d_out, adapter.r)}"
            )


_EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


def _disk_name(model_type: str, name: str) -> str:
    """Kimi checkpoints name every feed-forward block `block_sparse_moe` and the experts' projections w1 / w3 / w2
    (as `export_state_dict` writes them)."""
    if model_type not in ("kimi_linear", "kimi_k3"):
        return name
    name = _EXPERT_NAME.sub(lambda m: f".experts.{m.group(1)}.{_KIMI_EXPERT[m.group(2)]}", name)
    return name.replace(".mlp.", ".block_sparse_moe.")


def _kestrel_name(name: str) -> str:
    """A checkpoint module name in Kestrel's naming (the inverse of `_disk_name`)."""
    back = {v: k for k, v in _KIMI_EXPERT.items()}
    name = _EXPERT_NAME.sub(lambda m: f".experts.{m.group(1)}.{back.get(m.group(2), m.group(2))}", name)
    return name.replace(".block_sparse_moe.", ".mlp.")


def save_peft(adapter: LoRAAdapter, path: str | Path, model_type: str, base_model: str | None = None) -> Path:
    """Write the adapter as PEFT does (names in the family's checkpoint naming)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in adapter.weights.items():
        key = PEFT_PREFIX + _disk_name(model_type, module)
        tensors[f"{key}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"{key}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.r,
        "lora_alpha": adapter.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(adapter.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


_TENSOR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


def load_peft(path: str | Path, name: str | None = None) -> LoRAAdapter:
    """Read a PEFT LoRA directory; ValueError naming the missing file or unsupported field."""
    root = Path(path)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / f).is_file():
            raise ValueError(f"LoRA adapter at {root}: missing {f}")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise ValueError(f"LoRA adapter at {root}: {CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter at {root}: {CONFIG_FILE} must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter at {root}: peft_type {config['peft_type']!r} is not LORA")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(flag):
            raise ValueError(f"LoRA adapter at {root}: {flag}=true is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter at {root}: bias={config['bias']!r} is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter at {root}: rank_pattern / alpha_pattern are not supported")
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except KeyError as e:
        raise ValueError(f"LoRA adapter at {root}: adapter_config.json lacks {e.args[0]}") from None
    data = (root / WEIGHTS_FILE).read_bytes()  # read once: the checksum is of exactly the bytes parsed
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors' own error type: a truncated or foreign file
        raise ValueError(f"LoRA adapter at {root}: unreadable {WEIGHTS_FILE} ({exc})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            raise ValueError(f"LoRA adapter at {root}: unexpected tensor {key}")
        module = _kestrel_name(m.group(1))
        halves.setdefault(module, {})[m.group(2)] = tensor
    weights = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter at {root}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
        weights[module] = (ab["A"], ab["B"])
    targets = config.get("target_modules") or sorted({m.rsplit(".", 1)[-1] for m in weights})
    if isinstance(targets, str):
        targets = [targets]
    return LoRAAdapter(name or root.name, r, alpha, list(targets), weights, hashlib.sha256(data).hexdigest())


class _Hook:
    """The LoRA term of one projection: per slot, (output columns, A, B, scale) for each targeted part."""

    def __init__(self, manager: LoRAManager, module: nn.Module) -> None:
        self.manager, self.module = manager, module
        self.entries: dict[int, list[tuple[slice, torch.Tensor, torch.Tensor, float]]] = {}

    def columns(self, part: str | None) -> slice:
        if part is None:
            return slice(0, self.module.out_features)
        lo = sum(self.module.sizes[: list(self.module.parts).index(part)])
        return slice(lo, lo + self.module.parts[part])

    def __call__(self, x: torch.Tensor, out: torch.Tensor, columns: slice | None = None) -> torch.Tensor:
        """out (+)= the LoRA term of every active slot on its rows; `columns` narrows `out` to one part (`part`)."""
        for slot, rows in self.manager.segments:
            for cols, a, b, scale in self.entries.get(slot, ()):
                if columns is not None:
                    if cols.start < columns.start or cols.stop > columns.stop:
                        continue
                    cols = slice(cols.start - columns.start, cols.stop - columns.start)
                h = F.linear(x, a)
                if rows is not None:
                    h = h * rows  # zero the rank-space rows of other adapters
                out[..., cols] += F.linear(h, b) * scale
        return out


class _ExpertsHook:
    """The LoRA terms of a routed-experts module: per slot and projection, A [E, r, in] and B [E, out, r] stacked
    over experts (zeros for experts the adapter leaves alone), applied to each (token, expert) pair."""

    def __init__(self, manager: LoRAManager, module: Experts) -> None:
        self.manager, self.module = manager, module
        self.entries: dict[int, dict[str, tuple[list, list, float]]] = {}
        self.cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # stacked inference weights

    def add(self, slot: int, expert: int, proj: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        n = self.module.gate_up_proj.shape[0]
        a_list, b_list, _ = self.entries.setdefault(slot, {}).setdefault(proj, ([None] * n, [None] * n, scale))
        a_list[expert], b_list[expert] = a, b
        self.cache.pop((slot, proj), None)

    def active(self) -> bool:
        return any(slot in self.entries for slot, _ in self.manager.segments)

    def _stacked(self, a_list: list, b_list: list) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, r', in] and [E, out, r'], the rank zero-padded to a multiple of 8 (the grouped GEMM wants 16-byte
        strides; the zero columns add exact zeros)."""
        a0 = next(a for a in a_list if a is not None)
        r = a0.shape[0]
        pad = -r % 8
        a = torch.stack([a if a is not None else a0.new_zeros(a0.shape) for a in a_list])
        b = torch.stack([b if b is not None else a0.new_zeros(self._out(b_list), r) for b in b_list])
        if pad:
            a = torch.cat([a, a.new_zeros(a.shape[0], pad, a.shape[2])], dim=1)
            b = torch.cat([b, b.new_zeros(b.shape[0], b.shape[1], pad)], dim=2)
        return a, b

    @staticmethod
    def _out(b_list: list) -> int:
        return next(b for b in b_list if b is not None).shape[0]

    def _delta(self, proj: str, xs: torch.Tensor, token_of: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        total = None
        for slot, rows in self.manager.segments:
            entry = self.entries.get(slot, {}).get(proj)
            if entry is None:
                continue
            key = (slot, proj)
            if key in self.cache:
                a, b = self.cache[key]
            else:
                a, b = self._stacked(entry[0], entry[1])
                if not a.requires_grad:  # trained weights change every step: restack them each forward
                    self.cache[key] = (a, b)
            h = segment_linear(xs, a, counts)
            if rows is not None:
                h = h * rows[token_of]
            d = segment_linear(h, b, counts) * entry[2]
            total = d if total is None else total + d
        return total

    def expert_delta(self, expert: int, proj: str, inp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | float:
        """The LoRA term of one expert's projection on its rows (batch-invariant mode, one expert at a time)."""
        total: torch.Tensor | float = 0.0
        for slot, rows in self.manager.segments:
            entry = self.entries.get(slot, {}).get(proj)
            if entry is None or entry[0][expert] is None:
                continue
            h = F.linear(inp, entry[0][expert])
            if rows is not None:
                h = h * rows[tokens]
            total = total + F.linear(h, entry[1][expert]) * entry[2]
        return total

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`expert_segments` with the LoRA terms added to each pair's gate, up and down outputs."""
        m = self.module
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(m.gate_up_proj.shape[0], dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat)
        )
        token_of = order // ids.shape[1]
        xs = x[token_of]
        gate, up = segment_linear(xs, m.gate_up_proj, counts).chunk(2, dim=-1)
        gate_d, up_d = self._delta("gate_proj", xs, token_of, counts), self._delta("up_proj", xs, token_of, counts)
        gate = gate if gate_d is None else gate + gate_d
        up = up if up_d is None else up + up_d
        h = m.act(gate, up)
        y = segment_linear(h, m.down_proj, counts)
        down_d = self._delta("down_proj", h, token_of, counts)
        y = (y if down_d is None else y + down_d) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))


def _hooked(hook: _Hook | _ExpertsHook) -> bool:
    module = hook.module
    if isinstance(module, (FusedLinear, Experts)):
        return module.lora is hook
    return bool(module._forward_hooks)


class LoRAManager:
    """Adapters of one model in numbered slots; `segments` says which slot applies to which rows this forward.

    `detach_idle`: a forward with no adapter row runs with the hooks taken off the projections (an eager engine
    whose adapters only some requests use: a registered hook costs every call its dispatch, ~2% of a batch-1 step
    of kestrel-mini). A compiled forward keeps them on: its graphs were traced with them.
    """

    def __init__(self, model: nn.Module, detach_idle: bool = False) -> None:
        self.model = model
        self.targets = lora_targets(model)
        self.adapters: dict[int, LoRAAdapter] = {}
        self.hooks: dict[int, _Hook] = {}  # id(module) -> hook
        self._handles: dict[int, object] = {}  # id(module) -> forward-hook handle of a plain nn.Linear, while on
        self.detach_idle = detach_idle
        self._on = True
        # (slot, row mask [T, 1] or None for every row) of the next forward.
        self.segments: list[tuple[int, torch.Tensor | None]] = []

    @property
    def attached(self) -> bool:
        """The hooks are on the projections (off only between base-only forwards with `detach_idle`)."""
        return all(_hooked(hook) for hook in self.hooks.values())

    def attach(self) -> None:
        self._on = True
        for key, hook in self.hooks.items():
            module = hook.module
            if isinstance(module, (FusedLinear, Experts)):
                module.lora = hook
            elif key not in self._handles:
                self._handles[key] = module.register_forward_hook(lambda mod, args, out, h=hook: h(args[0], out))

    def detach(self) -> None:
        self._on = False
        for hook in self.hooks.values():
            if isinstance(hook.module, (FusedLinear, Experts)):
                hook.module.lora = None
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()

    def slot_of(self, name: str) -> int:
        for slot, adapter in self.adapters.items():
            if adapter.name == name:
                return slot
        raise KeyError(name)

    def add(self, adapter: LoRAAdapter, max_rank: int | None = None) -> int:
        """Validate, then attach in a free slot (A, B cast to the base's dtype unless they train as they are)."""
        validate(adapter, self.model, max_rank)
        if any(a.name == adapter.name for a in self.adapters.values()):
            raise ValueError(f"adapter {adapter.name!r} is already loaded")
        slot = next(i for i in range(len(self.adapters) + 1) if i not in self.adapters)
        for module_name, (a, b) in adapter.weights.items():
            module, part = self.targets[module_name]
            if id(module) not in self.hooks:
                self.hooks[id(module)] = (_ExpertsHook if isinstance(module, Experts) else _Hook)(self, module)
            hook = self.hooks[id(module)]
            w = module.gate_up_proj if isinstance(module, Experts) else module.weight
            if not a.requires_grad:
                a, b = a.to(w.device, w.dtype), b.to(w.device, w.dtype)
            if isinstance(module, Experts):
                hook.add(slot, *part, a, b, adapter.scale)
            else:
                hook.entries.setdefault(slot, []).append((hook.columns(part), a, b, adapter.scale))
        self.adapters[slot] = adapter
        self.attach()
        return slot

    def rename(self, name: str, new_name: str) -> None:
        """Keep an adapter's slot and weights under another name (an upserted adapter's old version)."""
        self.adapters[self.slot_of(name)].name = new_name

    def remove(self, name: str) -> None:
        slot = self.slot_of(name)
        for hook in self.hooks.values():
            hook.entries.pop(slot, None)
            for key in [k for k in getattr(hook, "cache", {}) if k[0] == slot]:
                del hook.cache[key]
        del self.adapters[slot]

    def set_rows(self, slots: list[int | None] | None) -> None:
        """Per-row slot (None = base) of the next forward, as one row mask [T, 1] per slot present.

        Each slot's low-rank product runs over every row and the mask zeroes the others in rank space: its flops
        are r/out of the base matmul's, and on CPU this beat gathering the slot's rows and scattering them back
        (index_select / index_add_ cost more than the whole product).
        """
        self.segments = []
        present = sorted({s for s in slots or () if s is not None})
        if self.detach_idle and bool(present) != self._on:  # only on a change: module setattr costs ~1 us each
            if present:
                self.attach()
            else:
                self.detach()
        if not present:  # a base-only step (the common one when only image requests use an adapter)
            return
        if len(present) == 1 and all(s == present[0] for s in slots):
            self.segments = [(present[0], None)]
            return
        w = self.model.lm_head.weight
        ids = torch.tensor([-1 if s is None else s for s in slots], device=w.device)
        self.segments = [(slot, (ids == slot)[:, None].to(w.dtype)) for slot in present]

    def apply_to_all(self, slot: int | None) -> None:
        """Every row of every forward uses `slot` (a trainer's single adapter); None = the base alone."""
        self.segments = [] if slot is None else [(slot, None)]
        if slot is not None and not self._on:
            self.attach()
