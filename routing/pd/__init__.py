"""Prefill/decode disaggregation: a request through a prefill worker, then a decode worker.

vLLM's disaggregated serving (a connector such as NIXL, each server started with
`--kv-transfer-config` and a role) expects its router to send the request to a prefill
server first, with `max_tokens: 1`, not streamed, and `kv_transfer_params` asking for a
remote decode; the prefill answer's `kv_transfer_params` (the engine, block ids, host and
port of the cached blocks) then go with the original request, untouched otherwise, to a
decode server, whose answer is relayed to the client as it comes.

Owns: the two bodies and the transfer parameters (bodies), the prefill leg with its
retries and disconnects (prefill), the decode worker chosen by load (decode), and the
bypass of short prompts. A model is disaggregated when its fleet has workers of role
`prefill` (routing.fleet.snapshot.ModelRoute.prefill); one with only `both` workers is
routed as before.

May import: routing.state, routing.relay, routing.responses, routing.exchange and every
room below them; never routing.proxy or routing.router.
"""
