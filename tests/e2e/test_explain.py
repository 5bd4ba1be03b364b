"""Routing explained: the X-Route-Explain header per policy, the admin dry run, the ring of
recent decisions, through the real router with simulated workers."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from controlpanel.fleet import served_models, services
from controlpanel.registry.models import Worker
from simulator.server import RunningSimulator
from tests.support.common import ADMIN_HEADERS
from tests.support.keyed import add_keyed_worker, bearer, issue
from tests.support.servers import RouterServer, StartSimulator, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
EXPLAIN = {"X-Route-Explain": "1"}
KEYS = {"model", "target", "policy", "decision", "worker", "candidates", "attempts"}


def fleet(
    router: RouterServer, simulator: StartSimulator, n: int = 3
) -> tuple[list[RunningSimulator], list[Worker]]:
    sims = [simulator("m") for _ in range(n)]
    workers = [
        services.worker_add(url=s.url, name=f"w{i}", actor="test") for i, s in enumerate(sims)
    ]
    router.wait_routable(*workers)
    return sims, workers


def use(router: RouterServer, policy: str, **config: Any) -> None:
    served_models.served_model_set_policy(name="m", policy=policy, policy_config=config, actor="t")
    # The gauge of the policy in use: other families keep earlier policies' labels.
    applied = f'controlpanel_router_model_policy{{model="m",policy="{policy}"}}'
    wait_until(lambda: applied in router.get("/metrics").text)


def chat(
    router: RouterServer, text: str = "hi", headers: dict[str, str] | None = None, **body: Any
) -> httpx.Response:
    payload = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return httpx.post(
        f"{router.url}/v1/chat/completions",
        json={**payload, **body},
        headers=headers or {},
        timeout=30,
    )


def explained(
    router: RouterServer, sims: list[RunningSimulator], text: str = "hi", **headers: str
) -> tuple[dict[str, Any], str]:
    """The explanation of one request, and the name of the worker that really got it."""
    before = [s.state.received for s in sims]
    response = chat(router, text, headers={**EXPLAIN, **headers})
    assert response.status_code == 200, response.text
    got = [i for i, s in enumerate(sims) if s.state.received > before[i]]
    assert len(got) == 1
    value = response.headers["x-route-explain"]
    assert len(value.encode()) < 4096
    body: dict[str, Any] = orjson.loads(value)
    assert set(body) >= KEYS, body
    assert 1 <= len(body["candidates"]) <= 8
    return body, f"w{got[0]}"


def test_no_header_unless_asked(router: RouterServer, simulator: StartSimulator) -> None:
    fleet(router, simulator)
    assert "x-route-explain" not in chat(router).headers
    assert "x-route-explain" not in chat(router, headers={"X-Route-Explain": "0"}).headers


def test_shortest_queue_explains_the_least_loaded_choice(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "shortest_queue")
    body, actual = explained(router, sims)
    assert body["worker"] == actual and body["policy"] == "shortest_queue"
    assert body["decision"] == "load" and body["model"] == "m" and body["target"] is None
    loads = {c["worker"]: c["load"] for c in body["candidates"]}
    assert loads[actual] == min(loads.values())
    assert body["attempts"] == [{"worker": actual, "moved_on": None}]


def test_round_robin_explains_whose_turn_it_was(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "round_robin")
    for _ in range(4):
        body, actual = explained(router, sims)
        assert body["decision"] == "turn" and body["worker"] == actual
        assert body["candidates"][0] == {**body["candidates"][0], "worker": actual, "turn": 0}


def test_random_and_power_of_two_show_their_odds_and_loads(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, workers = fleet(router, simulator)
    services.worker_update(worker_id=workers[0].pk, name=None, weight=3.0, actor="t")
    use(router, "random")
    body, actual = explained(router, sims)
    assert body["decision"] == "weighted" and body["worker"] == actual
    shares = {c["worker"]: c["share"] for c in body["candidates"]}
    assert shares == {"w0": 0.6, "w1": 0.2, "w2": 0.2}
    use(router, "power_of_two")
    body, actual = explained(router, sims)
    assert body["decision"] == "two_choices" and body["worker"] == actual
    assert {"worker", "load"} <= set(body["candidates"][0])


def test_least_kv_explains_a_fallback_without_metrics(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "least_kv")
    body, actual = explained(router, sims)
    assert body["decision"] == "fallback" and body["worker"] == actual
    assert all(c["kv_cache_usage"] is None for c in body["candidates"])


def test_session_affinity_explains_the_sessions_rank(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "session_affinity")
    for session in ("alice", "bob", "carol"):
        body, actual = explained(router, sims, **{"X-Session-ID": session})
        assert body["decision"] == "affinity" and body["worker"] == actual
        assert [c["rank"] for c in body["candidates"]] == [0, 1, 2]
        assert body["candidates"][0]["worker"] == actual


def test_prefix_aware_explains_the_matched_prefix(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "prefix_aware")
    doc = " ".join(f"word{i}" for i in range(300))
    first, home = explained(router, sims, doc + " first")
    assert first["decision"] == "miss" and first["worker"] == home
    assert all(c["matched_bytes"] == 0 for c in first["candidates"])
    second, again = explained(router, sims, doc + " second")
    assert second["decision"] == "prefix" and again == home == second["worker"]
    top = second["candidates"][0]
    assert top["worker"] == home and top["matched_bytes"] >= 0.5 * top["prompt_bytes"]
    assert all(c["matched_bytes"] == 0 for c in second["candidates"][1:])


def test_an_alias_is_explained_with_its_target(
    router: RouterServer, simulator: StartSimulator
) -> None:
    from controlpanel.rollouts import aliases

    fleet(router, simulator)
    aliases.alias_create(name="chat", targets={"m": 100}, actor="t")
    wait_until(lambda: "chat" in router.get("/list_models").text)
    response = httpx.post(
        f"{router.url}/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        headers=EXPLAIN,
    )
    body = orjson.loads(response.headers["x-route-explain"])
    assert (body["model"], body["target"]) == ("chat", "m")


def test_a_retry_says_why_it_moved_on(router: RouterServer, simulator: StartSimulator) -> None:
    sims, _ = fleet(router, simulator, n=2)
    use(router, "round_robin")
    sims[0].state.fail_ratio, sims[0].state.fail_status = 1.0, 503
    for _ in range(2):  # one of the two lands on w0 first
        body = orjson.loads(chat(router, headers=EXPLAIN).headers["x-route-explain"])
        if len(body["attempts"]) == 2:
            break
    assert body["attempts"] == [
        {"worker": "w0", "moved_on": "status_503"},
        {"worker": "w1", "moved_on": None},
    ]
    assert body["worker"] == "w0"  # the policy's pick; the answer came from the next attempt


def test_the_dry_run_changes_nothing(router: RouterServer, simulator: StartSimulator) -> None:
    sims, _ = fleet(router, simulator)
    use(router, "prefix_aware")
    doc = " ".join(f"dry{i}" for i in range(300))
    body = {"model": "m", "messages": [{"role": "user", "content": doc}]}
    before_metrics = router.get("/metrics").text
    received = [s.state.received for s in sims]
    for _ in range(3):
        answer = router.post("/api/route/explain", json=body, headers=ADMIN_HEADERS)
        assert answer.status_code == 200, answer.text
        told = answer.json()
        assert told["dry_run"] is True and told["decision"] == "miss", told
        assert all(c["matched_bytes"] == 0 for c in told["candidates"])  # nothing learned
    assert [s.state.received for s in sims] == received  # nothing forwarded

    def counters(text: str) -> list[str]:
        return sorted(
            line
            for line in text.splitlines()
            if line.startswith(
                ("controlpanel_router_requests_total", "controlpanel_router_policy_decisions_total")
            )
        )

    assert counters(router.get("/metrics").text) == counters(before_metrics)
    # The real request after it is a miss too: the dry runs taught the index nothing.
    real = orjson.loads(chat(router, doc, headers=EXPLAIN).headers["x-route-explain"])
    assert real["decision"] == "miss"
    assert (
        router.post("/api/route/explain", json={"messages": []}, headers=ADMIN_HEADERS).status_code
        == 422
    )
    assert (
        router.post("/api/route/explain", json={"model": "nope"}, headers=ADMIN_HEADERS).status_code
        == 404
    )
    assert router.post("/api/route/explain", json=body).status_code == 401


def test_recent_decisions_are_kept_per_model_and_bounded(
    router: RouterServer, simulator: StartSimulator
) -> None:
    fleet(router, simulator, n=2)
    use(router, "round_robin")
    for i in range(55):
        chat(router, f"hi {i}", headers=EXPLAIN if i == 54 else None)
    recent = router.get("/api/route/decisions?model=m", headers=ADMIN_HEADERS).json()["m"]
    assert len(recent) == 50
    assert recent[0]["explanation"]["decision"] == "turn"  # the newest asked for one
    assert all(e["explanation"] is None for e in recent[1:])
    assert [e["at"] for e in recent] == sorted((e["at"] for e in recent), reverse=True)
    assert {e["worker"] for e in recent} == {"w0", "w1"} and {e["decision"] for e in recent} == {
        "turn"
    }


def test_with_keys_on_only_a_key_with_the_permission_gets_the_explanation(
    keyed_router: RouterServer, simulator: StartSimulator
) -> None:
    plain = issue(keyed_router, "plain")
    allowed = issue(keyed_router, "explainer", can_explain=True)
    add_keyed_worker(keyed_router, simulator("m"), plain)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def ask(key: str) -> httpx.Response:
        headers = {**bearer(key), **EXPLAIN}
        return httpx.post(f"{keyed_router.url}/v1/chat/completions", json=body, headers=headers)

    ignored = ask(plain)
    assert ignored.status_code == 200 and "x-route-explain" not in ignored.headers  # no error
    told = ask(allowed)
    assert told.status_code == 200 and orjson.loads(told.headers["x-route-explain"])["worker"]
    listed = keyed_router.get("/api/keys", headers=ADMIN_HEADERS).json()
    assert {k["name"]: k["explain"] for k in listed} == {"plain": False, "explainer": True}
    made = keyed_router.post(
        "/api/keys", json={"name": "api-made", "explain": True}, headers=ADMIN_HEADERS
    )
    assert made.status_code == 201 and made.json()["explain"] is True
