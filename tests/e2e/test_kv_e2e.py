"""End to end: simulated vLLM servers publish KV cache events over real ZeroMQ sockets, and
the session's router (a real uvicorn process) subscribes and indexes them.

The router's view is read where an operator reads it: /list_workers (each worker's
`kv_events`) and /metrics. "Exact" is checked against the simulator's own prefix cache: the
router holds as many blocks as the simulator does, through evictions and restarts; through lost
connections, gaps and bad batches in tests/e2e/test_kv_stream_faults.py."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq.asyncio
from tokenizers import Tokenizer

from controlpanel.registry.models import Worker
from harness.tokenizer_folder import make_tokenizer_folder, rendered_chat
from routing.kv.kv_index import KvIndex
from routing.kv.kv_stream import KvStream
from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator
from tests.support.common import ADMIN_HEADERS, ROOT
from tests.support.kv_events import (
    BS,
    MODEL,
    add_kv_worker,
    complete,
    endpoints,
    index_of,
    kv_config,
    on_sim_loop,
    prompt,
    stream,
    wait_ready,
    wait_same_blocks,
    wait_stream,
)
from tests.support.servers import (
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    start_router,
    stop_process,
    subprocess_env,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("legacy", [False, True], ids=["current-maps", "legacy-arrays"])
def test_router_indexes_a_workers_events_through_evictions(
    router: RouterServer, simulator: StartSimulator, legacy: bool
) -> None:
    sim = simulator(MODEL, **kv_config(kv_events_legacy=legacy, enable_prompt_tokens_details=True))
    worker = add_kv_worker(router, sim, "kv-a")
    wait_ready(router, worker)
    for tag in "abcde":  # 5 prompts of 3 blocks into a cache of 8: evictions on the way
        complete(router, prompt(tag))
    wait_same_blocks(router, worker, sim)
    shown = stream(router, worker)
    assert shown["events"] >= 5 + 2 and shown["batches"] == 5  # stores, then removals
    assert shown["last_seq"] == 4 and shown["malformed"] == 0
    # The simulator reports what vLLM would: the cached tokens, whole blocks short of the
    # prompt's last token (always computed): 2 of the 3 blocks held.
    assert complete(router, prompt("e"))["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    metrics = router.get("/metrics").text
    assert 'controlpanel_router_kv_events_connected{worker="kv-a"} 1.0' in metrics
    assert 'controlpanel_router_kv_index_trusted{worker="kv-a"} 1.0' in metrics
    blocks = len(sim.state.prefix_cache)
    assert f'controlpanel_router_kv_index_blocks{{worker="kv-a"}} {blocks}.0' in metrics
    assert 'controlpanel_router_kv_event_batches_total{worker="kv-a"}' in metrics


def test_every_router_holds_the_same_index(
    router: RouterServer, simulator: StartSimulator, var_dir: Path
) -> None:
    # No state is shared: each router process subscribes on its own, so they agree because
    # they read the same stream.
    second = start_router(var_dir)
    try:
        sim = simulator(MODEL, **kv_config())
        worker = add_kv_worker(router, sim, "kv-two")
        second.wait_routable(worker)
        for each in (router, second):
            wait_ready(each, worker)
        complete(router, prompt("a"))
        complete(second, prompt("b"))
        for each in (router, second):
            wait_same_blocks(each, worker, sim)
        assert index_of(router, worker) == index_of(second, worker)
    finally:
        stop_process(second.proc)


@contextlib.contextmanager
def subscribed(sim_loop: SimulatorLoop, sim: RunningSimulator) -> Iterator[KvStream]:
    """The router's own stream code, subscribed here in process (on the simulators' loop)."""
    index = KvIndex()
    ctx = zmq.asyncio.Context()
    kv = endpoints(sim)
    stream = on_sim_loop(
        sim_loop, lambda: KvStream(ctx, index, 1, kv["kv_events"], kv["kv_events_replay"])
    )
    on_sim_loop(sim_loop, stream.start)
    try:
        wait_until(lambda: stream.stats.connected and index.is_known(1))
        yield stream
    finally:
        sim_loop.run(stream.stop())
        ctx.destroy(linger=0)


def test_the_simulators_tokenize_ids_find_its_published_blocks(
    simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    # The router will look blocks up by the token ids /tokenize answers: the simulator's
    # events must carry those same ids.
    sim = simulator(MODEL, **kv_config(), loras=("lora-x",))
    with subscribed(sim_loop, sim) as stream:
        index = stream.index
        messages = [{"role": "user", "content": prompt("m", 13)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        assert httpx.post(sim.url + "/v1/chat/completions", json=body).status_code == 200
        body = {"model": "lora-x", "prompt": prompt("p"), "max_tokens": 1}
        assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 200
        chat_ids = httpx.post(sim.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        ids = httpx.post(sim.url + "/tokenize", json={"prompt": prompt("p")}).json()["tokens"]
        wait_until(lambda: stream.stats.batches == 2)
        assert index.cached_blocks(1, chat_ids) == 14 // BS  # the role is a token too
        assert index.cached_blocks(1, ids, "lora-x") == 3  # the adapter's own chain
        assert index.cached_blocks(1, ids) == 0  # not the base model's


def test_a_simulator_with_a_tokenizer_folder_tokenizes_as_vllm(
    simulator: StartSimulator, sim_loop: SimulatorLoop, tmp_path: Path
) -> None:
    # A real tokenizers tokenizer, trained here: the chat template rendered, then encoded
    # without adding specials (the template has them); a plain prompt with them.
    folder = make_tokenizer_folder(tmp_path / "tokenizer")
    truth = Tokenizer.from_file(str(folder / "tokenizer.json"))
    sim = simulator(MODEL, **kv_config(cache_blocks=64), tokenizer=str(folder))
    messages = [{"role": "system", "content": "you are a helpful assistant " * 6},
                {"role": "user", "content": "tell me about the printing press"}]  # fmt: skip
    expected = truth.encode(rendered_chat(messages), add_special_tokens=False).ids
    with subscribed(sim_loop, sim) as stream:
        said = httpx.post(sim.url + "/tokenize", json={"model": MODEL, "messages": messages})
        assert said.json()["tokens"] == expected and said.json()["count"] == len(expected)
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        answer = httpx.post(sim.url + "/v1/chat/completions", json=body).json()
        assert answer["usage"]["prompt_tokens"] == len(expected)
        wait_until(lambda: stream.stats.batches == 1)
        assert stream.index.cached_blocks(1, expected) == len(expected) // BS
        text = "the quick brown fox"
        ids = httpx.post(sim.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert ids == truth.encode(text).ids and ids[0] == truth.token_to_id("<s>")
        detok = httpx.post(sim.url + "/detokenize", json={"tokens": ids[1:]}).json()["prompt"]
        assert detok == text
    bad = [{"role": "tool", "content": "x"}]  # the template raises for this role
    refused = httpx.post(sim.url + "/tokenize", json={"messages": bad})
    assert refused.status_code == 400 and "Only system, user and assistant" in refused.text


def test_a_worker_restart_empties_its_index(router: RouterServer, sim_loop: SimulatorLoop) -> None:
    config = SimConfig(model=MODEL, ttft_ms=1, itl_ms=1, **kv_config())
    sim = sim_loop.run(start_simulator(config))
    try:
        worker = add_kv_worker(router, sim, "kv-restart")
        wait_ready(router, worker)
        complete(router, prompt("a"))
        wait_same_blocks(router, worker, sim)
        assert index_of(router, worker)["blocks"] == 3
        sim_loop.run(sim.stop())  # the engine goes away and comes back, cache empty
        sim = sim_loop.run(start_simulator(config, port=sim.port))
        wait_stream(
            router, worker, at_least_disconnects=1, connected=True, index_trust="ready",
            index_blocks=0,
        )  # fmt: skip
        complete(router, prompt("b", 8))
        wait_same_blocks(router, worker, sim)
        assert index_of(router, worker)["blocks"] == 2
    finally:
        sim_loop.run(sim.stop())


def test_the_admin_api_validates_and_returns_kv_endpoints(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator(MODEL)
    bad = httpx.post(
        router.url + "/api/workers",
        json={"url": sim.url, "kv_events": "tcp://*:5557"},
        headers=ADMIN_HEADERS,
    )
    assert bad.status_code == 422, bad.text
    assert "kv_events must be tcp://host:port" in bad.json()["error"]["message"]
    assert not Worker.objects.exists()
    added = httpx.post(
        router.url + "/api/workers",
        json={"url": sim.url, "kv_events": "tcp://127.0.0.1:5557"},
        headers=ADMIN_HEADERS,
        timeout=10,
    )
    assert added.status_code == 201, added.text
    worker_id = added.json()["id"]
    assert (added.json()["kv_events"], added.json()["kv_events_replay"]) == (
        "tcp://127.0.0.1:5557",
        "",
    )
    path = f"{router.url}/api/workers/{worker_id}"

    def patch(body: dict[str, str]) -> httpx.Response:
        return httpx.patch(path, json=body, headers=ADMIN_HEADERS, timeout=10)

    for body, message in [
        ({"kv_events": "http://gpu-1:5557"}, "kv_events must be"),
        ({"kv_events_replay": "tcp://gpu-1:99999"}, "kv_events_replay must be"),
    ]:
        refused = patch(body)
        assert refused.status_code == 422 and message in refused.json()["error"]["message"]
    assert patch({"kv_events_replay": "ipc:///tmp/replay"}).status_code == 200
    refused = patch({"kv_events": ""})  # the replay endpoint would be left without a stream
    assert refused.status_code == 422, refused.text
    assert "kv_events_replay needs kv_events" in refused.json()["error"]["message"]
    # The router follows: it subscribes to the endpoint set, and stops when it is removed.
    router.wait_for(
        lambda seen: (
            (seen[worker_id]["kv_events"] or {}).get("replay_endpoint") == "ipc:///tmp/replay"
        )
    )
    cleared = patch({"kv_events": "", "kv_events_replay": ""})
    assert cleared.status_code == 200 and cleared.json()["kv_events"] == ""
    assert Worker.objects.get(pk=worker_id).kv_events_replay == ""
    router.wait_for(lambda seen: seen[worker_id]["kv_events"] is None)


def test_worker_agent_registers_its_kv_events_endpoint(
    router: RouterServer, simulator: StartSimulator, tmp_path: Path
) -> None:
    sim = simulator(MODEL, **kv_config(replay=False))
    command = [sys.executable, "manage.py", "worker_agent", "--controller", router.url,
               "--worker-url", sim.url, "--interval", "0.5", "--name", "kv-agent"]  # fmt: skip
    env = subprocess_env(tmp_path)
    refused = subprocess.run(
        [*command, "--kv-events", "tcp://gpu-1"], cwd=ROOT, env=env, capture_output=True
    )
    assert refused.returncode != 0 and b"kv_events must be" in refused.stderr
    proc = subprocess.Popen(
        [*command, "--kv-events", endpoints(sim)["kv_events"]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        worker = wait_until(lambda: Worker.objects.filter(name="kv-agent").first())
        assert worker.kv_events == endpoints(sim)["kv_events"]
        wait_stream(router, worker, connected=True)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
