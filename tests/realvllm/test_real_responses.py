"""`previous_response_id` through the router against real vLLM (routing.peers.response_affinity):
vLLM 0.32 keeps a stored response in the server that made it (VLLM_ENABLE_RESPONSES_API_STORE
is set in start_pair), so a follow-up, a GET or a cancel sent to the other server fails.
Round robin alternates the two servers, so without the pin every other follow-up would."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.realvllm.fleet import register, use_policy
from tests.realvllm.servers import MODEL, RealWorker
from tests.support.servers import RouterServer

pytestmark = pytest.mark.django_db(transaction=True)


def holder(pair: list[RealWorker], response_id: str) -> int:
    """The index of the server holding `response_id`, asked directly; the other must answer
    vLLM's 404, in the shape the simulator copies (simulator.responses_api)."""
    answers = [httpx.get(f"{real.url}/v1/responses/{response_id}", timeout=30) for real in pair]
    assert sorted(a.status_code for a in answers) == [200, 404], [a.text for a in answers]
    missing = next(a for a in answers if a.status_code == 404)
    assert missing.json() == {
        "error": {
            "message": f"Response with id '{response_id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    return next(i for i, a in enumerate(answers) if a.status_code == 200)


def test_follow_ups_reach_the_server_holding_the_response(
    router: RouterServer, client: openai.OpenAI, vllm_pair: list[RealWorker]
) -> None:
    register(router, vllm_pair, events=False)
    use_policy(router, "round_robin")
    ask = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    first = client.responses.create(input="Name a colour.", **ask)  # type: ignore[call-overload]
    home = holder(vllm_pair, first.id)
    previous = first.id
    for turn in range(4):
        if turn % 2:
            created = ""
            stream = client.responses.create(  # type: ignore[call-overload]
                input=f"And another, turn {turn}?", previous_response_id=previous, stream=True,
                **ask,
            )  # fmt: skip
            for event in stream:
                if event.type == "response.created":
                    created = event.response.id
            assert created, "no response.created event"
            previous = created
        else:
            again = client.responses.create(  # type: ignore[call-overload]
                input=f"And another, turn {turn}?", previous_response_id=previous, **ask
            )
            assert again.previous_response_id == previous
            previous = again.id
        assert holder(vllm_pair, previous) == home, f"turn {turn}"
    assert client.responses.retrieve(previous).id == previous
