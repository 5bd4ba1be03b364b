"""The workers' KV caches as they really are, from vLLM's own KV cache events.

Owns: the wire format of the events (kv_events: ZeroMQ frames, msgpack batches, replay),
one worker's subscription (kv_stream), every worker's subscriptions following the fleet
(kv_subscriber), and the exact index of which worker holds which block (kv_index, with
kv_holders as its reverse map). Nothing here decides where a request goes: the kv_aware
policy (routing.policies) reads the index.

May import: routing.fleet (the WorkerViews to subscribe to), the standard library, pyzmq
and msgpack. Never the request path, policies, telemetry or anything that awaits Redis.
"""
