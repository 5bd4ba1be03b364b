"""Session keys (routing.sessions): the header order, the configuration and its refusals, the
hash shown in logs; and the fair queue's turns between a key's sessions
(routing.admission.fair_queue)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlpanel.envconf import env_session_sources
from routing.admission.fair_queue import FairQueue
from routing.sessions import BODY_USER, DEFAULT_SOURCES, Session, SessionReader, parse_sources

STANDARD = 1
AGENTS = {  # each agent's own header, as it sends it
    "x-session-id": b"x-session-id",
    "claude-code": b"x-claude-code-session-id",
    "opencode": b"x-session-affinity",
    "codex": b"session-id",
    "codex-old": b"session_id",
}


def headers(*pairs: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), *pairs]


@pytest.mark.parametrize("header", AGENTS.values(), ids=AGENTS.keys())
def test_each_agents_header_is_a_session_key(header: bytes) -> None:
    found = SessionReader().read(headers((header, b"abc-123")), {"user": "someone"})
    assert found == Session("abc-123", header.decode())


def test_the_list_order_wins_over_the_order_headers_come_in() -> None:
    reader = SessionReader()
    sent = headers(
        (b"session_id", b"codex-old"),
        (b"x-session-affinity", b"opencode"),
        (b"x-claude-code-session-id", b"claude"),
    )
    assert reader.read(sent, {}) == Session("claude", "x-claude-code-session-id")
    assert reader.read([*sent, (b"x-session-id", b"mine")], {}).key == "mine"  # type: ignore[union-attr]
    assert reader.read(sent[:3], {}) == Session("opencode", "x-session-affinity")


def test_user_comes_last_and_empty_values_are_absent() -> None:
    reader = SessionReader()
    assert reader.read(headers(), {"user": "u-7"}) == Session("u-7", BODY_USER)
    assert reader.read(headers((b"x-session-id", b"")), {"user": "u-7"}).key == "u-7"  # type: ignore[union-attr]
    assert reader.read(headers(), {"user": ""}) is None
    assert reader.read(headers(), {"user": 7}) is None
    assert reader.read(headers(), ["not", "an", "object"]) is None
    assert reader.read(headers((b"x-other", b"v")), {}) is None


def test_a_configured_list_is_read_in_its_own_order() -> None:
    sources = parse_sources(" X-Conversation , body:user, Session-ID ")
    assert sources == ("x-conversation", BODY_USER, "session-id")
    reader = SessionReader(sources)
    assert reader.header_names() == ("x-conversation", "session-id")
    # x-session-id is not listed; `user` goes before session-id here
    assert reader.read(headers((b"x-session-id", b"a")), {}) is None
    assert reader.read(headers((b"session-id", b"c")), {"user": "u"}).key == "u"  # type: ignore[union-attr]
    assert reader.read(headers((b"session-id", b"c")), {}) == Session("c", "session-id")
    only_headers = SessionReader(parse_sources("x-session-id"))
    assert only_headers.read(headers(), {"user": "u"}) is None  # `user` not listed: ignored


def test_default_list() -> None:
    assert parse_sources(None) == parse_sources("  ") == DEFAULT_SOURCES
    assert DEFAULT_SOURCES == (
        "x-session-id", "x-claude-code-session-id", "x-session-affinity", "session-id",
        "session_id", BODY_USER,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x-session-id,,session-id", "empty name"),
        ("x session", "not an HTTP header name"),
        ("x-sitzung-€", "not an HTTP header name"),
        ("body:metadata", "only 'body:user'"),
        ("x-session-id, X-Session-ID", "listed twice"),
    ],
)
def test_a_bad_list_is_refused_at_start(
    value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sources(value)
    monkeypatch.setenv("CONTROLPANEL_SESSION_HEADERS", value)
    with pytest.raises(ImproperlyConfigured, match="CONTROLPANEL_SESSION_HEADERS"):
        env_session_sources("CONTROLPANEL_SESSION_HEADERS")


def test_the_setting_reaches_the_router_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTROLPANEL_SESSION_HEADERS", "x-claude-code-session-id,body:user")
    assert env_session_sources("CONTROLPANEL_SESSION_HEADERS") == (
        "x-claude-code-session-id",
        BODY_USER,
    )
    monkeypatch.delenv("CONTROLPANEL_SESSION_HEADERS")
    assert env_session_sources("CONTROLPANEL_SESSION_HEADERS") == DEFAULT_SOURCES


def test_shown_is_a_short_stable_hash_never_the_key() -> None:
    shown = Session("alice@example.com", BODY_USER).shown()
    assert shown == Session("alice@example.com", BODY_USER).shown()
    assert shown["from"] == BODY_USER and len(shown["hash"]) == 12
    assert "alice" not in str(shown)
    assert Session("bob@example.com", BODY_USER).shown()["hash"] != shown["hash"]


# --- the fair queue: keys by weight, a key's sessions equally --------------------------------


def wake_order(joins: list[tuple[int, float, str | None]], turns: int) -> list[int]:
    """Queue `joins` (flow, weight, session) in order, wake `turns` of them, admitting each;
    the indexes of the woken, in order."""

    async def scenario() -> list[int]:
        loop = asyncio.get_running_loop()
        queue = FairQueue()
        waiters = []
        for flow, weight, session in joins:
            turn: asyncio.Future[None] = loop.create_future()
            waiters.append(queue.join(STANDARD, flow, weight, turn, session))
        order = []
        for _ in range(turns):
            assert queue.wake()
            index = next(i for i, w in enumerate(waiters) if w.turn.done() and i not in order)
            queue.admitted(waiters[index])
            queue.leave(waiters[index])
            order.append(index)
        return order

    return asyncio.run(scenario())


def test_a_keys_sessions_share_its_turns_equally_however_hard_one_floods() -> None:
    joins = [(1, 1.0, "flood")] * 60 + [(1, 1.0, "quiet")] * 10
    woken = Counter(joins[i][2] for i in wake_order(joins, 20))
    assert woken == {"flood": 10, "quiet": 10}


def test_sessions_split_their_keys_weight_rather_than_multiply_it() -> None:
    """A weight-1 key with three agents against a weight-1 key with one: half each."""
    joins = [(1, 1.0, f"agent-{n % 3}") for n in range(60)] + [(2, 1.0, "solo")] * 60
    woken = Counter(joins[i][0] for i in wake_order(joins, 40))
    assert woken == {1: 20, 2: 20}


def test_two_agents_of_weights_3_and_1_share_by_weight() -> None:
    joins = [(1, 1.0, "codex")] * 60 + [(3, 3.0, "claude")] * 60
    woken = Counter(joins[i][0] for i in wake_order(joins, 40))
    assert woken == {3: 30, 1: 10}


def test_without_keys_sessions_are_the_flows() -> None:
    joins = [(0, 1.0, "a")] * 50 + [(0, 1.0, "b")] * 5 + [(0, 1.0, None)] * 50
    woken = Counter(joins[i][2] for i in wake_order(joins, 15))
    assert woken == {"a": 5, "b": 5, None: 5}


def test_waking_without_admitting_does_not_move_virtual_time() -> None:
    """The cause of the 0.67 share: after each admission the queue wakes the next head to
    pass on any room left; that head (the weight-1 key's, its tag far ahead) found none
    and went back, but had set the virtual time to its tag, so the weight-3 key's next
    request was tagged behind it."""

    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        queue = FairQueue()
        light = [queue.join(STANDARD, 1, 1.0, loop.create_future()) for _ in range(4)]
        heavy = queue.join(STANDARD, 3, 3.0, loop.create_future())  # tag 1/3: first
        assert queue.wake() and heavy.turn.done()
        queue.admitted(heavy)
        queue.leave(heavy)
        assert queue.wake() and light[0].turn.done()  # tag 1: woken, finds no room
        queue.rejoin(light[0], loop.create_future())
        again = queue.join(STANDARD, 3, 3.0, loop.create_future())  # 2/3, not 1 + 1/3
        assert queue.wake()
        return again.turn.done() and not light[0].turn.done()

    assert asyncio.run(scenario())


def test_a_cancelled_waiter_gives_up_its_keys_turn() -> None:
    async def scenario() -> list[str | None]:
        loop = asyncio.get_running_loop()
        queue = FairQueue()
        gone = queue.join(STANDARD, 1, 1.0, loop.create_future(), "a")
        stays = queue.join(STANDARD, 1, 1.0, loop.create_future(), "b")
        gone.turn.cancel()  # timed out; its leave has not run yet
        assert queue.wake() and stays.turn.done()
        queue.leave(gone)
        queue.admitted(stays)
        queue.leave(stays)
        assert not queue.wake() and len(queue) == 0
        return [stays.session]

    assert asyncio.run(scenario()) == ["b"]
