"""The session key: which conversation a request continues, read once per request.

Coding agents name their sessions in headers of their own: Claude Code sends
`x-claude-code-session-id`, OpenCode `x-session-affinity`, Codex `session-id` (or
`session_id`); clients of this router have sent `X-Session-ID`, and OpenAI's API has the
body's `user` field. The router reads the first of a configured list that the request
carries, in the list's order (not the headers' order), and that one key drives:

* affinity: an alias's target (routing.fleet.aliases, rendezvous hashing) and the
  `session_affinity` policy's worker (its ring), both pure functions of the key and the
  snapshot, so every router replica places a session alike with no round trip;
* fairness: a client key's turns in the fair queue are shared between its sessions
  (routing.admission.fair_queue), so two agents behind one key share its weight equally;
* the access log and X-Route-Explain show it, as a hash (`shown`).

Configuration, once at start: CONTROLPANEL_SESSION_HEADERS, a comma-separated list of
header names, where `body:user` stands for the body's `user` field (a colon can never be
in a header name). Default: DEFAULT_SOURCES. A name that is not an HTTP token, an unknown
`body:` field, a repeat or an empty list is refused at start (ValueError; the settings
turn it into ImproperlyConfigured).

Cost per request: one pass over the request's headers with a dict lookup per header, and
the parsed body's `user` only when no header matched. Empty values count as absent. Keys
are kept whole (two long ids that share a prefix are two sessions); what holds them is
bounded elsewhere: the request's headers (RouterConfig.max_header_bytes), session
affinity's cache (keys up to 256 characters), the fair queue (only while a request waits).

Why a hash in logs and explanations: session ids are not secrets (Claude Code's is a
UUID), but the `user` field often carries an end user's id or e-mail address, which an
access log should not collect. The first 12 hex digits of a BLAKE2b hash (48 bits) tell
sessions apart in a log and match across replicas; they are not a secret either (a known
id can be hashed and looked for), only not the value itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

BODY_USER = "body:user"
DEFAULT_SOURCES = (
    "x-session-id",
    "x-claude-code-session-id",  # Claude Code
    "x-session-affinity",  # OpenCode
    "session-id",  # Codex
    "session_id",  # Codex, older releases
    BODY_USER,  # OpenAI's `user`
)
SHOWN_HEX = 12
# RFC 9110's token characters: what a header name may be made of.
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True, slots=True)
class Session:
    """A request's session key and where it was found (a header's lower-case name, or
    BODY_USER)."""

    key: str
    source: str

    def shown(self) -> dict[str, str]:
        """What the access log and explanations show: a hash of the key, and its source."""
        digest = blake2b(self.key.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
        return {"hash": digest[:SHOWN_HEX], "from": self.source}


def parse_sources(value: str | None) -> tuple[str, ...]:
    """The configured list (CONTROLPANEL_SESSION_HEADERS); None or blank: the default."""
    if value is None or not value.strip():
        return DEFAULT_SOURCES
    sources: list[str] = []
    for raw in value.split(","):
        name = raw.strip().lower()
        if not name:
            raise ValueError(f"an empty name in the session headers list {value!r}")
        if name.startswith("body:"):
            if name != BODY_USER:
                raise ValueError(
                    f"{raw.strip()!r}: only {BODY_USER!r} (the OpenAI `user` field) may be "
                    "read from the body"
                )
        elif not set(name) <= _TCHAR:
            raise ValueError(f"{raw.strip()!r} is not an HTTP header name")
        if name in sources:
            raise ValueError(f"{raw.strip()!r} is listed twice in the session headers")
        sources.append(name)
    return tuple(sources)


class SessionReader:
    """Reads the session key of a request by the configured sources, built once."""

    __slots__ = ("_order", "_user_rank", "sources")

    def __init__(self, sources: Sequence[str] = DEFAULT_SOURCES) -> None:
        self.sources = tuple(sources)
        # Header name (as ASGI gives it: lower-case bytes) -> its rank in the list.
        self._order = {
            name.encode("latin-1"): rank
            for rank, name in enumerate(self.sources)
            if name != BODY_USER
        }
        self._user_rank = (
            self.sources.index(BODY_USER) if BODY_USER in self.sources else len(self.sources)
        )

    def header_names(self) -> tuple[str, ...]:
        """The headers that may carry a session (for the admin API's dry run)."""
        return tuple(name for name in self.sources if name != BODY_USER)

    def read(self, headers: Iterable[tuple[bytes, bytes]], body: Any) -> Session | None:
        """The session of a request: the best-ranked source it carries with a value."""
        order, best, found = self._order, len(self.sources), b""
        for name, value in headers:
            rank = order.get(name)
            if rank is not None and rank < best and value:
                best, found = rank, value
        if best < self._user_rank:
            return Session(found.decode("latin-1"), self.sources[best])
        user = body.get("user") if isinstance(body, Mapping) else None
        if isinstance(user, str) and user and self._user_rank < len(self.sources):
            return Session(user, BODY_USER)
        if best < len(self.sources):  # a header ranked below `user`, and no `user`
            return Session(found.decode("latin-1"), self.sources[best])
        return None


def key_of(session: Session | None) -> str | None:
    return session.key if session is not None else None
