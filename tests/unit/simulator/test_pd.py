"""simulator.pd: kv_transfer_params read as vLLM's pull scheduler reads them, a prefill's
leases, and a decode pulling a prefill's blocks between two simulators in this process."""

from __future__ import annotations

import asyncio

import aiohttp

from simulator.pd import (
    Leases,
    RemotePrefill,
    asks_remote_decode,
    internal_request_id,
    prefill_params,
    pull_blocks,
    remote_prefill,
    reported_cached_tokens,
)
from tests.support.servers import free_port
from tests.support.sim_app import served, until

VALID = {
    "do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
    "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 8100,
}  # fmt: skip


def test_only_complete_decode_params_ask_for_a_remote_prefill() -> None:
    assert remote_prefill(VALID) == RemotePrefill("127.0.0.1", 8100, "e", "r")
    for broken in (
        None, {}, {**VALID, "do_remote_prefill": False}, {**VALID, "remote_block_ids": []},
        {k: v for k, v in VALID.items() if k != "remote_host"}, {**VALID, "remote_port": "8100"},
        {**VALID, "remote_port": True}, {**VALID, "remote_request_id": 7},
    ):  # fmt: skip
        assert remote_prefill(broken) is None, broken
    assert asks_remote_decode({"do_remote_decode": True})
    assert not asks_remote_decode({"do_remote_decode": False}) and not asks_remote_decode("x")


def test_the_reported_cached_tokens_are_the_prefills_kept_within_the_prompt() -> None:
    def reported(value: object, prompt: int = 100) -> int | None:
        return reported_cached_tokens({**VALID, "remote_prefill_cached_tokens": value}, prompt)

    assert (reported(32), reported(500), reported(-4)) == (32, 100, 0)
    assert reported(True) is None and reported("32") is None
    assert reported_cached_tokens({"remote_prefill_cached_tokens": 32}, 100) is None


def test_internal_ids_and_prefill_params_as_vllm_writes_them() -> None:
    chat, text = internal_request_id("chatcmpl-a", True), internal_request_id("cmpl-a", False)
    assert chat.startswith("chatcmpl-a-") and len(chat) == len("chatcmpl-a-") + 8
    assert text.startswith("cmpl-a-0-")
    params = prefill_params(block_ids=[3, 4], engine_id="e", request_id="r", host="h",
                            port=1, num_tokens=20, cached_tokens=16)  # fmt: skip
    assert params["remote_block_ids"] == [[3, 4]] and params["transfer_mode"] == "pull"
    assert remote_prefill(params) == RemotePrefill("h", 1, "e", "r")


def test_a_lease_is_released_once_taken_or_expired() -> None:
    async def scenario() -> list[tuple[int, bool]]:
        released: list[tuple[int, bool]] = []
        leases = Leases(0.0, capacity=4, on_release=lambda n, e: released.append((n, e)))
        assert leases.grant("a", 33, 16) == [1, 2, 3]  # ceil(33 / 16) blocks, from 1
        assert leases.grant("b", 16, 16) == [4]
        assert leases.grant("c", 20, 16) == [1, 2]  # round the capacity
        taken = leases.take("a")
        assert taken is not None and taken.blocks == 3 and leases.take("a") is None
        await until(lambda: len(leases) == 0, "expired")  # lease_s 0: at the next turn
        leases.close()
        return released

    assert asyncio.run(scenario()) == [(3, False), (1, True), (2, True)]


def test_a_decode_pulls_a_prefills_blocks_once_and_computes_locally_after() -> None:
    async def scenario() -> None:
        knobs = {"ttft_ms": 0.0, "itl_ms": 0.0, "enable_prompt_tokens_details": True}
        async with served(role="prefill", **knobs) as p, served(role="decode", **knobs) as d:
            chat = {"messages": [{"role": "user", "content": " ".join(["w"] * 40)}],
                    "max_tokens": 1}  # fmt: skip
            status, first = await p.post(
                "/v1/chat/completions", {**chat, "kv_transfer_params": {"do_remote_decode": True}}
            )
            params = first["kv_transfer_params"]
            assert status == 200 and params["remote_port"] == int(p.url.rsplit(":", 1)[1])
            assert p.sim.held_blocks == 3 and len(p.sim.leases) == 1  # 41 tokens
            status, second = await d.post(
                "/v1/chat/completions", {**chat, "kv_transfer_params": params}
            )
            assert status == 200 and p.sim.held_blocks == 0 and len(p.sim.leases) == 0
            assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert d.sim.metrics.external_kv_tokens == 41
            # The same parameters again: nothing held any more, so computed on the decode.
            await d.post("/v1/chat/completions", {**chat, "kv_transfer_params": params})
            assert d.sim.metrics.nixl_failed_transfers == 1
            # A prefill that does not answer at all is a failed pull too.
            async with aiohttp.ClientSession() as http:
                gone = RemotePrefill("127.0.0.1", free_port(), "e", "r")
                assert await pull_blocks(http, gone) is None

    asyncio.run(scenario())
