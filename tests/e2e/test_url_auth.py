"""Every URL pattern Django and Channels know, walked through the real server: none lets an
anonymous caller in, and the worker-agent token opens only register, heartbeat and
deregister. A new view or endpoint is covered the day it is added; one that should be
public must be named in PUBLIC below, on purpose."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import websockets
from django.urls import URLPattern, URLResolver, get_resolver
from django.urls.resolvers import RegexPattern, RoutePattern

from controlpanel.asgi import websocket_urlpatterns
from tests.support.common import AGENT_HEADERS
from tests.support.servers import RouterServer

pytestmark = pytest.mark.django_db(transaction=True)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
# Open to everyone, by design, whatever the method: logging in and out, the API's
# description (no data in it), and ninja's empty root (an OpenAI-style 404).
PUBLIC = {
    "/admin/login/",
    "/admin/logout/",  # a redirect to /admin/, which asks for the login
    "/api/openapi.json",
    "/api/docs",
    "/api/",
    "/favicon.ico",  # a redirect to the static icon
    "/metrics/control-plane",  # for Prometheus, open like the routers' /metrics: no secret
}
PUBLIC_STATUS = {"/admin/logout/": 302, "/api/": 404, "/favicon.ico": 301}
AGENT_CALLS = {
    ("POST", "/api/workers/register"),
    ("POST", "/api/workers/1/heartbeat"),
    ("POST", "/api/workers/1/deregister"),
}
CONVERTER_SAMPLES = {"int": "1", "str": "x", "path": "1", "slug": "x", "uuid": "0" * 32}
LOGIN = "/admin/login/"


def sample_route(route: str) -> str:
    """A concrete path for a `path()` route: each `<converter:name>` by a sample value."""

    def value(match: re.Match[str]) -> str:
        converter = match.group(1) or "str"
        return CONVERTER_SAMPLES[converter]

    return re.sub(r"<(?:(\w+):)?\w+>", value, route)


def sample_regex(regex: str) -> str:
    """A concrete path for a `re_path()`: groups by their first alternative or a sample."""
    text = regex.lstrip("^").rstrip("$")
    text = re.sub(r"\(\?P<\w+>(\w+)(?:\|[\w|]+)?\)", r"\1", text)  # (?P<x>auth|cp) -> auth
    text = re.sub(r"\(\?P<\w+>[^)]*\)", "x", text)  # (?P<url>.*) -> x
    assert re.fullmatch(regex.lstrip("^"), text), f"no sample for {regex!r}; teach the walker"
    return text


def walk(patterns: list[URLPattern | URLResolver], prefix: str = "") -> Iterator[str]:
    for entry in patterns:
        pattern = entry.pattern
        if isinstance(pattern, RoutePattern):
            piece = sample_route(str(pattern))
        elif isinstance(pattern, RegexPattern):
            piece = sample_regex(pattern.regex.pattern)
        else:
            raise AssertionError(f"unknown pattern type {type(pattern)}: teach the walker")
        if isinstance(entry, URLResolver):
            yield from walk(entry.url_patterns, prefix + piece)
        else:
            yield "/" + prefix + piece


def every_path() -> list[str]:
    return sorted(set(walk(get_resolver().url_patterns)))


def refused(response: httpx.Response) -> bool:
    """Turned away before any work: no credentials (401), forbidden (403), no such method
    (405), or a browser sent to the login page."""
    if response.status_code in (401, 403, 405):
        return True
    location = response.headers.get("location", "")
    return response.status_code == 302 and urlsplit(location).path == LOGIN


def test_the_walk_covers_the_surfaces_it_must() -> None:
    paths = every_path()
    for expected in ("/", "/keys/", "/usage/", "/api/keys", "/api/workers/1/drain", "/admin/"):
        assert expected in paths
    assert len(paths) > 80


def with_csrf_token(client: httpx.Client) -> None:
    """A valid CSRF cookie and header on every request, so what refuses a POST is the view's
    own login check, not the CSRF middleware in front of it."""
    client.get(LOGIN)
    client.headers["X-CSRFToken"] = client.cookies["csrftoken"]


def test_every_url_refuses_an_anonymous_caller(router: RouterServer) -> None:
    failures = []
    with httpx.Client(base_url=router.url, timeout=10) as client:
        with_csrf_token(client)
        for path in every_path():
            for method in METHODS:
                if path in PUBLIC:
                    continue
                response = client.request(method, path, json={})
                if not refused(response):
                    failures.append(f"{method} {path} -> {response.status_code}")
    assert not failures, "\n".join(failures)


def test_the_worker_token_opens_only_the_agent_calls(router: RouterServer) -> None:
    failures = []
    with httpx.Client(base_url=router.url, timeout=10, headers=AGENT_HEADERS) as client:
        with_csrf_token(client)
        for path in every_path():
            for method in METHODS:
                if path in PUBLIC:
                    continue
                response = client.request(method, path, json={})
                if (method, path) in AGENT_CALLS:
                    # Let in: the answer is about the request (no such worker, bad body).
                    assert response.status_code in (404, 422), (path, response.text)
                elif not refused(response):
                    failures.append(f"{method} {path} -> {response.status_code}")
    assert not failures, "\n".join(failures)


def test_public_paths_hold_nothing_but_the_login_and_the_api_description(
    router: RouterServer,
) -> None:
    for path in PUBLIC:
        response = httpx.get(router.url + path, timeout=10)
        assert response.status_code == PUBLIC_STATUS.get(path, 200), path
    assert "password" in httpx.get(router.url + LOGIN).text  # the login form, nothing else


def test_every_websocket_refuses_an_anonymous_caller(router: RouterServer) -> None:
    paths = [sample_route(str(p.pattern)) for p in websocket_urlpatterns]
    assert "ws/fleet/" in paths
    ws_url = router.url.replace("http://", "ws://")

    async def attempt(path: str, headers: dict[str, str]) -> int | None:
        try:
            async with websockets.connect(
                f"{ws_url}/{path}",
                origin=router.url,
                additional_headers=headers,  # type: ignore[arg-type]
            ) as socket:
                await socket.recv()
        except websockets.InvalidStatus as exc:
            return exc.response.status_code
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd else None
        return 200

    for path in paths:
        for headers in ({}, AGENT_HEADERS):
            status = asyncio.run(attempt(path, headers))
            assert status in (403, 4401), (path, headers, status)
