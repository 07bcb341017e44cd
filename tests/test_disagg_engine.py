"""A prefill engine and a decode engine in one process, paired through the real bootstrap server and the real
Mooncake transfer engine (TCP on loopback): what lands in the decode pools is the prefill pools' bytes, outputs
equal a unified engine's, and failures free everything on both sides."""

from __future__ import annotations

import time

import pytest
import torch

from kestrel.config import ConfigError
from kestrel.disagg.messages import TransferState
from kestrel.disagg.role import BootstrapTarget
from kestrel.engine.config import EngineConfig
from kestrel.engine.engine import Engine
from kestrel.engine.sampling_params import SamplingParams

BASE = dict(dtype="float32", device="cpu", max_total_tokens=2048, max_model_len=512, max_running_requests=4)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [(7 * i + 3) % 900 + 20 for i in range(70)]  # 70 tokens: 4 full pages and a partial one
_rooms = iter(range(100, 10_000))


def _pair(**kwargs) -> tuple[Engine, Engine]:
    prefill = Engine(EngineConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **BASE, **kwargs))
    decode = Engine(EngineConfig(disaggregation_mode="decode", **BASE, **kwargs))
    return prefill, decode


def _target(prefill: Engine) -> BootstrapTarget:
    return BootstrapTarget("127.0.0.1", prefill.disagg.bootstrap_port, next(_rooms))


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _drain(*engines: Engine, timeout: float = 30.0) -> dict:
    """Step every engine until all are idle; the finished outputs and transfer records by request id / room."""
    outputs, records = {}, []
    deadline = time.monotonic() + timeout
    while any(e.has_unfinished for e in engines):
        assert time.monotonic() < deadline, "engines did not finish"
        for e in engines:
            if e.has_unfinished:
                result = e.step()
                outputs.update({o.request_id: o for o in result.finished})
                records += [(e, r) for r in result.transfers]
    return {"outputs": outputs, "records": records}


