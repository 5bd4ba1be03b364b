"""Client API keys and their usage: issue, revoke, list, and the usage the routers report.

May import: ``controlpanel.registry``, ``routing`` (the key format and usage batches) and
Django. Nothing from the fleet, rollouts, routers, api or console apps.
"""
