"""The data plane: the router that every inference request goes through.

What lives here:
* proxy: the model routes' hot path (RouterApp): read the body once, pick, forward, relay
  the stream, always close; listings and responses: the routes it does not proxy and the
  answers it writes itself; errors: the OpenAI error shape; asgi_types: the ASGI aliases.
* snapshot: the immutable view of routable workers, swapped atomically by refresher, which
  is the only link to the control plane: through the SnapshotSource it is handed (ports).
* policies/: the balancing policies; aliases, admission, ejection: what decides where a
  request may go; auth, usage, shared_store: client keys, token accounting and their Redis;
  metrics, gpu_metrics, access_log: what the router tells about itself.

What it may import: the standard library, aiohttp, orjson, prometheus_client and redis, and
nothing from Django, channels, celery, controlpanel or simulator. Nothing here touches a
database: a store outage must never stop a proxied request.
"""
