"""The pieces of prefill/decode disaggregation that need no model: byte ranges of pages, slots and draft rings,
the aux row, control-message validation, and the bootstrap server's SGLang routes."""

from __future__ import annotations

import socket
import struct
import time

import httpx
import numpy as np
import pydantic
import pytest
import torch

from kestrel.disagg.bootstrap import BootstrapServer
from kestrel.disagg.layout import DraftLayout, PoolLayout, Region, runs
from kestrel.disagg.messages import AuxRow, FirstToken, RoomMsg
from kestrel.spec.context import DraftKV


def test_runs_merge_only_where_both_sides_advance_together():
    assert runs([3, 4, 5, 9], [0, 1, 2, 3]) == [(3, 0, 3), (9, 3, 1)]
    assert runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert runs([], []) == []


def _layout(tensors: list[torch.Tensor], states: list[torch.Tensor], page_size: int) -> PoolLayout:
    return PoolLayout(page_size, tuple(Region.of(t) for t in tensors), tuple(Region.of(t) for t in states))


def _apply(ranges):
    """Copy each (src, dst, n) range as Mooncake would, through ctypes."""
    import ctypes

    for src, dst, n in ranges:
        ctypes.memmove(dst, src, n)


def test_page_and_slot_ranges_move_exactly_the_named_rows():
    ps = 4
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(8 * ps, 5, generator=gen), torch.randint(0, 255, (8 * ps, 7), dtype=torch.uint8, generator=gen)]
    dst = [torch.zeros_like(t) for t in src]
    s_state, d_state = [torch.randn(3, 2, 6, generator=gen)], [torch.zeros(3, 2, 6)]
    a, b = _layout(src, s_state, ps), _layout(dst, d_state, ps)
    ranges = a.page_ranges(b, [1, 2, 6], [4, 5, 0]) + a.slot_ranges(b, 2, 1)
    assert len(ranges) == 2 * 2 + 1  # pages 1-2 → 4-5 are one run per tensor
    _apply(ranges)
    for s, d in zip(src, dst):
        for sp, dp in ((1, 4), (2, 5), (6, 0)):
            assert torch.equal(d[dp * ps : (dp + 1) * ps], s[sp * ps : (sp + 1) * ps])
        assert not d[ps : 4 * ps].any()  # nothing else was written
    assert torch.equal(d_state[0][1], s_state[0][2]) and not d_state[0][0].any()
    with pytest.raises(ValueError, match="outside a region"):
        a.page_ranges(b, [1], [8])  # the peer has pages 0-7


def test_draft_ranges_map_ring_positions_of_both_capacities():
    src, dst = DraftKV(8, 2, 1, 3, 2, torch.float32, "cpu"), DraftKV(16, 2, 1, 3, 2, torch.float32, "cpu")
    positions = torch.arange(4, 12)  # the ring of 8 wraps: positions 8-11 sit in slots 0-3
    src.write(positions, [(torch.randn(8, 1, 3), torch.randn(8, 1, 2)) for _ in range(2)])
    _apply(DraftLayout.of(src).ranges(DraftLayout.of(dst), positions.tolist()))
    for p in positions.tolist():
        assert torch.equal(dst.k[:, p % 16], src.k[:, p % 8]) and torch.equal(dst.v[:, p % 16], src.v[:, p % 8])
    assert dst.valid.tolist() == [p in range(4, 12) for p in range(16)]


def test_aux_row_round_trips_token_logprobs_and_error_text():
    first = FirstToken(123, -0.25, [(123, -0.25), (7, -3.5)], cached_tokens=48)
    row = np.zeros(AuxRow.WORDS, dtype=np.int64)
    row[AuxRow.HEAD :] = AuxRow(first, "room 9 failed: ünïcode").payload()
    back = AuxRow.read(row)
    assert back.first == first and back.error == "room 9 failed: ünïcode"
    row[AuxRow.HEAD :] = AuxRow(FirstToken(5, 0.0, None)).payload()
    assert AuxRow.read(row).first.top is None  # "no logprobs asked" stays distinct from "none above the token"


