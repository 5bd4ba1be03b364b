"""What several router processes and replicas share, through Redis and nothing else.

Owns: the connection and its scripts (shared_store), the loop that exchanges decisions,
loads, budgets and peers' presence (fleet_sync), in-flight counts pushed at once
(load_push), leases on fleet-wide admission limits (leases), and which worker holds each
Responses API response (response_affinity). A Redis outage degrades each of these to the
router's own view; it never stops a request.

May import: routing.fleet, routing's bottom modules, the standard library, redis and
orjson. What it needs from the router it names in small protocols of its own
(fleet_sync.RouterState), never routing.proxy or routing.router.
"""
