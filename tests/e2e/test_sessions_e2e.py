"""Agent sessions through the real router (routing.sessions), sent by the official `openai`
client with each agent's own session header: a session keeps its worker, through two
router replicas alike; a saturated pool's turns go by key weight and, within a key, equally
between its sessions; the access log and X-Route-Explain show the session as a hash."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controlpanel.fleet import services
from routing.sessions import Session
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS, REDIS_URL, needs_redis
from tests.support.keyed import add_keyed_worker, issue, openai_client
from tests.support.policies import fleet, policy_in_use, use_policy
from tests.support.servers import (
    AddWorker,
    RouterServer,
    StartSimulator,
    start_router,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)
AGENT_HEADERS = {
    "claude-code": "x-claude-code-session-id",
    "opencode": "x-session-affinity",
    "codex": "session-id",
    "codex-old": "session_id",
    "ours": "X-Session-ID",
}
MESSAGES: Any = [{"role": "user", "content": "fix the failing test"}]


def ask(client: openai.OpenAI, model: str = "m", **headers: str) -> None:
    client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_headers=headers
    )


def homes(sims: list[RunningSimulator], send: Any) -> list[int]:
    """How many of the requests `send` makes each simulator received."""
    before = [sim.state.received for sim in sims]
    send()
    return [sim.state.received - b for sim, b in zip(sims, before, strict=True)]


@pytest.mark.parametrize("header", AGENT_HEADERS.values(), ids=AGENT_HEADERS.keys())
def test_each_agents_session_stays_on_its_worker(
    router: RouterServer,
    simulator: StartSimulator,
    add_worker: AddWorker,
    client: openai.OpenAI,
    header: str,
) -> None:
    sims, _ = fleet(simulator, add_worker)
    use_policy(router, "m", "session_affinity")
    used = set()
    for n in range(12):
        session = f"{header}-{n}-{uuid.uuid4()}"
        spread = homes(sims, lambda s=session: [ask(client, **{header: s}) for _ in range(3)])
        assert sorted(spread) == [0, 0, 3], spread  # every turn on the session's one worker
        used.add(spread.index(3))
    # Sessions spread over the workers: 12 random keys all on one of 3 is 3^-11, where 6
    # (1/243) failed once in a few dozen runs of the five headers.
    assert len(used) >= 2


def test_the_list_order_decides_which_header_counts(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker, client: openai.OpenAI
) -> None:
    """Claude Code's header outranks Codex's (the default list), whatever Codex's says."""
    sims, _ = fleet(simulator, add_worker)
    use_policy(router, "m", "session_affinity")
    alone = homes(sims, lambda: ask(client, **{"x-claude-code-session-id": "cc-1"}))
    for codex in ("codex-a", "codex-b", "codex-c", "codex-d"):
        both = {"x-claude-code-session-id": "cc-1", "session_id": codex}
        assert homes(sims, lambda h=both: ask(client, **h)) == alone


def test_a_session_overflows_only_while_its_worker_is_saturated(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker, client: openai.OpenAI
) -> None:
    sims = [simulator("m", ttft_ms=1500) for _ in range(2)]
    for i, sim in enumerate(sims):
        add_worker(sim, name=f"w{i}")
    use_policy(router, "m", "session_affinity", max_load=0)  # one request saturates a worker
    header = {"x-session-affinity": "opencode-busy"}
    home = homes(sims, lambda: ask(client, **header)).index(1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        busy = pool.submit(ask, client, "m", **header)
        wait_until(lambda: sims[home].state.running >= 1)
        assert homes(sims, lambda: ask(client, **header))[1 - home] == 1  # overflows
        busy.result(timeout=60)
    assert homes(sims, lambda: ask(client, **header))[home] == 1  # and comes back home


def test_access_log_and_explain_show_the_session_as_a_hash(
    router: RouterServer, simulator: StartSimulator, add_worker: AddWorker, client: openai.OpenAI
) -> None:
    fleet(simulator, add_worker, n=2)
    use_policy(router, "m", "session_affinity")
    secret_session = f"private-{uuid.uuid4()}"
    shown = Session(secret_session, "x-claude-code-session-id").shown()
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, max_tokens=2,
        extra_headers={"x-claude-code-session-id": secret_session, "X-Route-Explain": "1",
                       "X-Request-ID": f"sess-{shown['hash']}"},
    )  # fmt: skip
    explained = json.loads(raw.headers["x-route-explain"])
    assert explained["session"] == shown
    assert explained["decision"] == "affinity"

    def line() -> dict[str, Any] | None:
        for text in router.log().splitlines():
            if f'"request_id":"sess-{shown["hash"]}"' in text:
                found: dict[str, Any] = json.loads(text[text.index("{") :])
                return found
        return None

    logged = wait_until(line)
    assert logged["session"] == shown
    without = client.chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, max_tokens=2, extra_headers={"X-Route-Explain": "1"}
    )
    assert json.loads(without.headers["x-route-explain"])["session"] is None
    dry = httpx.post(
        f"{router.url}/api/route/explain",
        json={"model": "m", "messages": MESSAGES},
        headers={**ADMIN_HEADERS, "x-session-affinity": secret_session},
    )
    assert dry.status_code == 200, dry.text
    assert dry.json()["session"] == {"hash": shown["hash"], "from": "x-session-affinity"}
    assert secret_session not in router.log()


