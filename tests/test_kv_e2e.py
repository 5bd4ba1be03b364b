"""End to end: simulated vLLM servers publish KV cache events over real ZeroMQ sockets, and
the session's router (a real uvicorn process) subscribes and indexes them.

The router's view is read where an operator reads it: /list_workers (each worker's
`kv_events`) and /metrics. "Exact" is checked against the simulator's own prefix cache: the
router holds as many blocks as the simulator does, through evictions, gaps and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq.asyncio
from tokenizers import Tokenizer

from controlpanel.fleet import services
from controlpanel.registry.models import Worker
from routing.kv_index import KvIndex
from routing.kv_stream import KvStream
from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator
from tests.conftest import (
    ADMIN_HEADERS,
    ROOT,
    RouterServer,
    SimulatorLoop,
    StartSimulator,
    free_port,
    start_router,
    stop_process,
    subprocess_env,
    wait_until,
)
from tests.tokenizer_folder import make_tokenizer_folder, rendered_chat

pytestmark = pytest.mark.django_db(transaction=True)

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


class TcpProxy:
    """A TCP relay in front of a simulator's PUB socket; cut() drops every connection, as
    a network blip would, while the engine behind it keeps running."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


def test_a_lost_connection_resumes_when_the_engine_is_the_same(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    # The engine keeps only 3 batches for replay, so a rebuild from its first batch could
    # not succeed: after the blip the router must recognise the engine and replay only
    # what it missed.
    sim = simulator(MODEL, **kv_config(kv_events_buffer=3, cache_blocks=64))
    proxy = TcpProxy(sim.state.config.kv_events_port)
    sim_loop.run(proxy.start())
    try:
        kv = {**endpoints(sim), "kv_events": f"tcp://127.0.0.1:{proxy.port}"}
        worker = services.worker_add(url=sim.url, name="kv-blip", actor="test", **kv)
        router.wait_routable(worker)
        wait_ready(router, worker)
        for tag in "abcde":
            complete(router, prompt(tag))
        wait_same_blocks(router, worker, sim)
        on_sim_loop(sim_loop, proxy.cut)
        wait_stream(router, worker, at_least_disconnects=1)
        complete(router, prompt("f"))  # published while the router may be away
        wait_stream(router, worker, connected=True, index_trust="ready")
        wait_same_blocks(router, worker, sim)
        replays = stream(router, worker)["replays"]
        assert replays.get("resumed", 0) >= 1 and "incomplete" not in replays, replays
        assert index_of(router, worker)["blocks"] == 6 * 3
    finally:
        sim_loop.run(proxy.stop())


def test_a_malformed_batch_is_counted_and_the_worker_unknown_until_cleared(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config())
    worker = add_kv_worker(router, sim, "kv-bad")
    wait_ready(router, worker)
    complete(router, prompt("a"))
    wait_same_blocks(router, worker, sim)
    publisher = sim.state.kv_events
    assert publisher is not None
    on_sim_loop(sim_loop, lambda: publisher.send_raw(publisher.next_seq(), b"\xc1 not msgpack"))
    wait_stream(router, worker, malformed=1)
    assert index_of(router, worker)["trust"] == "unknown"  # its events are lost
    assert router.get("/health").status_code == 200
    complete(router, prompt("b"))  # the router and the stream carry on
    assert "malformed KV event batch" in router.log()
    # vLLM's /reset_prefix_cache sends AllBlocksCleared: known empty, trusted again.
    assert clear_cache(sim)
    wait_same_blocks(router, worker, sim)
    assert 'controlpanel_router_kv_events_malformed_total{worker="kv-bad"} 1.0' in (
        router.get("/metrics").text
    )


def test_a_gap_is_replayed_from_the_replay_socket(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config())
    worker = add_kv_worker(router, sim, "kv-gap")
    wait_ready(router, worker)
    publisher = sim.state.kv_events
    assert publisher is not None
    gaps = stream(router, worker)["gaps"]
    on_sim_loop(sim_loop, lambda: publisher.lose_next(1))
    complete(router, prompt("a"))  # batch 0: buffered, never sent
    complete(router, prompt("b"))  # batch 1: shows the gap
    wait_stream(router, worker, gaps=gaps + 1)
    wait_same_blocks(router, worker, sim)
    shown = stream(router, worker)
    assert shown["replays"].get("complete", 0) >= 1 and shown["last_seq"] == 1


def test_a_gap_without_replay_is_unknown_until_cleared(
    router: RouterServer, simulator: StartSimulator, sim_loop: SimulatorLoop
) -> None:
    sim = simulator(MODEL, **kv_config(replay=False))
    worker = add_kv_worker(router, sim, "kv-noreplay")
    wait_stream(router, worker, connected=True)
    # Known from the first batch the router receives: a fresh engine's batch 0 or, should the
    # subscription still be on its way when that one goes out, a reset's AllBlocksCleared.
    wait_until(lambda: clear_cache(sim) and index_of(router, worker).get("trust") == "ready")
    complete(router, prompt("a"))
    wait_same_blocks(router, worker, sim)
    publisher = sim.state.kv_events
    assert publisher is not None
    gaps = stream(router, worker)["gaps"]
    on_sim_loop(sim_loop, lambda: publisher.lose_next(1))
    complete(router, prompt("b"))
    complete(router, prompt("c"))
    wait_stream(router, worker, gaps=gaps + 1)
    assert index_of(router, worker)["trust"] == "unknown"
    assert 'controlpanel_router_kv_index_trusted{worker="kv-noreplay"} 0.0' in (
        router.get("/metrics").text
    )
    assert clear_cache(sim)
    wait_same_blocks(router, worker, sim)


def test_an_unreachable_endpoint_is_retried_with_backoff(
    router: RouterServer, simulator: StartSimulator
) -> None:
    sim = simulator(MODEL)
    port = free_port()  # nothing listens there yet
    worker = services.worker_add(
        url=sim.url, name="kv-late", kv_events=f"tcp://127.0.0.1:{port}", actor="test"
    )
    # ZeroMQ retries from 100 ms, doubling: the third retry waits at least 400 ms.
    wait_stream(router, worker, at_least_connect_retries=3, at_least_retry_interval_ms=400)
    shown = stream(router, worker)
    assert not shown["connected"] and shown["index"] is None
    assert 'controlpanel_router_kv_events_connected{worker="kv-late"} 0.0' in (
        router.get("/metrics").text
    )
    late = simulator(MODEL, kv_events_port=port, block_size=BS)  # the publisher appears
    wait_until(lambda: stream(router, worker).get("connected"), timeout=20)
    assert late.state.kv_events is not None


def test_a_socket_that_cannot_be_made_is_retried_not_fatal(sim_loop: SimulatorLoop) -> None:
    # The API refuses such endpoints; one written straight to the database still only makes
    # that stream retry (with doubling pauses) and say why.
    index = KvIndex()
    ctx = zmq.asyncio.Context()
    stream = on_sim_loop(sim_loop, lambda: KvStream(ctx, index, 1, "bogus://nowhere"))
    on_sim_loop(sim_loop, stream.start)
    try:
        wait_until(lambda: stream.stats.errors >= 3)
        assert "Protocol not supported" in (stream.stats.last_error or "")
        assert not stream.stats.connected and index.cached_blocks(1, [1, 2, 3, 4]) is None
    finally:
        sim_loop.run(stream.stop())
        ctx.destroy(linger=0)


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
        worker = wait_until(lambda: Worker.objects.filter(name="kv-agent").first(), timeout=30)
        assert worker.kv_events == endpoints(sim)["kv_events"]
        wait_stream(router, worker, connected=True)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
