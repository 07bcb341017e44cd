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
from kestrel.cache.state_pool import StateStorage
from kestrel.dist import comm
from kestrel.dist.dcp_cache import dcp_view
from kestrel.dist.groups import Groups
from kestrel.dist.dp_attention import DPStep, gather_rows, set_dp_step
from kestrel.dist.launch import fail_job
from kestrel.dist.pp import run_step
from kestrel.engine.model_runner import ModelRunner, StepInputs, StepLogits, prompt_logit_chunks
from kestrel.engine.scheduler import SchedulePlan
from kestrel.models.decoder import CausalLM
from kestrel.models.forward_batch import ForwardBatch

log = logging.getLogger(__name__)
STOP, RUN = 0, 1
_NESTED = {"pages", "snapshots", "snapshot_slots"}
_LEADERS: list[DistModelRunner] = []  # rank 0's runners whose followers still wait for steps


def unsupported_layout(layout) -> str:
    """Why a per-request option is refused under this layout (attention DP, pipeline or prefill context parallel)."""
    names = [f"{flag} > 1" for flag, n in (("--dp-attn", layout.dp_attn), ("--pp", layout.pp), ("--pcp", layout.pcp)) if n > 1]
    return f"not supported with {' or '.join(names)} yet"


def release_followers() -> None:
    """Rank 0: send stop to the followers of every runner built in this process (none left if a rank died)."""
    from kestrel.dist.launch import job_failed

    while _LEADERS:
        leader = _LEADERS.pop()
        if not job_failed():
            leader.stop_followers()


@dataclass
class StepMessage:
    """One attention group's step: its inputs and the state-slot work around the forward."""

    inputs: StepInputs
    fresh_slots: list[int] = field(default_factory=list)
    pre_copies: list[tuple[int, int]] = field(default_factory=list)  # prefix-cache state copies since last step
    post_copies: list[tuple[int, int]] = field(default_factory=list)  # decode rows' checkpoints, after the forward
    prompt_chunks: list[int] = field(default_factory=list)
    real_rows: int = 0  # token rows that are not padding (an idle attention-DP group runs one padding row)

    def encode(self) -> list[int]:
        out = [self.real_rows]
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
    def decode(cls, data: list[int], pos: int) -> tuple[StepMessage, int]:
        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return data[pos - n : pos]

        real = take(1)[0]
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
        return cls(inputs, fresh, pre, post, prompt, real), pos


def send_step(messages: list[StepMessage], groups: Groups) -> None:
    data = [RUN, len(messages)] + [x for m in messages for x in m.encode()]
    comm.broadcast_cpu(torch.tensor([len(data)], dtype=torch.long), groups.world)
    comm.broadcast_cpu(torch.tensor(data, dtype=torch.long), groups.world)


def send_stop(groups: Groups) -> None:
    comm.broadcast_cpu(torch.tensor([1], dtype=torch.long), groups.world)
    comm.broadcast_cpu(torch.tensor([STOP], dtype=torch.long), groups.world)


def receive_step(groups: Groups) -> list[StepMessage] | None:
    """Every attention group's message of the next step (None: stop)."""
    size = comm.broadcast_cpu(torch.zeros(1, dtype=torch.long), groups.world)
    data = comm.broadcast_cpu(torch.zeros(int(size), dtype=torch.long), groups.world).tolist()
    if data[0] == STOP:
        return None
    messages, pos = [], 2
    for _ in range(data[1]):
        msg, pos = StepMessage.decode(data, pos)
        messages.append(msg)
    return messages


class RecordingPoolIO(PoolIO):
    """Rank 0's prefix-cache access to one attention group's pools: state copies are queued for that group's
    ranks' next step (and made here at once when rank 0 is one of them)."""

    def __init__(self, runner: DistModelRunner, group: int) -> None:
        super().__init__(runner.kv, runner.states, runner.page_size, runner.records)
        self.runner, self.group = runner, group

    def copy_state(self, src: int, dst: int) -> None:
        if self.group == self.runner.groups.dp_index:
            super().copy_state(src, dst)
        self.runner.pending[self.group].append((src, dst))

    def scatter_pages(self, pages, packed) -> None:
        raise NotImplementedError("HiCache lower tiers are not supported with tensor parallelism")

    scatter_state = scatter_pages