def _unified(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    rid = engine.add_request(prompt, params)
    return _drain(engine)["outputs"][rid].outputs[0].token_ids


def _assert_idle(*engines: Engine) -> None:
    for e in engines:
        stats = e.stats()
        assert stats["pages_used"] == 0 and stats["slots_used"] == 0, stats
        assert stats["running"] == stats["waiting"] == 0, stats
        assert e.disagg.stats().get("disagg_rooms", 0) == 0 and e.disagg.stats().get("disagg_transfers", 0) == 0
        if hasattr(e.cache, "check_counters"):
            e.cache.check_counters()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Two engines and their transfer threads share this process: one intra-op thread each keeps OpenMP's
    spinning threads from starving the receiver and sender threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3", "nvfp4"])
def trio(request):
    """Prefill and decode workers and a unified engine, all with this KV format and DFlash on."""
    kwargs = dict(kv_cache_dtype=request.param, speculative_algorithm="dflash")
    prefill, decode = _pair(**kwargs)
    unified = Engine(EngineConfig(**BASE, **kwargs))
    yield prefill, decode, unified
    for engine in (decode, prefill, unified):
        engine.close()


def _rows(t: torch.Tensor, page: int, ps: int) -> torch.Tensor:
    return t[page * ps : (page + 1) * ps].contiguous().view(torch.uint8)


def test_transferred_pages_state_and_draft_context_equal_the_prefill_pools_bit_for_bit(trio):
    prefill, decode, _ = trio
    target = _target(prefill)
    decode.add_request(PROMPT, GREEDY, "d", bootstrap=target)
    prefill.add_request(PROMPT, GREEDY, "p", bootstrap=target)
    d_req, p_req = decode.requests("d")[0], prefill.requests("p")[0]
    decode.step()  # reserves pages, a slot, an aux row and the draft ring; the receiver registers the room
    _wait(lambda: decode.disagg.state(target.room) == TransferState.WAITING, "the room's registration")
    while p_req not in prefill.disagg.held:  # prompt computed and first token sampled: the pages are on their way
        prefill.step()
    _wait(lambda: decode.disagg.state(target.room) == TransferState.SUCCESS, "the KV to land")
    ps = prefill.config.page_size
    assert len(d_req.pages) == len(p_req.pages) == -(-len(PROMPT) // ps)
    for p_page, d_page in zip(p_req.pages, d_req.pages, strict=True):
        for p_t, d_t in zip(prefill.runner.kv.tensors(), decode.runner.kv.tensors(), strict=True):
            assert torch.equal(_rows(p_t, p_page, ps), _rows(d_t, d_page, ps))
    p_states, d_states = prefill.runner.states, decode.runner.states
    for layer in p_states.conv:
        assert torch.equal(p_states.conv[layer][p_req.slot], d_states.conv[layer][d_req.slot])
        assert torch.equal(
            p_states.recurrent[layer][p_req.slot].view(torch.uint8),
            d_states.recurrent[layer][d_req.slot].view(torch.uint8),
        )
    p_kv, d_kv = p_req.spec.kv, d_req.spec.kv
    assert p_kv.valid.any() and torch.equal(p_kv.valid, d_kv.valid)
    assert torch.equal(p_kv.k[:, p_kv.valid], d_kv.k[:, d_kv.valid]) and torch.equal(
        p_kv.v[:, p_kv.valid], d_kv.v[:, d_kv.valid]
    )
    done = _drain(prefill, decode)
    assert d_req.output_ids[0] == p_req.output_ids[0] == done["outputs"]["p"].outputs[0].token_ids[0]
    _assert_idle(prefill, decode)


def test_outputs_equal_a_unified_engine_and_a_later_turn_moves_only_its_new_pages(trio):
    prefill, decode, unified = trio
    ps = prefill.config.page_size
    prompt = PROMPT[::-1]
    for turn in range(2):
        expected = _unified(unified, prompt)
        target = _target(prefill)
        decode.add_request(prompt, GREEDY, f"d{turn}", bootstrap=target)
        prefill.add_request(prompt, GREEDY, f"p{turn}", bootstrap=target)
        d_req = decode.requests(f"d{turn}")[0]
        done = _drain(prefill, decode)
        out = done["outputs"][f"d{turn}"].outputs[0]
        assert out.token_ids == expected and out.error is None
        (d_record,) = [r for e, r in done["records"] if e is decode]
        (p_record,) = [r for e, r in done["records"] if e is prefill]
        assert d_record.ok and p_record.ok and p_record.nbytes > 0
        hit = d_req.cached_tokens  # the prefill's own prefix hit, reported as the request's cached tokens
        if turn == 0:
            assert len(d_record.pages) == -(-len(prompt) // ps) and hit == 0
        else:  # both sides hit: the decode side kept turn 1's pages, the prefill side its checkpoint
            assert hit > 0 and len(d_record.pages) < -(-len(prompt) // ps) - 1
            assert len(p_record.pages) == len(d_record.pages)
        prompt = prompt + expected + PROMPT[:20]
    _assert_idle(prefill, decode)


def test_an_image_request_through_prefill_and_decode_equals_a_unified_engine(trio):
    """kestrel-mini sees: both workers get the request's images (the router sends both halves the same body), the
    prefill side runs the tower and the vision adapter, the decode side goes on from the moved pages on the adapter
    too, and the answer is the unified engine's."""
    from kestrel.chat_template import render_chat
    from kestrel.engine.vision_adapter import VISION_ADAPTER
    from kestrel.models.vision.inputs import expand_placeholders
    from kestrel.models.vision.preprocess import preprocess_image
    from kestrel.train.vision_data import render_image

    prefill, decode, unified = trio
    vision = unified.model_config.vision
    chat = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "What shape is this?"}]}]
    images = [preprocess_image(render_image("shape", 31337)[0], vision)]
    prompt = expand_placeholders(unified.encode(render_chat(chat)), images, vision.image_token_id)
    rid = unified.add_request(prompt, GREEDY, images=images)
    expected = _drain(unified)["outputs"][rid].outputs[0].token_ids
    target = _target(prefill)
    decode.add_request(prompt, GREEDY, "dimg", bootstrap=target, images=images)
    prefill.add_request(prompt, GREEDY, "pimg", bootstrap=target, images=images)
    assert decode.requests("dimg")[0].lora_name == prefill.requests("pimg")[0].lora_name == VISION_ADAPTER
    out = _drain(prefill, decode)["outputs"]["dimg"].outputs[0]
    assert out.token_ids == expected and out.error is None
    _assert_idle(prefill, decode)


