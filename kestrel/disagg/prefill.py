"""The prefill role: run the prompt, then write the request's KV pages, KDA state, draft context and first token into
the decode worker's pools, and only then let the request go.

A room pairs the two halves of a request: the prefill request (from the router) and the destination (from the
decode worker, through the bootstrap server), in either order. Once the first token is sampled the request leaves
the running batch holding its pages and slot (`Scheduler.hold`); when both halves are there the sender thread
writes, and the engine thread finishes the request (pages to the prefix cache) when the write is done. Rooms
that wait longer than the transfer timeout fail; a decode worker that is gone (write failed, probe failed) takes
all of its rooms with it, so a restarted one starts over with a new handshake.

Thread ownership: the engine thread owns requests and the scheduler; the bootstrap server's threads and the sender
thread touch rooms only under `_lock` (the sender also holds the room's own lock while it writes, so an abort from
the decode side returns only once no byte can land any more).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel.disagg.bootstrap import BootstrapServer
from kestrel.disagg.layout import DraftLayout, PoolLayout, Range, Region, state_tensors
from kestrel.disagg.messages import AbortMsg, AuxRow, ConnectMsg, FirstToken, RoomMsg, TransferState, prompt_digest
from kestrel.disagg.role import POLL_WAIT_S, RoleEvents, TransferRecord, advertised_host
from kestrel.disagg.transfer import TransferError, make_backend
from kestrel.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)

DROPPED_MEMORY_S = 600.0  # how long a room the decode side gave up on stays refused


@dataclass
class DecodeInstance:
    """A decode worker process as it introduced itself (a restarted one is a new instance)."""

    instance_id: str
    session_id: str
    layout: PoolLayout
    aux: Region


@dataclass(eq=False)
class PrefillRoom:
    room: int
    deadline: float
    req: Request | None = None
    dest: RoomMsg | None = None
    instance: DecodeInstance | None = None
    first: FirstToken | None = None  # set at hand-off: the request holds its pages until it is sent
    state: TransferState = TransferState.BOOTSTRAPPING
    error: str = ""
    notify: bool = False  # the decode side should hear about the failure
    # Held while anything is written to the decode side for this room (reentrant: a failed send notifies inside it).
    lock: threading.RLock = field(default_factory=threading.RLock)


class PrefillRole:
    def __init__(self, config, scheduler, runner, spec) -> None:
        self.scheduler = scheduler  # `spec`: the draft context travels with req.spec, nothing to keep here
        self.timeout = config.disaggregation_transfer_timeout
        self.page_size = runner.page_size
        host = advertised_host(config.disaggregation_bootstrap_host or "127.0.0.1")
        self.backend = make_backend(config.disaggregation_transfer_backend, host, config.disaggregation_ib_device)
        self.layout = PoolLayout.of(runner.kv, runner.states, runner.page_size)
        # Two staging rows for the aux writes (payload, then room + status); the sender uses them one write at a time.
        self.staging = torch.zeros(2, AuxRow.WORDS, dtype=torch.int64)
        self.backend.register(runner.kv.tensors() + state_tensors(runner.states) + [self.staging])
        self.instance_id = uuid.uuid4().hex
        self.rooms: dict[int, PrefillRoom] = {}
        self.instances: dict[str, DecodeInstance] = {}
        self.dropped: dict[int, tuple[str, float]] = {}  # room -> (why, until): the decode side gave up on it
        self.held: set[Request] = set()  # first token sampled, pages and slot kept until the KV is delivered
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        handlers = {"/kestrel/pd/connect": self._on_connect, "/kestrel/pd/room": self._on_room}
        handlers["/kestrel/pd/abort"] = self._on_abort
        bind = config.disaggregation_bootstrap_host or "127.0.0.1"
        self.server = BootstrapServer(bind, config.disaggregation_bootstrap_port, handlers)
        self.bootstrap_port = self.server.port
        self.server.put_rank(self._rank_info(host, config))
        self.server.start()
        self._sender = threading.Thread(target=self._send_loop, name="kestrel-pd-sender", daemon=True)
        self._sender.start()
        log.info(
            "prefill role: bootstrap server on %s:%d, transfer session %s",
            bind,
            self.bootstrap_port,
            self.backend.session_id,
        )

    def _rank_info(self, host: str, config) -> dict:
        """This rank's PUT /route body (SGLang's fields) plus what a decode worker needs to write to us."""
        one = {f"{k}_size": 1 for k in ("attn_tp", "attn_cp", "attn_dp", "pp", "system_dp")}
        zero = {f"{k}_rank": 0 for k in ("attn_tp", "attn_cp", "attn_dp", "pp", "system_dp")}
        return (
            one
            | zero
            | {
                "rank_ip": host,
                "rank_port": self.bootstrap_port,
                "page_size": self.page_size,
                "kv_cache_dtype": config.kv_cache_dtype,
                "session_id": self.backend.session_id,
                "instance_id": self.instance_id,
                "layout": self.layout.to_json(),
                "signature": self.layout.signature,
            }
        )

    # -- engine thread -----------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Requests held for sending, or rooms whose request is still in the engine."""
        with self._lock:
            return bool(self.held) or any(r.req is not None for r in self.rooms.values())

    def add(self, req: Request) -> None:
        """A prefill request arrived: pair it with its room (its destination may already be there)."""
        target = req.bootstrap
        if target.fake or not self.backend.moves_data:
            self.scheduler.add(req)
            return
        with self._lock:
            why = self._refused(target.room)
            if why:
                raise ValueError(f"bootstrap_room: {target.room} {why}")
            room = self.rooms.get(target.room)
            if room is not None and room.req is not None:
                raise ValueError(f"bootstrap_room: {target.room} is already in use by another request")
            if room is None:
                room = self.rooms[target.room] = PrefillRoom(target.room, time.monotonic() + self.timeout)
            room.req = req
            if room.dest is not None:
                self._check_dest(room)
        self.scheduler.add(req)

    def hand_off(self, req: Request, first: FirstToken) -> None:
        """The first token is sampled: stop computing, keep the pages and slot, send when the destination is there."""
        self.scheduler.hold(req)
        self.held.add(req)
        first.cached_tokens = req.cached_tokens
        if req.bootstrap.fake or not self.backend.moves_data:  # warm-up: nothing to send, nobody waiting
            self._done.put((None, req, TransferRecord(req.bootstrap.room, True)))
            return
        with self._lock:
            room = self.rooms[req.bootstrap.room]
            room.first = first
            room.deadline = time.monotonic() + self.timeout  # the wait for a destination starts now
            self._maybe_send(room)

    def poll(self, idle: bool) -> RoleEvents:
        """Finish sent and failed rooms; fail rooms past their deadline. `idle`: nothing else to run, so wait a
        moment for a transfer to end rather than spin."""
        events = RoleEvents()
        now = time.monotonic()
        with self._lock:
            for room in list(self.rooms.values()):
                if room.error and room.state != TransferState.TRANSFERRING:
                    self._close(room, events)
                elif room.req is not None and room.req.is_finished and room.first is None:
                    # Refused or aborted before its first token: the decode side hears it, the room goes.
                    self._fail(room, room.req.error or "the prefill request was aborted")
                    self._close(room, events)
                elif now > room.deadline and room.state != TransferState.TRANSFERRING:
                    half = "destination from a decode worker" if room.dest is None else "prefill request"
                    self._fail(room, f"timed out after {self.timeout:g} s waiting for the {half}")
                    self._close(room, events)
            for r, (_, until) in list(self.dropped.items()):
                if now > until:
                    del self.dropped[r]
        try:
            item = self._done.get(timeout=POLL_WAIT_S) if idle else self._done.get_nowait()
            while True:
                self._finish_sent(*item, events)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        return events

    def abort(self, request_id: str) -> None:
        """The prefill request was aborted (client gone, shutdown): fail its room; if a write is under way the
        room fails when it ends."""
        with self._lock:
            for room in self.rooms.values():
                if room.req is not None and room.req.request_id == request_id:
                    self._fail(room, "the prefill request was aborted")
                    if room.first is not None and room.req.status is not RequestStatus.ABORTED:
                        room.req.status, room.req.finish_reason = RequestStatus.ABORTED, "abort"

    def stats(self) -> dict[str, int]:
        with self._lock:
            states = [r.state for r in self.rooms.values()]
            return {
                "disagg_rooms": len(states),
                "disagg_transferring": sum(s == TransferState.TRANSFERRING for s in states),
                "disagg_decode_instances": len(self.instances),
            }

    def state(self, room: int) -> TransferState | None:
        with self._lock:
            r = self.rooms.get(room)
            return r.state if r is not None else None

    def close(self) -> None:
        self._jobs.put(None)
        self._sender.join(10)
        self.server.stop()
        self.backend.close()

    def _finish_sent(self, room: PrefillRoom | None, req: Request, record: TransferRecord, events: RoleEvents) -> None:
        events.transfers.append(record)
        self.held.discard(req)
        if record.ok and req.status is not RequestStatus.ABORTED:
            self.scheduler.finish(req, "length")
        else:
            self._set_error(req, record.error)
            self.scheduler.finish(req, "abort", RequestStatus.ABORTED)
        events.finished.append(req)
        if room is not None:
            with self._lock:
                room.state = TransferState.SUCCESS if record.ok else TransferState.FAILED
                self.rooms.pop(room.room, None)

    @staticmethod
    def _set_error(req: Request, why: str) -> None:
        if req.error is None:  # a refusal of the request itself keeps its own message and 400
            req.error, req.error_status = f"KV transfer to the decode worker failed: {why}", 502

    # -- under _lock -------------------------------------------------------------------------------------
    def _refused(self, room: int) -> str:
        entry = self.dropped.get(room)
        return f"was given up by the decode worker ({entry[0]})" if entry else ""

    def _maybe_send(self, room: PrefillRoom) -> None:
        if (
            room.first is not None
            and room.dest is not None
            and not room.error
            and room.state < TransferState.TRANSFERRING
        ):
            room.state = TransferState.TRANSFERRING
            self._jobs.put(room)

    def _check_dest(self, room: PrefillRoom) -> None:
        """The decode side's view of the prompt must be ours; a mismatch fails the room (both sides hear why)."""
        req, dest = room.req, room.dest
        ps, n = self.page_size, len(req.prompt_ids)
        if dest.prompt_len != n or dest.prompt_digest != prompt_digest(req.prompt_ids):
            self._fail(room, f"the decode worker's prompt ({dest.prompt_len} tokens) is not this prompt ({n} tokens)")
        elif len(dest.pages) != -(-n // ps) - dest.prefix_len // ps:
            self._fail(room, f"{len(dest.pages)} destination pages for prompt tokens [{dest.prefix_len}, {n})")

    def _fail(self, room: PrefillRoom, why: str) -> None:
        if not room.error:
            room.error, room.notify = why, room.dest is not None
            log.warning("room %d failed: %s", room.room, why)

    def _close(self, room: PrefillRoom, events: RoleEvents) -> None:
        """Leave a failed room: tell the decode side (sender thread), release the request (engine thread)."""
        self.rooms.pop(room.room, None)
        room.state = TransferState.FAILED
        if room.notify:
            self._jobs.put(room)
        events.transfers.append(TransferRecord(room.room, False, error=room.error))
        req = room.req
        # A held request (first token sampled) or one still queued/running is released here; one the scheduler or
        # the engine already finished (refused, aborted before its first token) has nothing left to free.
        if req is not None and (room.first is not None or not req.is_finished):
            self._set_error(req, room.error)
            self.held.discard(req)
            self.scheduler.finish(req, "abort", RequestStatus.ABORTED)
            events.finished.append(req)

    def _drop_instance(self, instance: DecodeInstance, why: str) -> None:
        if self.instances.pop(instance.instance_id, None) is None:
            return
        log.warning("decode instance %s (%s) dropped: %s", instance.instance_id[:8], instance.session_id, why)
        for room in list(self.rooms.values()):
            if room.instance is instance:
                if room.req is None:
                    del self.rooms[room.room]
                    continue
                self._fail(room, why)
                room.notify = False

    # -- bootstrap server threads ------------------------------------------------------------------------
    def _on_connect(self, body: dict) -> tuple[int, dict]:
        msg = ConnectMsg.model_validate(body)
        layout = PoolLayout.from_json(msg.layout.model_dump())
        if layout.signature != self.layout.signature:
            mine, theirs = self.layout.signature, layout.signature
            return 409, {"error": f"the decode worker's pools differ from the prefill worker's: {theirs} vs {mine}"}
        instance = DecodeInstance(msg.instance_id, msg.session_id, layout, Region(**msg.aux.model_dump()))
        with self._lock:
            others = [i for i in self.instances.values() if i.instance_id != msg.instance_id]
            self.instances[msg.instance_id] = instance
        # A restarted decode worker connects anew: instances that no longer answer, and their rooms, go now.
        for other in others:
            if not self.backend.alive(other.session_id):
                with self._lock:
                    self._drop_instance(other, f"decode worker {other.session_id} stopped answering")
        return 200, {"instance_id": self.instance_id, "session_id": self.backend.session_id}

    def _on_room(self, body: dict) -> tuple[int, dict]:
        msg = RoomMsg.model_validate(body)
        with self._lock:
            instance = self.instances.get(msg.instance_id)
            if instance is None:
                return 404, {"error": "unknown decode instance: connect first", "reconnect": True}
            why = self._refused(msg.room)
            if why:
                return 410, {"error": f"room {msg.room} {why}"}
            bad = self._bad_dest(msg, instance)
            if bad:
                return 400, {"error": bad}
            room = self.rooms.get(msg.room)
            if room is not None and room.dest is not None:
                return 409, {"error": f"room {msg.room} already has a destination"}
            if room is None:
                room = self.rooms[msg.room] = PrefillRoom(msg.room, time.monotonic() + self.timeout)
            room.dest, room.instance = msg, instance
            if room.state == TransferState.BOOTSTRAPPING:
                room.state = TransferState.WAITING
            if room.req is not None:
                self._check_dest(room)
                if room.error:
                    room.notify = False  # the decode side reads this answer and frees the room's memory at once
                    return 400, {"error": room.error}
            self._maybe_send(room)
        return 200, {}

    def _bad_dest(self, msg: RoomMsg, instance: DecodeInstance) -> str:
        ps = self.page_size
        if msg.prefix_len % ps or msg.prefix_len >= msg.prompt_len:
            return f"prefix_len {msg.prefix_len}: must be a multiple of {ps} below prompt_len {msg.prompt_len}"
        if (msg.slot is None) != (not self.layout.state):
            return "slot: a KDA state slot is needed exactly when the model has KDA layers"
        if msg.aux_index >= instance.aux.rows:
            return f"aux_index {msg.aux_index}: the decode worker registered {instance.aux.rows} aux rows"
        return ""

    def _on_abort(self, body: dict) -> tuple[int, dict]:
        """The decode side gives a room up; the answer means nothing more will be written for it."""
        msg = AbortMsg.model_validate(body)
        with self._lock:
            room = self.rooms.get(msg.room)
            self.dropped[msg.room] = ("aborted", time.monotonic() + DROPPED_MEMORY_S)
            if room is None:
                return 200, {"dropped": False}
            if room.dest is not None and room.dest.instance_id != msg.instance_id:
                return 409, {"error": f"room {msg.room} belongs to another decode instance"}
            if room.req is None:  # only the destination was here: nothing of the engine's to release
                del self.rooms[msg.room]
            else:
                self._fail(room, "the decode worker gave the request up")
            room.notify = False
        with room.lock:  # a write under way ends before the decode side frees the memory it writes to
            pass
        return 200, {"dropped": True}

    # -- sender thread -----------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            try:
                room = self._jobs.get(timeout=1.0)
            except queue.Empty:
                self._sweep()
                continue
            if room is None:
                return
            if room.state == TransferState.FAILED:
                self._notify_failure(room)
                continue
            with room.lock:
                record = self._send(room)
            if not record.ok:
                with self._lock:
                    self._fail(room, record.error)
                    room.notify = False
            self._done.put((room, room.req, record))

    def _send(self, room: PrefillRoom) -> TransferRecord:
        req, dest, inst = room.req, room.dest, room.instance
        ps = self.page_size
        src_pages = req.pages[dest.prefix_len // ps : -(-len(req.prompt_ids) // ps)]
        record = TransferRecord(room.room, False, pages=list(src_pages), slot=req.slot)
        with self._lock:
            failed, notify = room.error, room.notify
        if failed:  # failed while queued: nothing was written; the decode side hears it unless it gave up
            record.error = failed
            if notify:
                self._notify_failure(room)
            return record
        draft = None
        ranges: list[Range] = self.layout.page_ranges(inst.layout, src_pages, dest.pages)
        if dest.slot is not None:
            ranges += self.layout.slot_ranges(inst.layout, req.slot, dest.slot)
        if dest.draft is not None and req.spec is not None:
            draft = req.spec.kv
            self.backend.register([draft.k, draft.v, draft.valid])
            ranges += DraftLayout.of(draft).ranges(
                DraftLayout.from_json(dest.draft.model_dump()), self._draft_positions(req)
            )
        start = time.perf_counter()
        try:
            self._write_head(room, TransferState.TRANSFERRING)
            payload = AuxRow(room.first).payload()
            ranges.append(self._stage(0, payload, inst.aux.row(dest.aux_index) + AuxRow.HEAD * 8))
            record.nbytes = self.backend.write(inst.session_id, ranges)
            with self._lock:
                failed = room.error
            self._write_head(room, TransferState.FAILED if failed else TransferState.SUCCESS)
            record.ok, record.error = not failed, failed
        except TransferError as exc:
            record.error = f"{exc}; the decode worker may be gone"
            if not self.backend.alive(inst.session_id):
                with self._lock:
                    self._drop_instance(inst, f"decode worker {inst.session_id} is gone")
        finally:
            if draft is not None:
                self.backend.unregister([draft.k, draft.v, draft.valid])
        record.seconds = time.perf_counter() - start
        return record

    def _sweep(self) -> None:
        """Destinations whose prefill request never came expire here too, even while the engine idles."""
        now = time.monotonic()
        with self._lock:
            for room in list(self.rooms.values()):
                if room.req is None and now > room.deadline:
                    del self.rooms[room.room]

    def _draft_positions(self, req: Request) -> list[int]:
        """Positions of the prompt whose draft context the prefill computed and its ring still holds."""
        kv, n = req.spec.kv, len(req.prompt_ids)
        valid = kv.valid.tolist()
        return [p for p in range(max(0, n - kv.capacity), n) if valid[p % kv.capacity]]

    def _stage(self, row: int, words: np.ndarray, dst: int) -> Range:
        view = self.staging[row].numpy()
        view[: len(words)] = words
        return (self.staging[row].data_ptr(), dst, len(words) * 8)

    def _write_head(self, room: PrefillRoom, state: TransferState) -> None:
        dst = room.instance.aux.row(room.dest.aux_index)
        self.backend.write(room.instance.session_id, [self._stage(1, np.array([room.room, int(state)]), dst)])

    def _notify_failure(self, room: PrefillRoom) -> None:
        """Best effort: the decode side reads FAILED and the reason instead of waiting for its timeout."""
        if room.dest is None or room.instance is None or not self.backend.moves_data:
            return
        with room.lock:  # an abort from the decode side waits for this write, or this write sees the abort
            with self._lock:
                if not room.notify:
                    return
            self._write_failure(room)

    def _write_failure(self, room: PrefillRoom) -> None:
        try:
            payload = AuxRow(room.first or FirstToken(), room.error).payload()
            dst = room.instance.aux.row(room.dest.aux_index) + AuxRow.HEAD * 8
            self.backend.write(room.instance.session_id, [self._stage(0, payload, dst)])
            self._write_head(room, TransferState.FAILED)
        except TransferError:
            pass
