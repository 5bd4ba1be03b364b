"""KV cache events end to end: simulated vLLM servers that publish them (a config with its
own ports), workers registered with their endpoints, and the router's view of each worker's
stream and index as /list_workers shows it, waited on until it holds what the simulator's
prefix cache holds."""

from __future__ import annotations

from typing import Any

import httpx

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from simulator.server import RunningSimulator
from tests.support.servers import RouterServer, SimulatorLoop, free_port, wait_until

MODEL = "kv-m"
BS = 4


def kv_config(replay: bool = True, **extra: Any) -> dict[str, Any]:
    ports = {"kv_events_port": free_port()}
    if replay:
        ports["kv_events_replay_port"] = free_port()
    return {"block_size": BS, "cache_blocks": 8, **ports, **extra}


def endpoints(sim: RunningSimulator) -> dict[str, str]:
    config = sim.state.config
    replay = config.kv_events_replay_port
    return {
        "kv_events": f"tcp://127.0.0.1:{config.kv_events_port}",
        "kv_events_replay": f"tcp://127.0.0.1:{replay}" if replay else "",
    }


def add_kv_worker(router: RouterServer, sim: RunningSimulator, name: str) -> Worker:
    worker = services.worker_add(url=sim.url, name=name, actor="test", **endpoints(sim))
    router.wait_routable(worker)
    return worker


def shown(seen: dict[int, dict[str, Any]], worker: Worker) -> dict[str, Any]:
    """A worker's stream in a /list_workers answer ({} until the router subscribes)."""
    kv: dict[str, Any] = seen[worker.pk]["kv_events"] or {}
    return kv


def stream(router: RouterServer, worker: Worker) -> dict[str, Any]:
    return shown(router.workers(), worker)


def index_of(router: RouterServer, worker: Worker) -> dict[str, Any]:
    kv: dict[str, Any] = stream(router, worker).get("index") or {}
    return kv


def wait_stream(router: RouterServer, worker: Worker, **expected: Any) -> None:
    """Until the worker's stream shows these values (`index_x`: its index's x;
    `at_least_x`: x at least the value)."""

    def matches(seen: dict[int, dict[str, Any]]) -> bool:
        kv = shown(seen, worker)
        for key, value in expected.items():
            if key.startswith("at_least_"):
                if (kv.get(key.removeprefix("at_least_")) or 0) < value:
                    return False
            elif key.startswith("index_"):
                if (kv.get("index") or {}).get(key.removeprefix("index_")) != value:
                    return False
            elif kv.get(key) != value:
                return False
        return True

    router.wait_for(matches)


def wait_ready(router: RouterServer, worker: Worker) -> None:
    wait_stream(router, worker, connected=True, index_trust="ready")


def prompt(tag: str, words: int = 12) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))  # completions: one token per word


def complete(router: RouterServer, text: str) -> dict[str, Any]:
    answer = router.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def wait_same_blocks(router: RouterServer, worker: Worker, sim: RunningSimulator) -> None:
    """The router's index holds exactly the blocks the simulator's cache holds."""
    wait_until(
        lambda: (
            index_of(router, worker).get("trust") == "ready"
            and index_of(router, worker).get("blocks") == len(sim.state.prefix_cache)
        )
    )


def clear_cache(sim: RunningSimulator) -> bool:
    """vLLM's /reset_prefix_cache: the engine publishes AllBlocksCleared."""
    return httpx.post(sim.url + "/reset_prefix_cache").status_code == 200


def on_sim_loop(sim_loop: SimulatorLoop, call: Any) -> Any:
    """ZeroMQ sockets belong to one thread: touch the simulator's from its loop."""

    async def run() -> Any:
        return call()

    return sim_loop.run(run())