@pytest.fixture(scope="module")
def impatient():
    """A pair whose requests give up after half a second without their other half."""
    prefill, decode = _pair(disaggregation_transfer_timeout=0.5)
    yield prefill, decode
    decode.close()
    prefill.close()


def test_a_missing_half_times_out_on_both_sides_and_leaks_nothing(impatient):
    prefill, decode = impatient
    only_decode, only_prefill = _target(prefill), _target(prefill)
    decode.add_request(PROMPT, GREEDY, "d", bootstrap=only_decode)
    prefill.add_request(PROMPT, GREEDY, "p", bootstrap=only_prefill)
    out = _drain(prefill, decode)["outputs"]
    assert "timed out" in out["d"].outputs[0].error and out["d"].outputs[0].error_status == 502
    assert "timed out" in out["p"].outputs[0].error and out["p"].outputs[0].finish_reason == "abort"
    _wait(lambda: prefill.disagg.stats()["disagg_rooms"] == 0, "the prefill side to drop the decode-only room")
    _assert_idle(prefill, decode)
    with pytest.raises(ValueError, match="given up by the decode worker"):  # its prefill half, come too late
        prefill.add_request(PROMPT, GREEDY, "late", bootstrap=only_decode)


def test_aborting_a_waiting_decode_request_frees_it_once_the_prefill_side_lets_go(impatient):
    prefill, decode = impatient
    target = _target(prefill)
    decode.add_request(PROMPT, GREEDY, "d2", bootstrap=target)
    decode.step()
    _wait(lambda: decode.disagg.state(target.room) == TransferState.WAITING, "the room's registration")
    assert prefill.disagg.stats()["disagg_rooms"] == 1  # the destination is registered there
    assert decode.abort("d2")
    _drain(decode)
    _assert_idle(prefill, decode)


def test_mismatched_pools_are_refused_with_the_reason():
    prefill = Engine(EngineConfig(disaggregation_mode="prefill", disaggregation_bootstrap_port=0, **BASE))
    decode = Engine(EngineConfig(disaggregation_mode="decode", **BASE, page_size=32, state_track_interval=256))
    try:
        decode.add_request(PROMPT, GREEDY, "d", bootstrap=_target(prefill))
        out = _drain(decode)["outputs"]["d"].outputs[0]
        assert "page_size 16 differs from this worker's 32" in out.error
        _assert_idle(decode)
    finally:
        decode.close()
        prefill.close()


def test_disaggregated_workers_check_their_requests_and_options(impatient):
    prefill, _ = impatient
    with pytest.raises(ValueError, match="bootstrap_room: required"):
        prefill.add_request(PROMPT, GREEDY)
    with pytest.raises(ValueError, match="n: must be 1"):
        prefill.add_request(PROMPT, SamplingParams(n=2), bootstrap=_target(prefill))
    with pytest.raises(ConfigError, match="disaggregation_mode"):
        EngineConfig(disaggregation_mode="decode", tp=2)
    with pytest.raises(ConfigError, match="disaggregation_transfer_timeout"):
        EngineConfig(disaggregation_mode="decode", disaggregation_transfer_timeout=0)
