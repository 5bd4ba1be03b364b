"""simulator.demo_traffic: the demo's client, against a simulator standing in for the router:
the models it lists (and keeps to), plain requests, multi-turn chats that keep real answers,
and a stop that ends it."""

from __future__ import annotations

import asyncio

import aiohttp

import simulator.demo_traffic as demo
from tests.support.servers import free_port
from tests.support.sim_app import CEILING_S, Served, drive, until


def test_models_lists_the_servers_and_nothing_when_it_is_unreachable() -> None:
    async def scenario(s: Served) -> None:
        async with aiohttp.ClientSession() as http:
            assert await demo.models(http, s.url) == ["sim-model", "sql"]
            assert await demo.models(http, f"http://127.0.0.1:{free_port()}") == []

    drive(scenario, loras=("sql",))


def test_a_chat_keeps_each_answer_and_starts_again_after_its_turns() -> None:
    async def scenario(s: Served) -> None:
        chat = demo.Chat(demo.PERSONAS[0])
        async with aiohttp.ClientSession() as http:
            chat.busy = True
            await chat.turn(http, s.url, "sim-model")
            assert not chat.busy and [m["role"] for m in chat.messages] == [
                "system", "user", "assistant"
            ]  # fmt: skip
            assert chat.messages[1]["content"] in demo.QUESTIONS
            asked = s.sim.requests[-1]["body"]
            assert demo.PERSONAS[0].encode() in asked
            for _ in range(demo.TURNS - 1):
                await chat.turn(http, s.url, "sim-model")
            assert len(chat.messages) == 1  # past TURNS answers: the persona alone again
            await chat.turn(http, s.url, "no-such-model")  # a 404: the turn is dropped
            assert chat.messages == [{"role": "system", "content": demo.PERSONAS[0]}]

    drive(scenario)


def test_run_sends_plain_requests_to_the_models_named_until_stopped() -> None:
    async def scenario(s: Served) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(demo.run(s.url, 50.0, stop, only=frozenset({"sql"})))
        await until(lambda: s.sim.completed >= 3, "3 requests answered")
        stop.set()
        await asyncio.wait_for(task, CEILING_S)
        generations = [r for r in s.sim.requests if r["path"] == "/v1/chat/completions"]
        assert generations and all(b'"model":"sql"' in r["body"] for r in generations)

    drive(scenario, loras=("sql",))


def test_run_with_chats_holds_conversations() -> None:
    async def scenario(s: Served) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(demo.run(s.url, 50.0, stop, chats=True, concurrency=2))
        await until(lambda: s.sim.completed >= 4, "4 turns answered")
        stop.set()
        await asyncio.wait_for(task, CEILING_S)
        bodies = [r["body"] for r in s.sim.requests if r["path"] == "/v1/chat/completions"]
        assert all(b'"role":"system"' in b for b in bodies)

    drive(scenario)