class DistModelRunner(ModelRunner):
    """A `ModelRunner` over this rank's shard; on rank 0 it also broadcasts every step to the other ranks."""

    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        num_slots: int,
        kv_dtype: torch.dtype,
        groups: Groups,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.groups = groups
        if groups.rank == 0:  # the pools' sizes, so that every rank's page and slot ids mean the same rows
            comm.broadcast_cpu(torch.tensor([num_pages, page_size, num_slots]), groups.world)
        super().__init__(model, num_pages, page_size, num_slots, kv_dtype, kv_cache_dtype=kv_cache_dtype)
        if self.states is None:  # a pipeline stage without KDA layers: the scheduler's state copies are no-ops here
            self.states = StateStorage(model.cfg, num_slots + 1, model.dtype, model.device)
        self.pending: list[list[tuple[int, int]]] = [[] for _ in range(groups.layout.dp_attn)]
        self.idle_group_steps = 0  # steps in which some attention-DP group had nothing to run
        if groups.rank == 0:
            _LEADERS.append(self)

    @classmethod
    def follower(
        cls, model: CausalLM, kv_dtype: torch.dtype, groups: Groups, kv_cache_dtype: str = "auto"
    ) -> DistModelRunner:
        num_pages, page_size, num_slots = comm.broadcast_cpu(torch.zeros(3, dtype=torch.long), groups.world).tolist()
        return cls(model, num_pages, page_size, num_slots, kv_dtype, groups, kv_cache_dtype)

    def kv_rows_per_page(self, page_size: int) -> int:
        return page_size // self.groups.dcp.size

    @property
    def staged(self) -> bool:
        """Pipeline stages or prefill context parallelism: steps run through `kestrel.dist.pp.run_step`."""
        return self.groups.layout.pp > 1 or self.groups.layout.pcp > 1

    def build(self, inputs, decode_rows: int | None = None):
        """The batch over this rank's pools; under DCP its cache view keeps only this rank's tokens."""
        batch, rows = super().build(inputs, decode_rows)
        batch.cache = dcp_view(batch.cache, batch.positions, self.page_size, self.groups.dcp, self.groups.layout)
        return batch, rows

    def pool_io(self, group: int = 0) -> PoolIO:
        return RecordingPoolIO(self, group)

    def _message(self, plan: SchedulePlan, group: int) -> StepMessage:
        inputs, copies = self.step_inputs(plan)
        real = len(inputs.ids)
        if not plan.chunks:  # an idle attention-DP group: one padding row, so that its collectives still run
            inputs.add([0], 0, [self.scratch_page], self.scratch_slot, 0, [], [])
            self.idle_group_steps += 1
        msg = StepMessage(inputs, list(plan.fresh_slots), self.pending[group], copies, prompt_logit_chunks(plan), real)
        self.pending[group] = []
        return msg

    def prepare(self, plan: SchedulePlan, pad_to: int = 0):
        """Rank 0, one attention group: broadcast the step, then build the batch like every rank."""
        msg = self._message(plan, 0)
        send_step([msg], self.groups)
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
    def execute(self, plan: SchedulePlan) -> tuple[StepLogits, ForwardBatch]:
        group_plans = getattr(plan, "group_plans", None)
        if group_plans is not None and prompt_logit_chunks(plan):
            raise ValueError(f"prompt_logprobs: {unsupported_layout(self.groups.layout)}")
        try:
            return self._execute(plan, group_plans)
        except Exception as exc:  # once the step is broadcast, the other ranks wait in collectives: no going on
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            fail_job(f"step failed on rank 0 ({reason})")
            raise

    def _execute(self, plan: SchedulePlan, group_plans) -> tuple[StepLogits, ForwardBatch]:
        if group_plans is None and self.staged:
            msg = self._message(plan, 0)
            send_step([msg], self.groups)
            return run_step(self, msg)
        if group_plans is None:
            return super().execute(plan)
        messages = [self._message(p, g) for g, p in enumerate(group_plans)]
        send_step(messages, self.groups)
        sample, batch = self._run_dp(messages)
        return StepLogits(sample, {}), batch

    def _run_dp(self, messages: list[StepMessage]) -> tuple[torch.Tensor, ForwardBatch]:
        """This rank's group's forward (the MLPs see every group's rows); then the LM head over every group's
        sampled rows, in group order."""
        g = self.groups.dp_index
        set_dp_step(DPStep([m.real_rows for m in messages], g))
        try:
            batch, rows, copies = self.apply(messages[g])
            hidden = self.model(batch)
            for src, dst in copies:
                self.states.copy(src, dst)
            counts = DPStep([len(m.inputs.sample_rows) for m in messages], g)
            return self.model.logits(gather_rows(hidden[rows], counts, self.groups.attn_dp)), batch
        finally:
            set_dp_step(None)

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks > 0: run rank 0's steps until it sends stop."""
        while (messages := receive_step(self.groups)) is not None:
            if self.staged:
                run_step(self, messages[0])
                continue
            if len(messages) > 1:
                self._run_dp(messages)
                continue
            batch, rows, copies = self.apply(messages[0])
            hidden = self.model(batch)
            for src, dst in copies:
                self.states.copy(src, dst)
            self.model.logits(hidden[rows])
            for i in messages[0].prompt_chunks:
                self.model.logits(hidden[batch.seq_slice(i)])

    def stop_followers(self) -> None:
        """Rank 0: release the other ranks from `follow`."""
        send_stop(self.groups)
