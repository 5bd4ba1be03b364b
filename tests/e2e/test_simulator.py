"""Tests of the fake vLLM server: wire format, FIFO queueing, prefix cache, cancellation, hooks.

Each test runs its own simulator on a free port inside asyncio.run, so no Django is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from simulator.config import SimConfig
from simulator.server import RunningSimulator, start_simulator
from tests.support.servers import WAIT_CEILING_S

pytestmark: list[Any] = []

Scenario = Callable[[RunningSimulator, aiohttp.ClientSession], Awaitable[None]]
CHAT = "/v1/chat/completions"


def run(config: SimConfig, scenario: Scenario) -> None:
    async def main() -> None:
        sim = await start_simulator(config)
        try:
            async with aiohttp.ClientSession(sim.url) as session:
                await scenario(sim, session)
        finally:
            await sim.stop()

    asyncio.run(main())


def chat_body(text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


async def metrics(session: aiohttp.ClientSession) -> dict[str, float]:
    """Samples keyed by name plus their non-model labels, e.g. 'x{finished_reason=length}'."""
    async with session.get("/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in extra.items()) + "}" if extra else ""
            )
            out[key] = s.value
    return out


async def wait_for(predicate: Callable[[], bool], timeout: float = WAIT_CEILING_S) -> None:
    """Poll `predicate` on the simulator's own loop until true; `timeout` is a ceiling."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    return [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]


def test_models_lists_loras_with_parent() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async with session.get("/v1/models") as resp:
            data = await resp.json()
        ids = {m["id"]: m for m in data["data"]}
        assert data["object"] == "list"
        assert ids["base"]["parent"] is None and ids["base"]["owned_by"] == "vllm"
        assert ids["ad1"]["parent"] == "base" and ids["ad1"]["root"] == "ad1"
        # vLLM 0.32: an adapter's max_model_len is null; its root is its path (here its name).
        assert ids["ad1"]["max_model_len"] is None and ids["base"]["max_model_len"] == 4096
        async with session.get("/health") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with session.get("/version") as resp:
            assert (await resp.json()) == {"version": "sim"}

    run(SimConfig(model="base", loras=("ad1",), ttft_ms=0, itl_ms=0), scenario)


def test_non_stream_chat_and_completion() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async with session.post(CHAT, json=chat_body("a b c", max_tokens=4)) as resp:
            body = await resp.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["message"]["content"].split()) == 4
        # Tokens are the role plus the words: "user a b c".
        assert body["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 4,
            "total_tokens": 8,
            "prompt_tokens_details": None,
        }
        payload = {"model": "lora1", "prompt": "one two three", "max_tokens": 2}
        async with session.post("/v1/completions", json=payload) as resp:
            body = await resp.json()
        assert body["id"].startswith("cmpl-") and body["model"] == "lora1"
        assert body["choices"][0]["text"] == "the quick "
        assert body["usage"]["prompt_tokens"] == 3
        assert sim.state.received == 2 and sim.state.completed == 2

    run(SimConfig(loras=("lora1",), ttft_ms=1, itl_ms=1), scenario)


def test_stream_chat_with_usage_ends_with_usage_then_done() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        body = chat_body(max_tokens=3, stream=True, stream_options={"include_usage": True})
        async with session.post(CHAT, json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [c["choices"][0] for c in chunks[1:-1]]
        assert [c["delta"]["content"] for c in content] == ["the ", "quick ", "brown "]
        assert [c["finish_reason"] for c in content] == [None, None, "length"]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)

    run(SimConfig(ttft_ms=1, itl_ms=1), scenario)


