"""The simulator's prefill and decode roles (simulator/pd.py), through real sockets: two
simulators, the two legs sent by hand as a disaggregating router sends them, the prefill's
answer, the decode's pull from the prefill, leases that end, and both pages of metrics.

Each test runs its simulators on free ports inside asyncio.run: no Django, no router.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.config import SimConfig, add_cli_arguments, config_from_options
from simulator.server import RunningSimulator, start_simulator

BS = 16
# What routing/pd sends a prefill worker beside the client's fields (vLLM's toy proxy's).
ASK_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PARAM_KEYS = [
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
    "remote_prefill_cached_tokens",
]  # fmt: skip
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")

Pair = Callable[[RunningSimulator, RunningSimulator, aiohttp.ClientSession], Awaitable[None]]


def config(role: str, **knobs: Any) -> SimConfig:
    knobs = {"ttft_ms": 1, "itl_ms": 1, "block_size": BS, **knobs}
    return SimConfig(role=role, enable_prompt_tokens_details=True, **knobs)


def run_pair(
    scenario: Pair, prefill: SimConfig | None = None, decode: SimConfig | None = None
) -> None:
    async def main() -> None:
        p = await start_simulator(prefill or config("prefill"))
        d = await start_simulator(decode or config("decode"))
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(p, d, session)
        finally:
            await d.stop()
            await p.stop()

    asyncio.run(main())


def words(n: int, tag: str = "w") -> str:
    """A prompt of `n` tokens (the simulator counts a word a token)."""
    return " ".join(f"{tag}{i}" for i in range(n))


async def post(
    session: aiohttp.ClientSession, sim: RunningSimulator, body: dict[str, Any], chat: bool = False
) -> dict[str, Any]:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(sim.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def prefill_leg(
    session: aiohttp.ClientSession, p: RunningSimulator, prompt: str, chat: bool = False
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 1, "stream": False}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["kv_transfer_params"] = dict(ASK_REMOTE_DECODE)
    return await post(session, p, body, chat)


async def decode_leg(
    session: aiohttp.ClientSession,
    d: RunningSimulator,
    prompt: str,
    params: dict[str, Any],
    max_tokens: int = 4,
) -> dict[str, Any]:
    body = {"kv_transfer_params": params, "model": "sim-model", "prompt": prompt}
    return await post(session, d, {**body, "max_tokens": max_tokens})


async def metrics(session: aiohttp.ClientSession, sim: RunningSimulator) -> dict[str, float]:
    """Samples keyed by name plus their own labels, e.g. 'x{source=local_compute}'."""
    async with session.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            label = ",".join(f"{k}={v}" for k, v in extra.items())
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def by_source(page: dict[str, float]) -> tuple[float, float, float]:
    """(local_compute, local_cache_hit, external_kv_transfer)"""
    name = "vllm:prompt_tokens_by_source_total{source=%s}"
    local, hit, external = (
        name % s for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    )
    return page[local], page[hit], page[external]


async def wait_for(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- the prefill leg ------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
def test_prefill_answer_carries_vllms_transfer_params_and_keeps_the_blocks(chat: bool) -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        answer = await prefill_leg(session, p, words(40), chat)
        params = answer["kv_transfer_params"]
        assert list(answer)[-1] == "kv_transfer_params"  # after usage, as vLLM's
        assert list(params) == PARAM_KEYS
        n = answer["usage"]["prompt_tokens"]
        assert answer["usage"]["completion_tokens"] == 1
        [ids] = params["remote_block_ids"]
        assert len(ids) == -(-n // BS) and all(isinstance(i, int) and i > 0 for i in ids)
        assert UUID.fullmatch(params["remote_engine_id"])
        assert params["remote_engine_id"] == p.state.engine_id
        rid = params["remote_request_id"]
        assert rid.startswith(answer["id"] + ("-" if chat else "-0-"))
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert (params["tp_size"], params["dcp_size"], params["pp_size"]) == (1, 1, 1)
        assert params["remote_num_tokens"] == n
        assert params["remote_blocks_expiry_time"] is None
        assert params["transfer_mode"] == "pull"
        assert params["remote_prefill_cached_tokens"] == 0
        # The blocks stay held, and count in the KV cache's usage, until a decode pulls them.
        assert p.state.stats()["kv_leases"] == 1
        assert p.state.held_blocks == len(ids)

        again = (await prefill_leg(session, p, words(40), chat))["kv_transfer_params"]
        assert again["remote_engine_id"] == params["remote_engine_id"]
        assert again["remote_request_id"] != rid
        # The prompt's full blocks were cached by the first leg (the last token is computed).
        assert again["remote_prefill_cached_tokens"] == (n - 1) // BS * BS
        assert p.state.stats()["kv_leases"] == 2

        page = await metrics(session, p)
        assert by_source(page) == (2 * n - (n - 1) // BS * BS, (n - 1) // BS * BS, 0)
        assert page["vllm:external_prefix_cache_queries_total"] == 2 * n - (n - 1) // BS * BS
        assert page["vllm:nixl_num_kv_expired_reqs_total"] == 0

    run_pair(scenario)


def test_requests_without_transfer_params_run_as_on_a_colocated_server() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        for sim in (p, d):
            answer = await post(session, sim, {"model": "sim-model", "prompt": words(20)})
            assert "kv_transfer_params" not in answer
            assert sim.state.stats()["kv_leases"] == 0
            assert by_source(await metrics(session, sim)) == (20, 0, 0)
        # Roles are strict: a decode leases nothing, even asked to.
        answer = await prefill_leg(session, d, words(20, "x"))
        assert "kv_transfer_params" not in answer and d.state.stats()["kv_leases"] == 0

    run_pair(scenario)


def test_a_colocated_server_ignores_transfer_params_and_keeps_its_page() -> None:
    async def scenario(
        p: RunningSimulator, both: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        params = (await prefill_leg(session, p, words(40)))["kv_transfer_params"]
        answer = await prefill_leg(session, both, words(40))
        assert "kv_transfer_params" not in answer
        await decode_leg(session, both, words(40), params)
        assert p.state.stats()["kv_leases"] == 1  # never pulled
        page = await metrics(session, both)
        assert not [name for name in page if "nixl" in name]
        assert by_source(page)[2] == 0
        assert page["vllm:external_prefix_cache_queries_total"] == 0

    run_pair(scenario, decode=config("both"))


# -- the decode leg -------------------------------------------------------------------------


def test_decode_pulls_the_blocks_from_the_prefill_and_counts_them_transferred() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        prompt = words(40)
        params = (await prefill_leg(session, p, prompt))["kv_transfer_params"]
        answer = await decode_leg(session, d, prompt, params, max_tokens=5)
        assert "kv_transfer_params" not in answer
        assert answer["usage"]["completion_tokens"] == 5
        # vLLM does not count transferred tokens as cached: the prefill's own hits (0).
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # The prefill let the blocks go when they were pulled.
        assert p.state.stats()["kv_leases"] == 0 and p.state.held_blocks == 0
        page = await metrics(session, d)
        assert by_source(page) == (0, 0, 40)
        assert page["vllm:external_prefix_cache_hits_total"] == 40
        assert page["vllm:external_prefix_cache_queries_total"] == 40
        assert page["vllm:prompt_tokens_cached_total"] == 40
        blocks = -(-40 // BS)
        assert page["vllm:nixl_xfer_time_seconds_count"] == 1
        assert page["vllm:nixl_xfer_time_seconds_sum"] == pytest.approx(blocks * 0.002)
        assert page["vllm:nixl_bytes_transferred_sum"] == blocks * BS * 4096
        assert page["vllm:nixl_num_failed_transfers_total"] == 0
        assert d.state.held_blocks == 0 and d.state.deferred == 0

        # The same parameters again: nothing left to pull, the decode computes the prompt
        # (its own prefix cache now holds its full blocks).
        await decode_leg(session, d, prompt, params)
        page = await metrics(session, d)
        cached = (40 - 1) // BS * BS
        assert by_source(page) == (40 - cached, cached, 40)
        assert page["vllm:nixl_num_failed_transfers_total"] == 1
        assert page["vllm:nixl_xfer_time_seconds_count"] == 1

    decode = config("decode", kv_transfer_ms_per_block=2, kv_bytes_per_token=4096)
    run_pair(scenario, decode=decode)


def test_decode_reports_the_prefills_cache_hits_as_cached() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        prompt = words(40)
        await prefill_leg(session, p, prompt)
        params = (await prefill_leg(session, p, prompt))["kv_transfer_params"]
        hits = params["remote_prefill_cached_tokens"]
        assert hits == 32
        answer = await decode_leg(session, d, prompt, params)
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": hits}
        # Without the prefill's count (a vLLM before 0.31), vLLM's own: all transferred.
        fresh = (await prefill_leg(session, p, words(40, "y")))["kv_transfer_params"]
        del fresh["remote_prefill_cached_tokens"]
        answer = await decode_leg(session, d, words(40, "y"), fresh)
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 40}
        assert by_source(await metrics(session, d)) == (0, 0, 80)

    run_pair(scenario)


def test_decode_skips_the_prefills_compute_time() -> None:
    """10 uncached blocks cost the decode 1 s to compute, 10 ms to pull."""

    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        prompt = words(10 * BS + 1)
        params = (await prefill_leg(session, p, prompt))["kv_transfer_params"]
        t0 = time.monotonic()
        await decode_leg(session, d, prompt, params, max_tokens=2)
        pulled = time.monotonic() - t0

        other = words(10 * BS + 1, "z")
        wrong = (await prefill_leg(session, p, other))["kv_transfer_params"]
        wrong["remote_engine_id"] = "00000000-0000-4000-8000-000000000000"  # a restarted one
        t0 = time.monotonic()
        await decode_leg(session, d, other, wrong, max_tokens=2)
        computed = time.monotonic() - t0

        assert computed >= 1.0  # slept for its prefill
        assert pulled < computed
        page = await metrics(session, d)
        assert by_source(page) == (10 * BS + 1, 0, 10 * BS + 1)
        assert page["vllm:nixl_num_failed_transfers_total"] == 1
        assert page["vllm:time_to_first_token_seconds_sum"] >= 1.0
        assert p.state.stats()["kv_leases"] == 1  # the one asked for under the wrong engine

    prefill = config("prefill", prefill_ms_per_block=0)
    decode = config("decode", prefill_ms_per_block=100, kv_transfer_ms_per_block=1)
    run_pair(scenario, prefill, decode)


def test_a_decode_waits_deferred_while_it_pulls_and_a_disconnect_frees_it() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        prompt = words(4 * BS)
        params = (await prefill_leg(session, p, prompt))["kv_transfer_params"]
        leg = asyncio.create_task(decode_leg(session, d, prompt, params))
        await wait_for(lambda: d.state.deferred == 1)
        page = await metrics(session, d)
        assert page["vllm:num_requests_waiting"] == 1
        assert page["vllm:num_requests_waiting_by_reason{reason=deferred}"] == 1
        assert page["vllm:num_requests_waiting_by_reason{reason=capacity}"] == 0
        assert page["vllm:num_requests_running"] == 0
        assert page["vllm:kv_cache_usage_perc"] > 0  # its blocks are allocated
        assert p.state.stats()["kv_leases"] == 0  # already pulled
        leg.cancel()
        await wait_for(lambda: d.state.cancelled == 1)
        assert (d.state.deferred, d.state.held_blocks, d.state.running) == (0, 0, 0)

    run_pair(scenario, decode=config("decode", kv_transfer_ms_per_block=1000))


def test_a_lease_that_ends_leaves_the_decode_to_compute() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        params = (await prefill_leg(session, p, words(40)))["kv_transfer_params"]
        assert p.state.held_blocks == 3
        await wait_for(lambda: p.state.stats()["kv_leases"] == 0)
        assert p.state.held_blocks == 0
        assert (await metrics(session, p))["vllm:nixl_num_kv_expired_reqs_total"] == 1
        answer = await decode_leg(session, d, words(40), params)
        assert answer["usage"]["completion_tokens"] == 4
        page = await metrics(session, d)
        assert by_source(page) == (40, 0, 0)
        assert page["vllm:nixl_num_failed_transfers_total"] == 1
        assert page["vllm:nixl_num_kv_expired_reqs_total"] == 0  # counted on the prefill

    run_pair(scenario, prefill=config("prefill", kv_lease_s=0.05))


def test_a_prefill_that_is_gone_leaves_the_decode_to_compute() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        params = (await prefill_leg(session, p, words(40)))["kv_transfer_params"]
        await p.stop()
        answer = await decode_leg(session, d, words(40), params)
        assert answer["usage"]["completion_tokens"] == 4
        page = await metrics(session, d)
        assert by_source(page) == (40, 0, 0)
        assert page["vllm:nixl_num_failed_transfers_total"] == 1

    run_pair(scenario)


def test_invalid_transfer_params_are_computed_without_a_pull() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        params = (await prefill_leg(session, p, words(40)))["kv_transfer_params"]
        for broken in (
            {k: v for k, v in params.items() if k != "remote_host"},
            {**params, "remote_block_ids": []},
            {**params, "remote_port": str(params["remote_port"])},
            {**params, "do_remote_prefill": False},
        ):
            await decode_leg(session, d, words(40), broken)
        assert p.state.stats()["kv_leases"] == 1  # nobody asked
        page = await metrics(session, d)
        assert by_source(page)[2] == 0
        assert page["vllm:nixl_num_failed_transfers_total"] == 0

    run_pair(scenario)


def test_a_streamed_decode_streams_as_before() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        prompt = words(40)
        params = (await prefill_leg(session, p, prompt))["kv_transfer_params"]
        body = {
            "kv_transfer_params": params,
            "model": "sim-model",
            "prompt": prompt,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(d.url + "/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.text()
        events = [e.removeprefix("data: ") for e in raw.strip().split("\n\n")]
        assert events[-1] == "[DONE]"
        assert len(events) == 3 + 2
        assert '"usage":{"prompt_tokens":40,' in events[-2]
        assert '"prompt_tokens_details":{"cached_tokens":0}' in events[-2]
        assert p.state.stats()["kv_leases"] == 0
        assert by_source(await metrics(session, d)) == (0, 0, 40)

    run_pair(scenario)


# -- configuration --------------------------------------------------------------------------


def test_the_command_lines_role_options() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    argv = ["--port", "1", "--role", "decode", "--kv-lease-s", "5"]
    argv += ["--kv-transfer-ms-per-block", "3", "--kv-bytes-per-token", "512"]
    argv += ["--side-channel-host", "sim-p.local"]
    options = vars(parser.parse_args(argv))
    cfg = config_from_options(options)
    assert (cfg.role, cfg.kv_lease_s, cfg.kv_transfer_ms_per_block) == ("decode", 5.0, 3.0)
    assert (cfg.kv_bytes_per_token, cfg.side_channel_host) == (512, "sim-p.local")
    assert config_from_options(vars(parser.parse_args(["--port", "1"]))) == SimConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1", "--role", "kv_producer"])
    with pytest.raises(ValueError, match="role"):
        SimConfig(role="producer")


def test_a_prefills_answers_name_its_side_channel_host() -> None:
    async def scenario(
        p: RunningSimulator, d: RunningSimulator, session: aiohttp.ClientSession
    ) -> None:
        params = (await prefill_leg(session, p, words(20)))["kv_transfer_params"]
        assert (params["remote_host"], params["remote_port"]) == ("localhost", p.port)
        await decode_leg(session, d, words(20), params)
        assert by_source(await metrics(session, d)) == (0, 0, 20)

    run_pair(scenario, prefill=config("prefill", side_channel_host="localhost"))
