"""The vLLM simulator: a fake vLLM server (and a demo client) for the demo, tests and benchmarks.

It is a product feature, not the data plane: nothing in ``routing`` or ``controlpanel`` imports
it except to run it (``manage.py simulate_vllm``, ``manage.py serve --demo``).

What it may import: the standard library, aiohttp and orjson, and its own modules. Nothing from
``controlpanel``, nothing from Django, channels or Celery, and nothing from ``routing`` either,
so that it starts without a database or settings and stays a stand-in for a real vLLM server.

Modules, in the order a request meets them:

* ``config``: :class:`SimConfig` (one server's knobs) and the command-line options that set it.
* ``server``: the aiohttp application and its routes; ``start_simulator`` / ``run_simulator``.
* ``wire``: JSON bodies, vLLM's error format, request ids, the ``X-Sim-Delay-Ms`` hook.
* ``tokens``: prompts to tokens, the bounded vocabulary, the filler output text.
* ``generation``: chat and text completions, whole or streamed.
* ``engine``: the fake engine: FIFO batch admission, prefix-cache LRU, timing, the request log.
* ``pd``: prefill/decode disaggregation's roles: a prefill's leases, a decode's pull over
  ``/sim/kv_pull``, the ``kv_transfer_params`` between them, as vLLM's NIXL connector.
* ``responses``: completion bodies and pre-encoded SSE frames.
* ``endpoints``: every other endpoint (embeddings, tokenize, models, LoRA, health, /sim/*).
* ``metrics``: the Prometheus ``/metrics`` page in vLLM's names and buckets.
* ``gpus``: simulated GPUs on ``/dcgm-metrics``, as NVIDIA's DCGM exporter shows them.
* ``demo_traffic``: ``python -m simulator.demo_traffic``, the demo's gentle client (it talks to
  the router, not to a simulator; not imported here, so that ``-m`` runs it cleanly).
* ``__main__``: ``python -m simulator --port N``, the same options as ``manage.py simulate_vllm``.

Callers import from the module a name lives in (``simulator.server.start_simulator``,
``simulator.config.SimConfig``...): this package re-exports nothing, so that ``simulator.server``
(which imports its sibling modules) and the package never import each other.
"""