def test_room_message_refuses_wrong_types_unknown_fields_and_huge_rooms():
    good = {
        "instance_id": "d1",
        "room": 5,
        "prompt_len": 20,
        "prompt_digest": "ab",
        "prefix_len": 0,
        "pages": [0, 1],
        "slot": 3,
        "aux_index": 0,
    }
    assert RoomMsg.model_validate(good).pages == [0, 1]
    for bad in ({"room": "5"}, {"room": 1 << 63}, {"pages": [0, "1"]}, {"evil": 1}, {"slot": -1}):
        with pytest.raises(pydantic.ValidationError):
            RoomMsg.model_validate(good | bad)


@pytest.fixture
def bootstrap():
    calls = []
    server = BootstrapServer("127.0.0.1", 0, {"/kestrel/pd/echo": lambda body: (calls.append(body) or 200, body)})
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", server, calls
    finally:
        server.stop()


RANK = {
    "attn_tp_size": 1,
    "attn_tp_rank": 0,
    "attn_cp_size": 1,
    "attn_cp_rank": 0,
    "attn_dp_size": 1,
    "attn_dp_rank": 0,
    "pp_size": 1,
    "pp_rank": 0,
    "system_dp_size": 1,
    "system_dp_rank": 0,
    "rank_ip": "127.0.0.1",
    "rank_port": 9,
    "page_size": 16,
    "kv_cache_dtype": "auto",
}
LAYOUT_QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
RANK_QUERY = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


def test_bootstrap_server_speaks_sglangs_route_protocol(bootstrap):
    url, _, calls = bootstrap
    assert httpx.get(url + "/health").text == "OK"
    assert httpx.get(url + LAYOUT_QUERY).status_code == 503  # no rank registered yet
    assert httpx.put(url + "/route", json=RANK).status_code == 200
    layout = httpx.get(url + LAYOUT_QUERY).json()
    assert layout["attn_tp_size"] == layout["dp_size"] == layout["pp_size"] == 1 and layout["page_size"] == 16
    assert httpx.get(url + RANK_QUERY).json()["rank_port"] == 9
    assert httpx.get(url + RANK_QUERY.replace("target_tp_rank=0", "target_tp_rank=3")).status_code == 404
    assert httpx.get(url + "/route?prefill_dp_rank=x").status_code == 400
    assert httpx.put(url + "/route", json={"rank_ip": "h"}).status_code == 400  # names the missing fields
    assert httpx.post(url + "/kestrel/pd/echo", json={"a": 1}).json() == {"a": 1} and calls == [{"a": 1}]


def test_bootstrap_server_answers_bad_bodies_with_errors(bootstrap):
    url, _, calls = bootstrap
    r = httpx.post(url + "/kestrel/pd/echo", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    assert httpx.post(url + "/kestrel/pd/echo", json=[1, 2]).status_code == 400
    assert httpx.post(url + "/kestrel/pd/nothing", json={}).status_code == 404
    assert calls == []


def test_bootstrap_server_logs_a_peer_that_hangs_up_without_a_traceback(bootstrap, capfd, caplog):
    url, server, _ = bootstrap
    with caplog.at_level("WARNING", logger="kestrel.disagg.bootstrap"):
        peer = socket.create_connection(("127.0.0.1", server.port))
        peer.sendall(b"GET /hea")  # mid request line, as a decode worker killed mid-request leaves it
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()  # linger 0: a reset, not a clean close
        deadline = time.monotonic() + 5
        while "hung up" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
    assert "hung up (ConnectionResetError)" in caplog.text
    assert "Traceback" not in capfd.readouterr().err  # what the workers' clean-stop check reads
    assert httpx.get(url + "/health").text == "OK"  # still serving
