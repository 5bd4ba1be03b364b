"""The router's side of its upstream connections: which failures count, and who is out.

Owns: outlier ejection (ejection: a worker that keeps failing real traffic leaves this
router's rotation and is probed back in) and the one failure classifier (failures: which
upstream failure may be retried elsewhere, and how it is recorded).

May import: routing.fleet, the standard library and aiohttp.
"""