# --- two replicas --------------------------------------------------------------------------


@pytest.fixture
def two_routers(tmp_path: Path) -> Iterator[list[RouterServer]]:
    started = [start_router(tmp_path, REDIS_URL=REDIS_URL) for _ in range(2)]
    yield started
    for server in started:
        stop_process(server.proc)


@needs_redis
def test_two_replicas_place_every_agents_session_alike(
    two_routers: list[RouterServer], simulator: StartSimulator
) -> None:
    """Nothing is looked up: the ring is a function of the key and the worker ids, so the
    replicas agree from a session's first request on, whichever replica it reaches."""
    sims = [simulator("m") for _ in range(4)]
    workers = [services.worker_add(url=sim.url, actor="test") for sim in sims]
    for server in two_routers:
        server.wait_routable(*workers)
    use_policy(two_routers[0], "m", "session_affinity")
    wait_until(lambda: policy_in_use(two_routers[1], "m") == "session_affinity")
    clients = [
        openai.OpenAI(base_url=f"{r.url}/v1", api_key="-", max_retries=0) for r in two_routers
    ]
    placed: dict[tuple[str, int], set[int]] = {}
    for header in AGENT_HEADERS.values():
        for n in range(5):
            session = f"{n}-{uuid.uuid4()}"
            for turn in range(4):  # alternate replicas, new session first on either
                replica = clients[(turn + n) % 2]
                spread = homes(sims, lambda c=replica, h=header, s=session: ask(c, **{h: s}))
                placed.setdefault((header, n), set()).add(spread.index(1))
    assert all(len(homes_) == 1 for homes_ in placed.values()), placed
    assert len({next(iter(h)) for h in placed.values()}) >= 3  # spread, not all on one


# --- the fair queue: by key weight, then equally between a key's sessions -----------------

WARMUP_S, WINDOW_S = 2.0, 8.0


@pytest.fixture
def saturated_router(tmp_path: Path) -> Iterator[RouterServer]:
    server = start_router(
        tmp_path,
        CONTROLPANEL_REQUIRE_API_KEY="1",
        CONTROLPANEL_MAX_INFLIGHT_PER_WORKER="4",
        CONTROLPANEL_QUEUE_TIMEOUT="60",
    )
    yield server
    stop_process(server.proc)


def agents_loop(
    server: RouterServer, secret: str, headers: dict[str, str], until: float, done: list[Any]
) -> None:
    """One agent's closed loop through the openai client: (its name, when each answer
    ended); any error fails the test through the pool's result."""
    with openai_client(server, secret) as client:
        while time.monotonic() < until:
            stream = client.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=6, stream=True, extra_headers=headers
            )
            for _ in stream:
                pass
            done.append((json.dumps(headers, sort_keys=True), time.monotonic()))


def run_agents(server: RouterServer, loops: list[tuple[str, dict[str, str]]]) -> Counter[str]:
    """Every loop at once for the window: completions per agent (its headers) in it."""
    done: list[tuple[str, float]] = []
    start = time.monotonic()
    until = start + WARMUP_S + WINDOW_S
    with ThreadPoolExecutor(max_workers=len(loops)) as pool:
        futures = [pool.submit(agents_loop, server, s, h, until, done) for s, h in loops]
        for future in futures:
            future.result()
    return Counter(agent for agent, at in done if start + WARMUP_S <= at < until)


def saturated_pool(server: RouterServer, simulator: StartSimulator) -> str:
    everything = issue(server, "all")
    add_keyed_worker(server, simulator("m", ttft_ms=40, itl_ms=15, max_batch=64), everything)
    return everything


def test_two_agents_of_weights_3_and_1_share_a_saturated_pool_by_weight(
    saturated_router: RouterServer, simulator: StartSimulator
) -> None:
    saturated_pool(saturated_router, simulator)
    heavy = issue(saturated_router, "claude", weight=3)
    light = issue(saturated_router, "codex", weight=1)
    claude = {"x-claude-code-session-id": str(uuid.uuid4())}
    codex = {"session_id": str(uuid.uuid4())}
    # The same client each (6 open requests against 4 slots): what a new user does.
    counted = run_agents(saturated_router, [(heavy, claude)] * 6 + [(light, codex)] * 6)
    share = counted[json.dumps(claude)] / sum(counted.values())
    assert 0.65 <= share <= 0.85, (share, counted)  # 0.75, give or take a few hundred turns


def test_one_keys_agents_share_its_turns_equally_however_hard_one_sends(
    saturated_router: RouterServer, simulator: StartSimulator
) -> None:
    saturated_pool(saturated_router, simulator)
    team = issue(saturated_router, "team")
    busy = {"x-claude-code-session-id": str(uuid.uuid4())}
    quiet = {"x-session-affinity": str(uuid.uuid4())}
    # Three times the open requests: by requests sent it would take 0.75 of the pool.
    counted = run_agents(saturated_router, [(team, busy)] * 9 + [(team, quiet)] * 3)
    share = counted[json.dumps(quiet)] / sum(counted.values())
    assert 0.38 <= share <= 0.62, (share, counted)
