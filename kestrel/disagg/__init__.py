"""Prefill/decode disaggregation: a prefill worker runs the prompt and writes the request's KV pages, KDA state
and first token straight into the decode worker's registered pools (Mooncake), which then decodes.

SGLang's model, with its flags and its bootstrap protocol, so that `sglang-router --pd-disaggregation` pairs
Kestrel workers: the router sends the same request to both, with `bootstrap_host/port/room`; the decode worker
looks the prefill rank up at the bootstrap server, registers the room's destination (page ids, state slot, an aux
row), and polls the aux row's status word, which the prefill writes last.
"""
