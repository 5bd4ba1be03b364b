"""simulator.responses_api: the Responses API with vLLM's per-server store: a conversation
continued by previous_response_id on this server only, streams, background runs and cancels."""

from __future__ import annotations

import orjson

from simulator.tokens import output_text
from tests.support.sim_app import Served, drive, served, until


def test_a_stored_response_continues_its_conversation_and_is_fetched_by_id() -> None:
    async def scenario(s: Served) -> None:
        status, first = await s.post(
            "/v1/responses", {"input": "hello", "instructions": "be brief", "max_output_tokens": 2}
        )
        assert status == 200 and first["status"] == "incomplete"
        assert first["output"][0]["content"][0]["text"] == output_text(2)
        assert first["usage"]["input_tokens"] == 5  # system + 2, user + 1
        assert (first["usage"]["output_tokens"], first["usage"]["total_tokens"]) == (2, 7)
        status, second = await s.post(
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "more"}]}],
             "previous_response_id": first["id"], "max_output_tokens": 2},
        )  # fmt: skip
        # The conversation so far (5 tokens, then the answer's 3: its role, 2 words), then 2.
        assert status == 200 and second["usage"]["input_tokens"] == 5 + 3 + 2
        assert (await s.get(f"/v1/responses/{first['id']}"))[1]["id"] == first["id"]

    drive(scenario)


def test_an_id_another_server_made_or_an_unstored_one_is_vllms_404() -> None:
    async def scenario(s: Served) -> None:
        _, made = await s.post("/v1/responses", {"input": "x", "max_output_tokens": 1})
        _, unstored = await s.post(
            "/v1/responses", {"input": "x", "store": False, "max_output_tokens": 1}
        )
        assert (await s.get(f"/v1/responses/{unstored['id']}"))[0] == 404
        async with served() as other:
            status, error = await other.post(
                "/v1/responses", {"input": "y", "previous_response_id": made["id"]}
            )
        assert status == 404 and error["error"]["param"] == "response_id"
        assert error["error"]["message"] == f"Response with id '{made['id']}' not found."

    drive(scenario)


def test_a_stream_sends_the_events_in_order_and_stores_the_response() -> None:
    async def scenario(s: Served) -> None:
        raw = await s.stream(
            "/v1/responses", {"input": "x", "stream": True, "max_output_tokens": 3}
        )
        events = [e.split("\n") for e in raw.decode().split("\n\n") if e]
        data = [orjson.loads(lines[1].removeprefix("data: ")) for lines in events]
        assert [d["sequence_number"] for d in data] == list(range(len(data)))
        kinds = [d["type"] for d in data]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds.count("response.output_text.delta") == 3
        assert kinds[-1] == "response.completed"
        done = data[-1]["response"]
        assert (await s.get(f"/v1/responses/{done['id']}"))[1]["status"] == "incomplete"

    drive(scenario)


def test_a_background_response_is_queued_then_cancelled_and_stays_cancelled() -> None:
    async def scenario(s: Served) -> None:
        status, queued = await s.post(
            "/v1/responses", {"input": "x", "background": True, "max_output_tokens": 10_000}
        )
        assert status == 200 and queued["status"] == "queued" and queued["background"] is True
        await until(lambda: s.sim.running == 1, "running")
        status, cancelled = await s.post(f"/v1/responses/{queued['id']}/cancel", {})
        assert status == 200 and cancelled["status"] == "cancelled"
        await until(lambda: s.sim.running == 0, "stopped")
        assert s.sim.cancelled == 1
        assert (await s.get(f"/v1/responses/{queued['id']}"))[1]["status"] == "cancelled"
        again = await s.post(f"/v1/responses/{queued['id']}/cancel", {})
        assert again[0] == 400
        refused = await s.post("/v1/responses", {"input": "x", "background": True, "store": False})
        assert refused[0] == 400 and refused[1]["error"]["param"] == "background"

    drive(scenario, ttft_ms=0.0, itl_ms=1.0, max_model_len=20_000)


def test_a_finished_background_response_is_updated_in_the_store() -> None:
    async def scenario(s: Served) -> None:
        _, queued = await s.post(
            "/v1/responses", {"input": "x", "background": True, "max_output_tokens": 2}
        )
        await until(lambda: s.sim.completed == 1, "completed")
        _, found = await s.get(f"/v1/responses/{queued['id']}")
        assert found["status"] == "incomplete" and found["usage"]["output_tokens"] == 2

    drive(scenario)