def test_stream_completion_without_usage() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
        async with session.post("/v1/completions", json=body) as resp:
            events = sse_events(await resp.text())
        assert events[-1] == "[DONE]" and len(events) == 3
        texts = [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert texts == ["the ", "quick "]

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_fifo_queue_shows_running_and_waiting() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async def one() -> None:
            async with session.post(CHAT, json=chat_body(max_tokens=6)) as resp:
                assert resp.status == 200
                await resp.read()

        tasks = [asyncio.create_task(one()) for _ in range(5)]
        await wait_for(lambda: sim.state.running + sim.state.waiting == 5)
        m = await metrics(session)
        assert m["vllm:num_requests_running"] == 2
        assert m["vllm:num_requests_waiting"] == 3
        assert 0 < m["vllm:kv_cache_usage_perc"] <= 1
        await asyncio.gather(*tasks)
        m = await metrics(session)
        assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        assert m["vllm:request_success_total{finished_reason=length}"] == 5
        assert m["vllm:time_to_first_token_seconds_count"] == 5
        assert m["vllm:generation_tokens_total"] == 30

    run(SimConfig(max_batch=2, ttft_ms=5, itl_ms=50), scenario)


def test_cancelled_waiter_leaves_queue_and_fifo_continues() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        order: list[str] = []

        async def one(name: str, tokens: int = 4) -> None:
            headers = {"X-Request-Id": name}
            body = chat_body(max_tokens=tokens)
            async with session.post(CHAT, json=body, headers=headers) as r:
                await r.read()
            order.append(name)

        # "a" runs long (about 0.8 s), so it cannot end, and let "c" in, before the queue has
        # been seen with "c" alone in it (a loaded machine polls late).
        first = asyncio.create_task(one("a", tokens=40))
        await wait_for(lambda: sim.state.running == 1)
        doomed = asyncio.create_task(one("b"))
        await wait_for(lambda: sim.state.waiting == 1)
        last = asyncio.create_task(one("c"))
        await wait_for(lambda: sim.state.waiting == 2)
        doomed.cancel()
        await wait_for(lambda: sim.state.waiting == 1)
        assert sim.state.cancelled_ids == ["chatcmpl-b"]
        await asyncio.gather(first, last)
        assert order == ["a", "c"]
        assert (sim.state.running, sim.state.waiting) == (0, 0)

    run(SimConfig(max_batch=1, ttft_ms=5, itl_ms=20), scenario)


def test_prefix_cache_hits_and_speeds_up_repeated_prompt() -> None:
    long_prompt = " ".join(f"w{i}" for i in range(319))  # + role = 320 tokens = 20 blocks

    async def timed(session: aiohttp.ClientSession, text: str) -> float:
        start = time.perf_counter()
        async with session.post(CHAT, json=chat_body(text, max_tokens=1)) as resp:
            await resp.read()
        return time.perf_counter() - start

    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        cold = await timed(session, long_prompt)
        m = await metrics(session)
        assert m["vllm:prefix_cache_queries_total"] == 320
        assert m["vllm:prefix_cache_hits_total"] == 0
        warm = await timed(session, long_prompt)
        m = await metrics(session)
        # 19 of the 20 blocks: vLLM always computes the prompt's last token, as here.
        assert m["vllm:prefix_cache_hits_total"] == 304
        # 20 uncached blocks cost the cold request 1 s of prefill at least; the warm one
        # computes 1 block (50 ms): faster by far more than a busy machine's jitter.
        assert cold >= 1.0 and warm < cold, (cold, warm)
        # Same tail, different first word: the chained hashes never match.
        await timed(session, "x " + long_prompt.split(" ", 1)[1])
        m = await metrics(session)
        assert m["vllm:prefix_cache_hits_total"] == 304
        assert m["vllm:prompt_tokens_total"] == 960

    run(SimConfig(ttft_ms=2, prefill_ms_per_block=50, itl_ms=0), scenario)


def test_prefix_cache_evicts_least_recently_used() -> None:
    def prompt(tag: str) -> str:
        return " ".join(f"{tag}{i}" for i in range(32))  # 33 tokens: 2 blocks reusable

    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        for tag in ("a", "b", "a", "c"):  # capacity 4: c evicts b, the least recent
            async with session.post(CHAT, json=chat_body(prompt(tag), max_tokens=1)) as r:
                await r.read()
        hits_before = (await metrics(session))["vllm:prefix_cache_hits_total"]
        assert hits_before == 32
        for tag in ("a", "b"):
            async with session.post(CHAT, json=chat_body(prompt(tag), max_tokens=1)) as r:
                await r.read()
        hits = (await metrics(session))["vllm:prefix_cache_hits_total"]
        assert hits == hits_before + 32  # a hit, b had been evicted

    run(SimConfig(cache_blocks=4, ttft_ms=0, itl_ms=0), scenario)


def test_client_disconnect_mid_stream_cancels() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        body = chat_body(max_tokens=500, stream=True)
        resp = await session.post(CHAT, json=body, headers={"X-Request-Id": "gone"})
        await resp.content.readuntil(b"\n\n")
        assert sim.state.running == 1
        resp.close()  # drops the connection, as a client that gives up would
        await wait_for(lambda: sim.state.cancelled == 1)
        assert sim.state.cancelled_ids == ["chatcmpl-gone"]
        assert (sim.state.running, sim.state.waiting) == (0, 0)
        assert sim.state.completed == 0
        m = await metrics(session)
        assert m["vllm:kv_cache_usage_perc"] == 0
        # vLLM counts no "abort" success for a request its client abandoned.
        assert m["vllm:request_success_total{finished_reason=abort}"] == 0

    run(SimConfig(ttft_ms=1, itl_ms=10), scenario)


def test_client_disconnect_while_waiting_non_stream_cancels() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async def ask() -> None:
            async with session.post(CHAT, json=chat_body(max_tokens=100)) as r:
                await r.read()

        asking = asyncio.create_task(ask())
        # Leave only once the server is generating: a client that gives up before its
        # request arrived (a fixed 0.1 s timeout on a busy machine) tests nothing.
        await wait_for(lambda: sim.state.running == 1)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        await wait_for(lambda: sim.state.cancelled == 1)
        assert (sim.state.running, sim.state.waiting) == (0, 0)

    run(SimConfig(ttft_ms=1, itl_ms=10), scenario)


def test_delay_header_holds_back_response_headers() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        start = time.perf_counter()
        async with session.get("/health", headers={"X-Sim-Delay-Ms": "300"}) as resp:
            assert resp.status == 200
        assert time.perf_counter() - start >= 0.3
        # A first-byte time-out fires before the delayed headers arrive.
        timeout = aiohttp.ClientTimeout(sock_read=0.1)
        body = chat_body(stream=True)
        try:
            async with session.post(
                CHAT, json=body, headers={"X-Sim-Delay-Ms": "1000"}, timeout=timeout
            ):
                raise AssertionError("headers should not have arrived")
        except TimeoutError:
            pass
        await wait_for(lambda: sim.state.cancelled == 1)

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_errors_in_openai_format() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async with session.post(CHAT, json={**chat_body(), "model": "nope"}) as resp:
            assert resp.status == 404
            err = (await resp.json())["error"]
        assert err["type"] == "NotFoundError" and "`nope` does not exist" in err["message"]
        async with session.post(CHAT, data=b'{"model": ') as resp:
            assert resp.status == 400
            # vLLM's (FastAPI's) validation error: type "Bad Request", param body.<offset>.
            err = (await resp.json())["error"]
            assert (err["type"], err["param"]) == ("Bad Request", "body.10")
        for bad in (0, -1, "7", 1.5, True):
            async with session.post(CHAT, json=chat_body(max_tokens=bad)) as resp:
                assert resp.status == 400, bad
        async with session.post(CHAT, json=chat_body(max_tokens=5000)) as resp:
            assert resp.status == 400
        assert sim.state.received == 0

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_embeddings_tokenize_detokenize() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        body = {"model": "sim-model", "input": ["alpha beta", "gamma", "alpha beta"]}
        async with session.post("/v1/embeddings", json=body) as resp:
            data = await resp.json()
        vectors = [d["embedding"] for d in data["data"]]
        assert [d["index"] for d in data["data"]] == [0, 1, 2]
        assert len(vectors[0]) == 32 and vectors[0] == vectors[2] != vectors[1]
        assert data["usage"]["prompt_tokens"] == 5
        async with session.post("/tokenize", json={"prompt": "to be or not to be"}) as resp:
            tok = await resp.json()
        assert tok["count"] == 6 and tok["max_model_len"] == 4096
        assert tok["tokens"][0] == tok["tokens"][4]
        async with session.post("/detokenize", json={"tokens": tok["tokens"]}) as resp:
            assert (await resp.json())["prompt"] == "to be or not to be"

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_request_log_stats_reset_and_health_control() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        raw = b'{"model":"sim-model","prompt":"caf\xc3\xa9  spaced",  "max_tokens":1}'
        headers = {"Content-Type": "application/json", "X-Trace": "t1"}
        async with session.post("/v1/completions", data=raw, headers=headers) as resp:
            assert resp.status == 200
        logged = sim.state.requests[-1]
        assert logged["body"] == raw and logged["path"] == "/v1/completions"
        assert logged["headers"]["X-Trace"] == "t1" and logged["method"] == "POST"
        async with session.get("/sim/stats") as resp:
            stats = await resp.json()
        assert stats["received"] == 1 and stats["completed"] == 1
        assert stats["requests"][-1]["body"] == raw.decode()
        assert sim.state.by_path["/v1/completions"] == 1
        async with session.post("/sim/control", json={"healthy": False}) as resp:
            assert resp.status == 200
        async with session.get("/health") as resp:
            assert resp.status == 503
        async with session.post("/sim/reset") as resp:
            assert resp.status == 200
        assert sim.state.received == 0 and len(sim.state.requests) == 0

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_metrics_text_has_vllm_families() -> None:
    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async with session.post(CHAT, json=chat_body(max_tokens=2)) as resp:
            await resp.read()
        async with session.get("/metrics") as resp:
            text = await resp.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["vllm:num_requests_running"].type == "gauge"
        assert families["vllm:prefix_cache_hits"].type == "counter"
        assert families["vllm:time_to_first_token_seconds"].type == "histogram"
        info = families["vllm:cache_config_info"].samples[0].labels
        assert info["block_size"] == "16" and info["num_gpu_blocks"] == "1024"
        buckets = [
            s
            for s in families["vllm:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")
        ]
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 1
        sample = families["vllm:num_requests_running"].samples[0]
        assert sample.labels["model_name"] == "sim-model"
        lora = families["vllm:lora_requests_info"].samples[0].labels
        assert lora["max_lora"] == "1"

    run(SimConfig(loras=("l",), ttft_ms=0, itl_ms=0), scenario)


def test_instant_mode_serves_many_requests_at_once() -> None:
    """How fast is the benchmarks' business (bench/): here, that 50 at once are all served."""

    async def scenario(sim: RunningSimulator, session: aiohttp.ClientSession) -> None:
        async def one() -> None:
            async with session.post(CHAT, json=chat_body(max_tokens=4)) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one() for _ in range(50)))
        assert sim.state.completed == 50

    run(SimConfig(ttft_ms=0, itl_ms=0), scenario)


def test_every_simulator_process_gives_a_word_the_same_token_id() -> None:
    """As one model's tokenizer is the same on every worker: a router that tokenizes on one
    worker must find those ids in every other worker's KV events (a per-process vocabulary,
    numbered in order of first use, made kv_aware miss on every worker but one)."""
    from simulator.tokens import detokenize_ids, token_ids

    words = ["shared", "system", "prompt", "of", "a", "group"]
    here = token_ids(words)
    script = (
        "from simulator.tokens import token_ids; "
        f"token_ids({list(reversed(words))!r}); print(token_ids({words!r}))"
    )
    there = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert orjson.loads(there) == here
    assert len(set(here)) == len(words) and 0 not in here
    assert detokenize_ids(here) == " ".join(words)
