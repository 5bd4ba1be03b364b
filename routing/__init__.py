"""The data plane: the router that every inference request goes through.

Rooms, top to bottom (each may import only what is below it; import-linter's layers
contract in pyproject.toml enforces it, type-only imports included):

* refresher, ports: the one link to the control plane (SnapshotSource in, RouterReport out).
* router: RouterApp, the ASGI entry and the process's lifetime (start-up, shutdown,
  readmission probes, /health and /list_workers).
* proxy: the request path (Proxy): read the body once, admit, pick, forward, relay, always
  close. relay: headers and body relays. routes: which paths are forwarded or shielded.
* listings, response_pinning: the routes it does not proxy; requests pinned by a
  Responses API id.
* state: RouterConfig and RouterState, everything that outlives a request.
* responses: answers the router writes itself (OpenAI's or Anthropic's error shape).
* telemetry/: metrics, traces, the access log, explanations, cache predictions checked.
* exchange: one request's whole state and outcome (Exchange).
* prompt/: a request's token ids (local tokenizer, chat template, the worker's render).
* peers/: what routers share through Redis (fleet_sync, load_push, response ids, rings).
* policies/: the balancing policies (the Policy protocol in policies.base).
* kv/, admission/, clients/: the workers' KV caches from their events; who may send now
  and who waits; upstream failures and ejection.
* fleet/: the snapshot of workers, models, aliases, fallbacks, keys and priority classes.
* sessions, errors, asgi_types, shared_store, histograms: small leaves everyone may use.

What it may import from outside: the standard library, aiohttp, orjson, prometheus_client,
redis, pyzmq, msgpack, tokenizers and jinja2; nothing from Django, channels, celery,
controlpanel or simulator. Nothing here touches a database: a store outage never stops a
proxied request.
"""
