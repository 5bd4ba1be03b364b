"""What the registry announces, for upper layers to subscribe to.

Models never call the presentation layer: a committed routing change sends
`routing_committed` (after the transaction commits, so a listener never sees data that could
still roll back), and the console, which owns the live dashboard, connects to it.
"""

from __future__ import annotations

from django.dispatch import Signal

# Sent once per committed transaction that moved the routing generation. No arguments.
routing_committed = Signal()


def announce_routing_committed() -> None:
    routing_committed.send(sender=None)
