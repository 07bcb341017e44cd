"""Rank 0 plans, every rank runs: each step's integers travel as one int64 tensor over the gloo CPU group.

Rank 0's `DistModelRunner` broadcasts a `StepMessage` (the step's `StepInputs`, the state slots to reset and to
copy before and after the forward, the chunks needing prompt logits) and then runs the step like any runner; the
other ranks receive it in `follow` and run the same forward and the same LM-head calls, so every collective
inside the model is matched. No pickle: the message is a flat list of ints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

import torch

from kestrel.cache.pool_io import PoolIO
from kestrel.dist import comm
from kestrel.dist.groups import Groups
from kestrel.engine.model_runner import ModelRunner, StepInputs, prompt_logit_chunks
from kestrel.engine.scheduler import SchedulePlan
from kestrel.models.decoder import CausalLM

log = logging.getLogger(__name__)
STOP, RUN = 0, 1
_NESTED = {"pages", "snapshots", "snapshot_slots"}
_LEADERS: list[DistModelRunner] = []  # rank 0's runners whose followers still wait for steps


def release_followers() -> None:
    """Rank 0: send stop to the followers of every runner built in this process (none left if a rank died)."""
    from kestrel.dist.launch import job_failed

    while _LEADERS:
        leader = _LEADERS.pop()
        if not job_failed():
            leader.stop_followers()


@dataclass
class StepMessage:
    inputs: StepInputs
    fresh_slots: list[int] = field(default_factory=list)
    pre_copies: list[tuple[int, int]] = field(default_factory=list)  # prefix-cache state copies since last step
    post_copies: list[tuple[int, int]] = field(default_factory=list)  # decode rows' checkpoints, after the forward
    prompt_chunks: list[int] = field(default_factory=list)

    def encode(self) -> list[int]:
        out = [RUN]
        for f in fields(StepInputs):
            value = getattr(self.inputs, f.name)
            if f.name in _NESTED:
                out += [len(value), *map(len, value)]
                out += [x for row in value for x in row]
            else:
                out += [len(value), *value]
        for pairs in (self.pre_copies, self.post_copies):
            out += [len(pairs), *[x for pair in pairs for x in pair]]
        for flat in (self.fresh_slots, self.prompt_chunks):
            out += [len(flat), *flat]
        return out

    @classmethod
    def decode(cls, data: list[int]) -> StepMessage | None:
        if data[0] == STOP:
            return None
        pos = 1

        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return data[pos - n : pos]

        inputs = StepInputs()
        for f in fields(StepInputs):
            n = take(1)[0]
            if f.name in _NESTED:
                lens = take(n)
                setattr(inputs, f.name, [take(k) for k in lens])
            else:
                setattr(inputs, f.name, take(n))
        pre, post = (list(zip(*[iter(take(2 * take(1)[0]))] * 2)) for _ in range(2))
        fresh, prompt = take(take(1)[0]), take(take(1)[0])
        return cls(inputs, fresh, pre, post, prompt)


def send_message(data: list[int], groups: Groups) -> None:
    comm.broadcast_cpu(torch.tensor([len(data)], dtype=torch.long), groups.world)
    comm.broadcast_cpu(torch.tensor(data, dtype=torch.long), groups.world)


def receive_message(groups: Groups) -> StepMessage | None:
    size = comm.broadcast_cpu(torch.zeros(1, dtype=torch.long), groups.world)
    data = comm.broadcast_cpu(torch.zeros(int(size), dtype=torch.long), groups.world)
    return StepMessage.decode(data.tolist())


class RecordingPoolIO(PoolIO):
    """Rank 0's prefix-cache pool access: state copies are also queued for the other ranks' next step."""

    def __init__(self, runner: DistModelRunner) -> None:
        super().__init__(runner.kv, runner.states, runner.page_size)
        self.runner = runner

    def copy_state(self, src: int, dst: int) -> None:
        super().copy_state(src, dst)
        self.runner.pending_copies.append((src, dst))

    def scatter_pages(self, pages, packed) -> None:
        raise NotImplementedError("HiCache lower tiers are not supported with tensor parallelism")

    scatter_state = scatter_pages


class DistModelRunner(ModelRunner):
    """A `ModelRunner` over this rank's shard; on rank 0 it also broadcasts every step to the other ranks."""

    def __init__(
        self, model: CausalLM, num_pages: int, page_size: int, num_slots: int, kv_dtype: torch.dtype, groups: Groups
    ) -> None:
        self.groups = groups
        if groups.rank == 0:  # the pools' sizes, so that every rank's page and slot ids mean the same rows
            comm.broadcast_cpu(torch.tensor([num_pages, page_size, num_slots]), groups.world)
        super().__init__(model, num_pages, page_size, num_slots, kv_dtype)
        self.pending_copies: list[tuple[int, int]] = []
        if groups.rank == 0:
            _LEADERS.append(self)

    @classmethod
    def follower(cls, model: CausalLM, kv_dtype: torch.dtype, groups: Groups) -> DistModelRunner:
        num_pages, page_size, num_slots = comm.broadcast_cpu(torch.zeros(3, dtype=torch.long), groups.world).tolist()
        return cls(model, num_pages, page_size, num_slots, kv_dtype, groups)

    def pool_io(self) -> PoolIO:
        return RecordingPoolIO(self)

    def prepare(self, plan: SchedulePlan, pad_to: int = 0):
        inputs, copies = self.step_inputs(plan, pad_to)
        msg = StepMessage(inputs, list(plan.fresh_slots), self.pending_copies, copies, prompt_logit_chunks(plan))
        self.pending_copies = []
        send_message(msg.encode(), self.groups)
        return self.apply(msg)

    def apply(self, msg: StepMessage):
        """Replay the state copies, reset fresh slots, build the batch (every rank, same order)."""
        for src, dst in msg.pre_copies:
            self.states.copy(src, dst)
        if self.states is not None and msg.fresh_slots:
            self.states.reset(msg.fresh_slots)
        batch, rows = self.build(msg.inputs)
        return batch, rows, msg.post_copies

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps until it sends stop."""
        while (msg := receive_message(self.groups)) is not None:
            batch, rows, copies = self.apply(msg)
            hidden = self.model(batch)
            for src, dst in copies:
                self.states.copy(src, dst)
            self.model.logits(hidden[rows])
            for i in msg.prompt_chunks:
                self.model.logits(hidden[batch.seq_slice(i)])

    def stop_followers(self) -> None:
        """Rank 0: release the other ranks from `follow`."""
        send_message([STOP], self.groups)
