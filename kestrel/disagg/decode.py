"""The decode role: reserve pages, a state slot and an aux row for a request, tell its prefill rank where they are,
wait for the bytes, then decode it like any other request.

A request's cached prefix (KV pages only: the KDA states come with every request) stays in place, so the prefill
worker writes only the pages of the new suffix. The receiver thread does everything that waits on the network:
the handshake with a prefill rank (cached per bootstrap address, redone when the rank has restarted), the room's
registration, polling the aux rows' status words, the heartbeat, timeouts and cancellations. A transfer that
fails or is given up releases its pages only once nothing can still write to them: the prefill side answered the
cancellation, reported the failure itself, or is gone (its bootstrap server refuses connections).

Thread ownership: the engine thread owns requests, pages and slots (`add`, `poll`, `abort`); the receiver thread
owns peers and the network; a transfer's fields are shared under `_lock`.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import torch

from kestrel.cache.free_list import FreeList
from kestrel.disagg.layout import DraftLayout, PoolLayout, state_tensors
from kestrel.disagg.messages import AuxRow, FirstToken, TransferState, prompt_digest
from kestrel.disagg.role import POLL_WAIT_S, RoleEvents, TransferRecord, advertised_host
from kestrel.disagg.transfer import make_backend
from kestrel.engine.request import Request, RequestStatus
from kestrel.keepalive import CLIENT_KEEPALIVE_S

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HTTP_TIMEOUT_S = 5.0
RANK_QUERY = "prefill_dp_rank={0}&prefill_cp_rank={0}&target_tp_rank={0}&target_pp_rank={0}"


class PeerError(Exception):
    """The prefill side refused (`answered`) or could not be reached; `gone` when nothing listens at its address."""

    def __init__(self, message: str, gone: bool = False, answered: bool = False) -> None:
        super().__init__(message)
        self.gone, self.answered = gone, answered


@dataclass
class PrefillPeer:
    """A prefill rank this worker has connected to."""

    rank_url: str
    instance_id: str


@dataclass(eq=False)
class DecodeTransfer:
    room: int
    req: Request
    addr: str  # the prefill's bootstrap host:port
    aux_index: int
    deadline: float
    started: float
    state: TransferState = TransferState.BOOTSTRAPPING
    registered: bool = False  # the prefill side knows the room (a cancellation must reach it)
    cancel: str = ""  # why the engine gives it up (abort, shutdown)
    error: str = ""
    first: FirstToken | None = None
    done: bool = False


class DecodeRole:
    def __init__(self, config, scheduler, runner, spec) -> None:
        self.scheduler, self.spec = scheduler, spec
        self.page_size = runner.page_size
        self.timeout = config.disaggregation_transfer_timeout
        self.max_running = config.max_running_requests
        host = advertised_host(config.disaggregation_bootstrap_host or "127.0.0.1")
        self.backend = make_backend(config.disaggregation_transfer_backend, host, config.disaggregation_ib_device)
        self.layout = PoolLayout.of(runner.kv, runner.states, runner.page_size)
        self.aux = torch.zeros(config.max_running_requests, AuxRow.WORDS, dtype=torch.int64)
        self._aux_rows = self.aux.numpy()
        self.aux_free = FreeList(config.max_running_requests, "aux row")
        self.backend.register(runner.kv.tensors() + state_tensors(runner.states) + [self.aux])
        self.instance_id = uuid.uuid4().hex
        self.pending: collections.deque[Request] = collections.deque()  # waiting for pages / a slot / an aux row
        self.transfers: dict[int, DecodeTransfer] = {}
        self.peers: dict[str, PrefillPeer] = {}  # receiver thread only
        self._lock = threading.Lock()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._http = httpx.Client(timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE_S))
        self._thread = threading.Thread(target=self._receive_loop, name="kestrel-pd-receiver", daemon=True)
        self._thread.start()

    # -- engine thread -----------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.pending or self.transfers)

    def add(self, req: Request) -> None:
        self.pending.append(req)

    def poll(self, idle: bool) -> RoleEvents:
        """Reserve memory for pending requests (FCFS) and hand requests whose bytes arrived (or whose transfer
        failed) back to the engine. `idle`: nothing else to run, so wait a moment for a transfer to land."""
        events = RoleEvents()
        self._admit()
        try:
            t = self._done.get(timeout=POLL_WAIT_S) if idle and self.transfers else self._done.get_nowait()
            while True:
                self._conclude(t, events)
                t = self._done.get_nowait()
        except queue.Empty:
            pass
        return events

    def abort(self, request_id: str) -> None:
        """Give a request up: a pending one goes at once, a transfer once the prefill side has let go of it."""
        for req in [r for r in self.pending if r.request_id == request_id]:
            self.pending.remove(req)
            req.status, req.finish_reason = RequestStatus.ABORTED, "abort"
        with self._lock:
            for t in self.transfers.values():
                if t.req.request_id == request_id and not t.cancel:
                    t.cancel = "the request was aborted"
                    t.req.status, t.req.finish_reason = RequestStatus.ABORTED, "abort"

    def state(self, room: int) -> TransferState | None:
        with self._lock:
            t = self.transfers.get(room)
            return t.state if t is not None else None

    def stats(self) -> dict[str, int]:
        with self._lock:
            states = [t.state for t in self.transfers.values()]
        return {
            "disagg_pending": len(self.pending),
            "disagg_transfers": len(states),
            "disagg_transferring": sum(s == TransferState.TRANSFERRING for s in states),
        }

    def close(self) -> None:
        """Give every transfer up (the prefill sides are told), then stop the receiver thread."""
        self.pending.clear()
        with self._lock:
            for t in self.transfers.values():
                t.cancel = t.cancel or "the server is shutting down"
        deadline = time.monotonic() + 2 * HTTP_TIMEOUT_S
        while self.transfers and time.monotonic() < deadline:
            self.poll(idle=True)
        self._stopping = True
        self._cmds.put(None)
        self._thread.join(10)
        self._http.close()
        self.backend.close()

    def _admit(self) -> None:
        while self.pending and len(self.scheduler.running) + len(self.transfers) < self.max_running:
            req = self.pending[0]
            aux = self.aux_free.take(1)
            if aux is None:
                return
            if not self.scheduler.reserve_prompt(req):
                self.aux_free.give_back(aux)
                return
            self.pending.popleft()
            self._aux_rows[aux[0]] = 0
            now = time.monotonic()
            t = DecodeTransfer(req.bootstrap.room, req, req.bootstrap.addr, aux[0], now + self.timeout, now)
            if self.spec is not None:
                kv = self.spec.attach_context(req)
                self.backend.register([kv.k, kv.v, kv.valid])
            with self._lock:
                if t.room in self.transfers:
                    t.error = f"bootstrap_room {t.room} is already in use by another request"
                    self._done.put(t)
                    continue
                self.transfers[t.room] = t
            if req.bootstrap.fake or not self.backend.moves_data:
                t.first = FirstToken(top=[] if req.params.logprobs is not None else None)
                t.state = TransferState.SUCCESS
                self._done.put(t)
            else:
                self._cmds.put(t)

    def _conclude(self, t: DecodeTransfer, events: RoleEvents) -> None:
        req = t.req
        with self._lock:
            if self.transfers.get(t.room) is t:
                del self.transfers[t.room]
        self.aux_free.give_back([t.aux_index])
        if req.spec is not None:
            self.backend.unregister([req.spec.kv.k, req.spec.kv.v, req.spec.kv.valid])
        ok = t.state == TransferState.SUCCESS and not t.cancel
        events.transfers.append(
            TransferRecord(
                t.room,
                ok,
                self._received_bytes(req) if ok else 0,
                time.monotonic() - t.started,
                t.error,
                list(req.pages[req.cache_len // self.page_size :]),
                req.slot,
            )
        )
        if ok:
            req.cached_tokens = t.first.cached_tokens
            self.scheduler.join(req)
            events.joined.append((req, t.first))
            return
        if req.status is not RequestStatus.ABORTED:
            req.error = f"KV transfer from the prefill worker failed: {t.error}"
            req.error_status = 502
        self.scheduler.finish(req, "abort", RequestStatus.ABORTED)
        events.finished.append(req)

    def _received_bytes(self, req: Request) -> int:
        pages = len(req.pages) - req.cache_len // self.page_size
        kv = sum(r.row_bytes for r in self.layout.kv) * self.page_size * pages
        return kv + sum(r.row_bytes for r in self.layout.state)

    # -- receiver thread ---------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        active: list[DecodeTransfer] = []
        last_beat = time.monotonic()
        while not self._stopping:
            try:
                cmd = self._cmds.get(timeout=POLL_WAIT_S if active else 0.2)
                while True:
                    if cmd is None:
                        return
                    active.append(cmd)
                    self._register(cmd)
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                pass
            for t in active:
                self._check(t)
            if time.monotonic() - last_beat > HEARTBEAT_S:
                last_beat = time.monotonic()
                self._heartbeat([t for t in active if not t.done])
            active = [t for t in active if not t.done]

    def _register(self, t: DecodeTransfer) -> None:
        """BOOTSTRAPPING → WAITING: find the prefill rank, connect once, register the room's destination."""
        req = t.req
        ps = self.page_size
        body = {
            "instance_id": self.instance_id,
            "room": t.room,
            "prompt_len": len(req.prompt_ids),
            "prompt_digest": prompt_digest(req.prompt_ids),
            "prefix_len": req.cache_len,
            "pages": req.pages[req.cache_len // ps :],
            "slot": req.slot,
            "aux_index": t.aux_index,
            "draft": DraftLayout.of(req.spec.kv).to_json() if req.spec is not None else None,
        }
        for attempt in range(2):
            try:
                peer = self._peer(t.addr)
                self._post(peer.rank_url + "/kestrel/pd/room", body)
                with self._lock:
                    t.registered = True
                    if t.state == TransferState.BOOTSTRAPPING:
                        t.state = TransferState.WAITING
                return
            except PeerError as exc:
                if attempt == 0 and "reconnect" in str(exc):
                    self.peers.pop(t.addr, None)  # the prefill rank restarted: connect anew
                    continue
                if exc.answered or exc.gone or t.addr not in self.peers:
                    self._finish(t, str(exc))  # the prefill side never took the room: nothing can write to it
                else:
                    with self._lock:  # no answer: it may hold the room, so it must let go before the pages do
                        t.registered, t.cancel = True, t.cancel or str(exc)
                return

    def _peer(self, addr: str) -> PrefillPeer:
        peer = self.peers.get(addr)
        if peer is not None:
            return peer
        layout = self._get(f"http://{addr}/route?" + RANK_QUERY.format(-1))
        if int(layout.get("page_size") or 0) != self.page_size:
            raise PeerError(f"prefill page_size {layout.get('page_size')} differs from this worker's {self.page_size}")
        rank = self._get(f"http://{addr}/route?" + RANK_QUERY.format(0))
        if rank.get("signature") != self.layout.signature:
            raise PeerError(
                f"the prefill worker's pools differ from this worker's ({rank.get('signature')} vs "
                f"{self.layout.signature}): same model, --dtype, --kv-cache-dtype and --page-size on both sides"
            )
        rank_url = f"http://{rank['rank_ip']}:{rank['rank_port']}"
        connect = {
            "instance_id": self.instance_id,
            "session_id": self.backend.session_id,
            "layout": self.layout.to_json(),
            "aux": {"addr": self.aux.data_ptr(), "row_bytes": AuxRow.WORDS * 8, "rows": self.aux.shape[0]},
        }
        answer = self._post(rank_url + "/kestrel/pd/connect", connect)
        peer = self.peers[addr] = PrefillPeer(rank_url, answer["instance_id"])
        log.info("connected to prefill rank %s (bootstrap %s, session %s)", rank_url, addr, answer["session_id"])
        return peer

    def _get(self, url: str) -> dict:
        return self._call("GET", url, None)

    def _post(self, url: str, body: dict) -> dict:
        return self._call("POST", url, body)

    def _call(self, method: str, url: str, body: dict | None) -> dict:
        try:
            r = self._http.request(method, url, json=body)
        except httpx.ConnectError as exc:
            raise PeerError(
                f"the prefill worker's bootstrap server at {url.split('/')[2]} is unreachable ({exc})", True
            ) from None
        except httpx.TransportError as exc:
            raise PeerError(f"no answer from the prefill worker at {url.split('/')[2]} ({exc})") from None
        try:
            data = r.json()
        except ValueError:
            data = {"error": r.text[:200]}
        if r.status_code != 200:
            hint = " (reconnect)" if data.get("reconnect") else ""
            raise PeerError(f"prefill worker: {data.get('error', r.status_code)}{hint}", answered=True)
        return data

    def _check(self, t: DecodeTransfer) -> None:
        """Read the room's aux row; act on a cancellation or the deadline."""
        if t.done:
            return
        head = self._aux_rows[t.aux_index, : AuxRow.HEAD].tolist()
        if head[0] == t.room and head[1] in (3, 4, 5):
            status = TransferState(head[1])
            if status == TransferState.TRANSFERRING:
                with self._lock:
                    t.state = TransferState.TRANSFERRING
            elif status in (TransferState.SUCCESS, TransferState.FAILED):
                row = AuxRow.read(self._aux_rows[t.aux_index])
                if status == TransferState.SUCCESS:
                    t.first = row.first
                    self._finish(t, "", TransferState.SUCCESS)
                else:
                    self._finish(t, f"the prefill worker failed the request: {row.error}")
                return
        with self._lock:
            cancel = t.cancel
        if not cancel and time.monotonic() > t.deadline:
            cancel = f"timed out after {self.timeout:g} s waiting for the KV from the prefill worker at {t.addr}"
        if cancel:
            self._cancel(t, cancel)

    def _cancel(self, t: DecodeTransfer, why: str) -> None:
        """Free the transfer only once the prefill side cannot write any more: it acknowledged, or it is gone.
        No answer at all (a hung prefill worker): keep trying at every check."""
        if t.registered:
            try:
                self._post(
                    self.peers[t.addr].rank_url + "/kestrel/pd/abort", {"instance_id": self.instance_id, "room": t.room}
                )
            except PeerError as exc:
                if not exc.gone:
                    log.warning("room %d: cancellation not acknowledged yet: %s", t.room, exc)
                    return
            except KeyError:
                pass
        self._finish(t, why)

    def _heartbeat(self, transfers: list[DecodeTransfer]) -> None:
        """A prefill worker whose bootstrap server refuses connections is gone: its rooms fail now."""
        for addr in {t.addr for t in transfers if t.registered}:
            try:
                self._http.get(f"http://{addr}/health", timeout=HTTP_TIMEOUT_S)
            except httpx.ConnectError:
                self.peers.pop(addr, None)
                for t in transfers:
                    if t.addr == addr and not t.done:
                        mid = " mid-transfer" if t.state == TransferState.TRANSFERRING else ""
                        self._finish(t, f"the prefill worker at {addr} stopped answering{mid} (killed?)")
            except httpx.TransportError:
                pass  # slow, not gone: the transfer timeout decides

    def _finish(self, t: DecodeTransfer, error: str, state: TransferState = TransferState.FAILED) -> None:
        with self._lock:
            t.state, t.error, t.done = state, error, True
        if error:
            log.warning("room %d failed: %s", t.room, error)
        self._done.put(t)
