"""The ASGI shapes the router's code passes around, named once for every module.

Plain aliases, not protocols: an ASGI server hands over dicts and coroutine functions, and
an alias costs nothing at run time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
