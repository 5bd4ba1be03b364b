"""The control plane's side of the routers: the snapshot they route from, and what they
report back (liveness, requests in flight, passive failures, ejections, usage).

``routers.snapshot.DatabaseSnapshotSource`` implements ``routing.refresher``'s port: it
reads every domain (workers, aliases, keys) into one immutable ``routing.fleet.snapshot``.

May import: ``controlpanel.registry``, ``fleet``, ``rollouts``, ``keys``, ``routing`` and
Django. Only the api, the console and the project's wiring sit above it.
"""
