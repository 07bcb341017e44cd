"""The engine in a thread of its own, reached from asyncio.

The `Engine` is not thread-safe, so only the engine thread touches it. The event loop talks to it through two
one-way channels: an inbox (`queue.SimpleQueue`) of add/abort commands that the thread drains between steps, and
one `asyncio.Queue` per HTTP request that the thread fills with `loop.call_soon_threadsafe` (once per step for all
requests together, so a step wakes the loop once). Every delta is computed on the engine thread from the requests'
growing `output_ids` / `output_text`, so the loop only ever sees immutable snapshots.

Weight syncs (SGLang's pause / update / continue) are commands too, run between steps. While paused, no step runs
and new requests queue. A weight update never lands under a started request: with generation running it waits for
the started requests to finish (new ones are held back meanwhile); paused, it first retracts those paused in place.
A retracted request reruns from its prompt; its stream gets `reset` and starts over (an OpenAI stream, which
cannot take back text it sent, is aborted instead).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kestrel.disagg.role import BootstrapTarget
from kestrel.engine.engine import Engine
from kestrel.engine.grammar import GrammarBackend
from kestrel.engine.outputs import RequestOutput, request_output
from kestrel.engine.request import Request
from kestrel.engine.sampling_params import SamplingParams
from kestrel.models.loader import check_checkpoint
from kestrel.server.engine_events import EngineStopped, NeverFits, QueueFull, RequestStream, SeqDelta, StreamEvent
from kestrel.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class _Add:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams
    deltas: bool
    routed_experts: bool
    arrival: float
    lora: str | None = None
    restartable: bool = False  # the consumer takes `reset` deltas (else a retracted stream that sent text aborts)
    bootstrap: BootstrapTarget | None = None
    images: list | None = None  # the prompt's ProcessedImages (kestrel.models.vision)
    indexer_topk: bool = False


@dataclass
class _Track:
    """Engine-thread bookkeeping of one request group: how much of each sequence was already sent."""

    add: _Add
    requests: list[Request]
    sent_tokens: list[int]
    sent_text: list[int]
    last_token_at: list[float]
    finished: list[bool]
    reset: list[bool]


_STOP = object()
_SYNC_COMMANDS = ("pause", "continue", "update", "version")


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queued_requests: int | None = None) -> None:
        self._engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        # Read-only facts the HTTP layer may use from any thread.
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.max_running_requests = engine.config.max_running_requests
        self.engine_config = engine.config
        self.lora_adapters: dict[str, str] = dict(engine.lora_paths)  # loop thread's copy: name -> path
        self.vision = engine.model_config.vision if engine.supports_images else None
        self.lora_versions = {name: e.describe() for name, e in engine.adapters.public.items()}  # loop thread's copy
        self.weight_version = engine.weight_version  # loop thread's copy, updated when a sync completes
        self.paused: str | None = None  # loop thread's copy of the pause mode
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracks: dict[str, _Track] = {}  # engine thread only
        self._live: set[str] = set()  # loop thread only: ids submitted and not yet finished
        self._lock = threading.Lock()
        self._stats = engine.stats() | {"pending_weight_updates": 0}
        self._unadmitted = 0  # submitted, not yet reflected in _stats (under _lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Engine thread only: the pause mode, weight updates waiting for started requests to finish, and the
        # submissions held back meanwhile; `_added` sequences reached the engine this round.
        self._paused: str | None = None
        self._pending: list[tuple[str, str | None, asyncio.Future]] = []
        self._held: list[_Add] = []
        self._added = 0
        metrics.set_engine_stats(self._stats)

    # -- lifecycle (loop thread) ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kestrel-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running, then end the thread (after its current step)."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._thread.join)
        self._engine.close()  # write_back: what only memory holds reaches the disk tier

    def grammar(self) -> GrammarBackend:
        """The engine's grammar compiler (thread-safe; it reads only fixed engine facts such as the vocabulary)."""
        return self._engine.grammar

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict[str, int]:
        with self._lock:
            stats = dict(self._stats)
        if self._engine.disagg is not None:  # rooms change on the bootstrap server's threads too, engine idle or not
            stats |= self._engine.disagg.stats()
        return stats

    def num_queued(self) -> int:
        """Sequences waiting for admission, counting submissions the engine has not seen yet."""
        with self._lock:
            free = max(self.max_running_requests - self._stats["running"], 0)
            return max(self._stats["waiting"] + self._unadmitted - free, 0)

    # -- requests (loop thread) ----------------------------------------------------------------------------
    def admit(self, num_prompts: int, n: int) -> None:
        """Check that a request of `num_prompts` × `n` sequences may be submitted now, as a whole.

        Its sequences take the free running slots first; the rest count against --max-queued-requests. Call it
        right before the request's `submit`s, with no `await` between, so that no other request slips in.
        """
        if not self.alive:
            raise EngineStopped("the engine is not running")
        cap = self.max_queued_requests
        if cap is None:
            return
        total, room = num_prompts * n, self.max_running_requests + cap
        if total > room:
            param = "prompt" if num_prompts > room else "n"
            raise NeverFits(
                f"{param}: {num_prompts} prompt(s) × n={n} is {total} sequences, but at most {room} can be admitted "
                f"at once ({self.max_running_requests} running + {cap} queued, see --max-queued-requests)",
                param,
            )
        with self._lock:
            free = max(self.max_running_requests - self._stats["running"], 0)
            queued_after = max(self._stats["waiting"] + self._unadmitted + total - free, 0)
        if queued_after > cap:
            raise QueueFull(f"{self.num_queued()} of at most {cap} sequences are already queued")

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        deltas: bool = True,
        routed_experts: bool = False,
        events: asyncio.Queue | None = None,
        lora: str | None = None,
        restartable: bool = False,
        bootstrap: BootstrapTarget | None = None,
        images: list | None = None,
        indexer_topk: bool = False,
    ) -> RequestStream:
        """Queue a request (after `admit` let its whole HTTP request in); its events arrive on `events` (a fresh
        queue unless one is shared)."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, len(prompt_ids), events if events is not None else asyncio.Queue())
        with self._lock:
            self._unadmitted += params.n
        self._live.add(request_id)
        now = time.monotonic()
        add = _Add(
            stream, prompt_ids, params, deltas, routed_experts, now, lora, restartable, bootstrap, images, indexer_topk
        )
        self._inbox.put(add)
        return stream

    def abort(self, request_id: str) -> bool:
        """Stop a request; its stream gets a final event with finish_reason "abort". False if it is not live."""
        if request_id not in self._live:
            return False
        self._inbox.put(("abort", request_id))
        return True

    def abort_all(self, message: str, status: int = 503) -> None:
        """Refuse new requests and end every live one with an error event (`message`, `status`): how a shutdown
        whose grace period ran out lets each response finish well instead of being cancelled mid-write."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("abort_all", message, status))

    async def flush_cache(self) -> bool:
        """Empty the prefix cache's memory tiers (device and host; disk files stay) on the engine thread. False, and
        nothing flushed, while any request is running or waiting: their pages are locked in the tree."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("flush_cache", done))
        return await done

    async def load_lora_adapter(
        self, name: str, path: str, replace: bool = False, version: str | None = None, checksum: str | None = None
    ) -> dict[str, str | None]:
        """Load (or, `replace`, upsert) an adapter between two engine steps (ValueError naming the problem)."""
        entry = await self._call(lambda engine: engine.load_lora_adapter(name, path, replace, version, checksum))
        self.lora_adapters[name] = path
        self.lora_versions[name] = entry.describe()
        return self.lora_versions[name]

    async def unload_lora_adapter(self, name: str) -> None:
        await self._call(lambda engine: engine.unload_lora_adapter(name))
        self.lora_adapters.pop(name, None)
        self.lora_versions.pop(name, None)

    # -- weight sync (loop thread) -------------------------------------------------------------------------
    async def pause(self, mode: str) -> dict[str, int]:
        """Stop stepping: `abort` ends every request, `retract` sends the started ones back to rerun from their
        prompt, `in_place` leaves them as they are. New requests queue until `resume`. Returns the counts."""
        counts = await self._command("pause", mode)
        self.paused = mode
        return counts

    async def resume(self) -> None:
        await self._command("continue")
        self.paused = None

    async def update_weights(self, path: str, version: str | None, abort_all: bool) -> int:
        """Reload the weights from `path` once no started request remains (see the module docstring); returns the
        number of requests paused meanwhile. ValueError naming the problem, weights untouched, for a bad path."""
        paused = await self._command("update", path, version, abort_all)
        if version is not None:
            self.weight_version = version
        return paused

    async def set_weight_version(self, version: str, abort_all: bool) -> None:
        await self._command("version", version, abort_all)
        self.weight_version = version

    async def _command(self, name: str, *args):
        if not self.alive:
            raise EngineStopped("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put((name, done, *args))
        return await done

    async def _call(self, fn):
        """Run fn(engine) on the engine thread between steps; its result or exception comes back here."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("call", fn, done))
        return await done

    def _forget(self, events: list[tuple[asyncio.Queue, StreamEvent]]) -> None:
        for q, event in events:
            if event.done:
                self._live.discard(event.request_id)
            q.put_nowait(event)

    # -- the engine thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        if engine.device.type == "cpu":
            torch.set_flush_denormal(True)  # per thread, like the Engine's own setting (see Engine.__init__)
        while True:
            out: list[tuple[asyncio.Queue, StreamEvent]] = []
            try:
                idle = not engine.has_unfinished or self._paused is not None
                for cmd in self._drain(block=idle and not self._pending):
                    if cmd is _STOP:
                        self._abort_all(out, "the server is shutting down", status=503)
                        for *_, done in self._pending:
                            self._settle(done, error=EngineStopped("the server is shutting down"))
                        self._post(out)
                        return
                    if isinstance(cmd, _Add):
                        self._held.append(cmd) if self._pending else self._add(cmd, out)
                    elif cmd[0] == "abort_all":
                        self._abort_all(out, cmd[1], status=cmd[2])
                    elif cmd[0] == "flush_cache":
                        self._flush_cache(cmd[1])
                    elif cmd[0] == "call":
                        self._run_call(cmd[1], cmd[2])
                    elif cmd[0] in _SYNC_COMMANDS:
                        getattr(self, f"_{cmd[0]}")(out, *cmd[1:])
                    else:
                        self._abort(cmd[1], out)
                if self._pending and not engine.started_requests():
                    self._apply_updates(out)
                if engine.has_unfinished and self._paused is None:
                    result = engine.step()
                    self._collect(result.advanced, result.finished, out)
                    for record in result.transfers:
                        self.metrics.observe_transfer(record)
            except Exception:  # a bug in a step must not hang every client: fail them, keep serving
                log.exception("engine step failed; aborting all requests")
                self._abort_all(out, "internal engine error", status=500)
            self._post(out)
            stats = self._engine_stats()
            with self._lock:
                self._stats = stats
                self._unadmitted -= self._added
            self._added = 0
            self.metrics.set_engine_stats(stats)

    def _drain(self, block: bool) -> list[Any]:
        cmds = [self._inbox.get()] if block else []
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _post(self, out: list[tuple[asyncio.Queue, StreamEvent]]) -> None:
        if out and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._forget, out)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _add(self, cmd: _Add, out: list) -> None:
        rid = cmd.stream.request_id
        self._added += cmd.params.n
        try:
            self._engine.add_request(
                cmd.prompt_ids,
                cmd.params,
                rid,
                return_routed_experts=cmd.routed_experts,
                lora_name=cmd.lora,
                bootstrap=cmd.bootstrap,
                images=cmd.images,
                return_indexer_topk=cmd.indexer_topk,
            )
        except ValueError as exc:
            out.append((cmd.stream.queue, StreamEvent(rid, error=str(exc))))
            return
        reqs = self._engine.requests(rid)
        n = len(reqs)
        self._tracks[rid] = _Track(cmd, reqs, [0] * n, [0] * n, [cmd.arrival] * n, [False] * n, [False] * n)

    def _run_call(self, fn, done: asyncio.Future) -> None:
        try:
            result, error = fn(self._engine), None
        except Exception as exc:  # handed back to the caller; the engine keeps serving
            result, error = None, exc
        self._settle(done, result, error)

    def _settle(self, done: asyncio.Future, result: Any = None, error: Exception | None = None) -> None:
        def settle() -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(result)

        if self._loop is not None:
            self._loop.call_soon_threadsafe(settle)

    # -- weight sync (engine thread) -----------------------------------------------------------------------
    def _pause(self, out: list, done: asyncio.Future, mode: str) -> None:
        counts = {"num_aborted_requests": 0, "num_retracted_requests": 0}
        if mode == "abort":
            counts["num_aborted_requests"] = self._abort_tracked(out)
        elif mode == "retract":
            counts["num_retracted_requests"] = self._retract(out)
        self._paused = mode
        if self._pending:  # updates waiting for started requests: paused, those can no longer finish first
            if mode == "in_place":
                counts["num_retracted_requests"] = self._retract(out)
            self._apply_updates(out)
        self._refresh_stats()
        self._settle(done, counts)

    def _continue(self, out: list, done: asyncio.Future) -> None:
        self._paused = None
        self._settle(done)

    def _update(self, out: list, done: asyncio.Future, path: str, version: str | None, abort_all: bool) -> None:
        # Headers only, and on this thread (building the meta-device model sets torch's global default dtype):
        # a bad checkpoint is refused before any request is aborted, retracted or waited for.
        try:
            check_checkpoint(self._engine.model_config, path, getattr(torch, self.engine_config.dtype))
        except ValueError as exc:
            self._settle(done, error=exc)
            return
        if abort_all:
            self._abort_tracked(out)
        if self._paused == "in_place":
            self._retract(out)  # their KV is the old weights': they rerun on the new ones
        self._pending.append((path, version, done))
        started = len(self._engine.started_requests())
        if self._paused is not None or not started:
            self._apply_updates(out)
        else:
            log.info("weight update from %s waits for %d started request(s) to finish", path, started)

    def _apply_updates(self, out: list) -> None:
        """Run the waiting weight updates (no request is started), then let the held-back submissions in."""
        paused = len(self._engine.scheduler.waiting) if self._paused is not None else 0
        for path, version, done in self._pending:
            try:
                self._engine.update_weights_from_disk(path, version)
            except Exception as exc:  # a checkpoint that changed since it was checked: the caller gets the error
                log.exception("weight update from %s failed", path)
                self._settle(done, error=exc)
            else:
                log.info("weights reloaded from %s (version %s)", path, self._engine.weight_version)
                self._refresh_stats()
                self._settle(done, paused)
        self._pending = []
        held, self._held = self._held, []
        for cmd in held:
            self._add(cmd, out)

    def _version(self, out: list, done: asyncio.Future, version: str, abort_all: bool) -> None:
        if abort_all:
            self._abort_tracked(out)
        self._engine.weight_version = version  # requests already scheduled keep the name they were stamped with
        self._settle(done)

    def _retract(self, out: list) -> int:
        """Started requests back to the queue, to rerun from their prompts; their streams are reset (or, for a
        stream that already sent text it cannot take back, aborted)."""
        retracted = self._engine.retract_all()
        for rid in dict.fromkeys(r.request_id for r in retracted):
            track = self._tracks.get(rid)
            if track is None:
                continue
            if track.add.deltas and not track.add.restartable and (any(track.sent_tokens) or any(track.sent_text)):
                self._abort(rid, out)
                continue
            for i, req in enumerate(track.requests):
                if req in retracted:
                    track.sent_tokens[i] = track.sent_text[i] = 0
                    track.finished[i], track.reset[i] = False, True
        return len(retracted)

    def _abort_tracked(self, out: list) -> int:
        """End every request, held back or in the engine, with finish_reason "abort"."""
        held, self._held = self._held, []
        for cmd in held:
            self._add(cmd, out)
        rids = list(self._tracks)
        for rid in rids:
            self._abort(rid, out)
        return len(rids)

    def _flush_cache(self, done: asyncio.Future) -> None:
        idle = not self._engine.started_requests()  # queued requests hold no tree locks
        if idle:
            self._engine.cache.clear()
            self._refresh_stats()
        self._settle(done, idle)

    def _refresh_stats(self) -> None:
        """Before answering a command: a /get_server_info right after it must see what it changed."""
        stats = self._engine_stats()
        with self._lock:
            self._stats = stats

    def _engine_stats(self) -> dict[str, int]:
        """The engine's counters, plus the weight updates waiting for started requests to finish."""
        return self._engine.stats() | {"pending_weight_updates": len(self._pending)}

    def _abort(self, rid: str, out: list) -> None:
        held = next((cmd for cmd in self._held if cmd.stream.request_id == rid), None)
        if held is not None:  # into the engine and out again: its stream ends like any aborted request's
            self._held.remove(held)
            self._add(held, out)
        track = self._tracks.get(rid)
        if track is None:
            return
        self._engine.abort(rid)
        self._collect(track.requests, [request_output(track.requests)], out)

    def _abort_all(self, out: list, message: str, status: int) -> None:
        for cmd in self._held:
            out.append((cmd.stream.queue, StreamEvent(cmd.stream.request_id, error=message, status=status)))
        self._held = []
        for rid, track in list(self._tracks.items()):
            try:
                self._engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            del self._tracks[rid]
            out.append((track.add.stream.queue, StreamEvent(rid, error=message, status=status)))

    def _collect(self, advanced: list[Request], finished: list[RequestOutput], out: list) -> None:
        """Turn the requests that advanced this step into one event per request group."""
        now = time.monotonic()
        done = {o.request_id: o for o in finished}
        for rid in dict.fromkeys([r.request_id for r in advanced] + list(done)):
            track = self._tracks.get(rid)
            if track is None:
                continue
            event = StreamEvent(rid, deltas=self._deltas(track, now), output=done.get(rid))
            if event.output is not None:
                del self._tracks[rid]
                self.metrics.e2e.observe(now - track.add.arrival)
                self.metrics.prompt_tokens.inc(len(track.add.prompt_ids))
            if event.output is not None or (track.add.deltas and event.deltas):
                out.append((track.add.stream.queue, event))

    def _deltas(self, track: _Track, now: float) -> list[SeqDelta]:
        deltas = []
        for i, req in enumerate(track.requests):
            n_tok, n_text = len(req.output_ids), len(req.output_text)
            newly_finished = req.is_finished and not track.finished[i]
            if n_tok == track.sent_tokens[i] and n_text == track.sent_text[i] and not newly_finished:
                continue
            t0, c0 = track.sent_tokens[i], track.sent_text[i]
            with_lp = req.params.logprobs is not None
            deltas.append(
                SeqDelta(
                    index=i,
                    token_ids=req.output_ids[t0:],
                    text=req.output_text[c0:],
                    logprobs=req.logprobs[t0:] if with_lp else None,
                    top_logprobs=req.top_logprobs[t0:] if with_lp else None,
                    finish_reason=req.finish_reason if req.is_finished else None,
                    reset=track.reset[i],
                    weight_version=req.weight_version,
                    lora_version=req.lora_version,
                    lora_checksum=req.lora_checksum,
                )
            )
            track.reset[i] = False
            if n_tok > t0:
                self.metrics.generation_tokens.inc(n_tok - t0)
                (self.metrics.ttft if t0 == 0 else self.metrics.itl).observe(now - track.last_token_at[i])
                track.last_token_at[i] = now
            if newly_finished:
                self.metrics.finished.labels(req.finish_reason or "unknown").inc()
                if req.spec is not None and req.spec.accept_lengths:
                    self.metrics.spec_accept_length.observe(req.spec.mean_accept_length)
            track.sent_tokens[i], track.sent_text[i], track.finished[i] = n_tok, n_text, req.is_finished
        return deltas
