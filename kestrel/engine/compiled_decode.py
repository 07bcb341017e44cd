"""The compiled decode step (`--compile`): the MegaKernel analogue of the seeds, within reach of PyTorch.

A decode step of a small model is bound by op launches. `torch.compile` turns the whole decoder forward of a pure
decode batch into one graph: on CPU inductor fuses each layer's elementwise chains into C++ loops; on CUDA the graph
is also captured as a CUDA graph (mode "reduce-overhead"). Batches are padded to a fixed set of batch-size buckets
(padding rows read and write only the runner's scratch page and state slot), so each bucket compiles once, at
start-up; the history length stays a dynamic dimension. Steps that are not pure decode, or larger than the biggest
bucket, run eagerly, and both give the same tokens.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from kestrel.models.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from kestrel.engine.model_runner import ModelRunner
    from kestrel.engine.scheduler import SchedulePlan

log = logging.getLogger(__name__)
# CUDA graphs replay fixed shapes: histories are padded to a multiple of this many tokens there.
CUDA_GRAPH_WIDTH_MULTIPLE = 256


def batch_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_bs (SGLang's capture sizes, shortened)."""
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    return sizes if sizes[-1] == max_bs else [*sizes, max_bs]


class CompiledDecode:
    """Owns the compiled forward and its buckets; `__call__` runs a padded pure-decode batch through it."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_bs)
        self.cuda_graphs = runner.device.type == "cuda"
        # Up to two graphs per bucket (see warm_up_widths) and a spare each for shapes dynamo specialises, such as a
        # one-token history.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 3 * len(self.buckets))
        mode = "reduce-overhead" if self.cuda_graphs else None
        self._forward = torch.compile(runner.model, mode=mode)

    def bucket_for(self, plan: SchedulePlan) -> int:
        """The bucket this plan runs in, or 0 when it must run eagerly (prefill rows, or too many rows)."""
        n = len(plan.chunks)
        if n > self.buckets[-1] or any(c.num_tokens != 1 for c in plan.chunks):
            return 0
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        slots = batch.cache.decode_slots
        if self.cuda_graphs:
            width = -(-slots.shape[1] // CUDA_GRAPH_WIDTH_MULTIPLE) * CUDA_GRAPH_WIDTH_MULTIPLE
            slots = torch.nn.functional.pad(slots, (0, width - slots.shape[1]), value=slots[0, 0].item())
            batch.cache.decode_slots = slots
        else:
            # Contiguous always: the [rows, history] slice of the page-slot table is contiguous only when the longest
            # history fills its last page, and dynamo guards on that stride (a second graph, compiled mid-serving).
            slots = batch.cache.decode_slots = slots.contiguous()
            torch._dynamo.maybe_mark_dynamic(slots, 1)  # one graph for every history length
        return self._forward(batch)

    def warm_up_widths(self) -> list[int]:
        """History lengths to compile each bucket at: one graph covers every length except where the graph itself
        branches on it, which is DSA's top-min(k, L) (a short history reads all of itself, a long one k positions)."""
        cfg = self.runner.model.cfg
        dsa = cfg.index_topk > 0 and "dsa" in cfg.layer_kinds
        return [2, cfg.index_topk + 1] if dsa and cfg.index_topk + 1 > 2 else [2]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every bucket (at every history width its graph branches on) now, so no request waits for a
        compilation mid-serving."""
        from kestrel.engine.model_runner import StepInputs

        runner = self.runner
        start = time.perf_counter()
        shapes = [(bs, width) for bs in self.buckets for width in self.warm_up_widths()]
        for bs, width in tqdm(shapes, desc="compiling decode step", unit="graph"):
            inputs = StepInputs()
            pages = [runner.scratch_page] * (-(-width // runner.page_size))
            for _ in range(bs):
                inputs.add([0], width - 1, pages, runner.scratch_slot, True, [], [])
            batch, _ = runner.build(inputs)
            self(batch)
        log.info("compiled the decode step for batch sizes %s in %.1f s", self.buckets, time.perf_counter() - start)
