"""Prefill/decode disaggregation through the router to real vLLM (NixlConnector on the CPU).

A prefill server (kv_producer) and a decode server (kv_consumer) of the tiny model, each
with its own NIXL side channel, registered as workers of roles `prefill` and `decode`: the
router's prefill leg computes the prompt on the first, its `kv_transfer_params` go with the
client's request to the second, which pulls the blocks over NIXL (UCX over TCP and shared
memory) instead of computing them. What the client gets, streamed or not, on completions
and chat, is what a colocated server of the same weights answers at temperature 0, token
for token and logprob for logprob; the decode server's own counters show the prompt came
by transfer; the router counts the transfer, and a short prompt skips the prefill leg.

The servers run with harness/vllm_env/nixl_noprog (NIXL's busy-polling progress thread
off: harness.real_vllm.pd_env says why).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from controlpanel.fleet import health, services
from controlpanel.registry.models import Worker
from harness.real_vllm import VllmServer
from tests.realvllm.fleet import PATIENCE_S, metric, router_metric
from tests.realvllm.servers import MODEL, RealWorker
from tests.support.servers import RouterServer, start_router, stop_process

pytestmark = pytest.mark.django_db(transaction=True)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
TRANSFERS = "controlpanel_router_pd_transfers_total"
BYPASSES = "controlpanel_router_pd_bypasses_total"
MAX_TOKENS = 16
# Logprobs of the two paths differ only by float32 rounding (measured: under 1e-6).
LOGPROB_TOLERANCE = 1e-5


# The router's wait for a worker's next byte. The tests' 3 s (tests/settings.py) is too
# short here: a disaggregated request takes 3-7 s on 2 cores, most of it before the decode
# server's first byte (the prefill leg, then the NIXL handshake and read).
READ_TIMEOUT_S = "120"


@pytest.fixture(scope="module")
def pd_router(
    django_db_setup: None, django_db_blocker: Any, var_dir: Path
) -> Iterator[RouterServer]:
    with django_db_blocker.unblock():
        server = start_router(var_dir, CONTROLPANEL_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT_S)
    yield server
    stop_process(server.proc)


@pytest.fixture
def pd_client(pd_router: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pd_router.url}/v1", api_key="not-checked", max_retries=0)


@dataclass
class Answer:
    tokens: list[str]
    logprobs: list[float]
    prompt_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def server_metric(server: VllmServer, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{server.url}/metrics", timeout=10).text, name, **labels)


def long_prompt(tag: str) -> str:
    """About 400 tokens (over 1,600 characters: the router's estimate, a token per four
    characters, is over the default bypass threshold of 256 too), unique from its first
    block on, so neither server holds any of it from an earlier request."""
    facts = " ".join(f"Item {i} of the {tag} list weighs {i * 7 % 13} kg." for i in range(40))
    return f"{tag} {tag} {tag}. {facts} Now tell me about the {tag} list."


def ask(client: openai.OpenAI, route: str, prompt: str, *, stream: bool) -> Answer:
    """One temperature-0 request of MAX_TOKENS tokens with their logprobs, as the official
    client reads it, streamed or not."""
    common: dict[str, Any] = {
        "model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }  # fmt: skip
    if stream:
        common["stream"], common["stream_options"] = True, {"include_usage": True}
    tokens: list[str] = []
    logprobs: list[float] = []
    prompt_tokens = 0
    if route == "completions":
        answer = client.completions.create(prompt=prompt, logprobs=1, **common)
        for chunk in answer if stream else [answer]:
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                assert choice.logprobs is not None or not choice.text
                if choice.logprobs is not None:
                    tokens += choice.logprobs.tokens or []
                    logprobs += choice.logprobs.token_logprobs or []
    else:
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=1, **common
        )
        for chunk in chat if stream else [chat]:
            if chunk.usage is not None:
                prompt_tokens = chunk.usage.prompt_tokens
            for choice in chunk.choices:
                content = choice.logprobs.content if choice.logprobs is not None else None
                for item in content or []:
                    tokens.append(item.token)
                    logprobs.append(item.logprob)
    return Answer(tokens, logprobs, prompt_tokens)


def register_pd(router: RouterServer, pd_pair: dict[str, VllmServer]) -> list[Worker]:
    """The pair as the model's prefill worker and decode worker, probed and routable."""
    workers = [
        services.worker_add(url=server.url, name=f"real-{role}", actor="test", role=role)
        for role, server in pd_pair.items()
    ]
    health.workers_probe()
    router.wait_routable(*workers)
    return workers


def colocated(real: RealWorker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real.url}/v1", api_key="unused", max_retries=0)


def counters(router: RouterServer, pd_pair: dict[str, VllmServer]) -> dict[str, float]:
    """What a disaggregated request moves: the decode server's prompt tokens by source, the
    requests the prefill server finished, the router's transfers and bypasses."""
    decode, prefill = pd_pair["decode"], pd_pair["prefill"]
    return {
        "external": server_metric(decode, BY_SOURCE, source="external_kv_transfer"),
        "local": server_metric(decode, BY_SOURCE, source="local_compute"),
        "cache_hit": server_metric(decode, BY_SOURCE, source="local_cache_hit"),
        "prefilled": server_metric(prefill, "vllm:request_success_total"),
        "transfers": router_metric(router, TRANSFERS, model=MODEL),
        "bypasses": router_metric(router, BYPASSES, model=MODEL, reason="short_prompt"),
    }


def moved(
    router: RouterServer, pd_pair: dict[str, VllmServer], before: dict[str, float], **want: float
) -> dict[str, float]:
    """The counters' changes since `before`, once they show `want` (vLLM counts a request
    shortly after its answer); all changes are returned for the caller's other checks."""

    deadline = time.monotonic() + PATIENCE_S
    while True:
        now = counters(router, pd_pair)
        delta = {key: now[key] - before[key] for key in now}
        if all(delta[key] == value for key, value in want.items()):
            return delta
        assert time.monotonic() < deadline, f"wanted {want}, moved {delta}"
        time.sleep(0.5)


def assert_same(got: Answer, want: Answer) -> None:
    assert got.tokens == want.tokens
    assert len(got.tokens) == MAX_TOKENS
    assert len(got.logprobs) == len(want.logprobs) == MAX_TOKENS
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert worst <= LOGPROB_TOLERANCE, (worst, got.logprobs, want.logprobs)
    assert got.prompt_tokens == want.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_disaggregated_answers_equal_colocated_ones_and_the_kv_comes_by_transfer(
    pd_router: RouterServer,
    pd_client: openai.OpenAI,
    pd_pair: dict[str, VllmServer],
    vllm_pair: list[RealWorker],
    route: str,
    stream: bool,
) -> None:
    register_pd(pd_router, pd_pair)
    prompt = long_prompt(f"{route}-{'streamed' if stream else 'whole'}")
    want = ask(colocated(vllm_pair[0]), route, prompt, stream=stream)
    assert want.prompt_tokens > 256  # over the model's default bypass threshold
    before = counters(pd_router, pd_pair)
    got = ask(pd_client, route, prompt, stream=stream)
    assert_same(got, want)
    # The decode server computed none of the prompt: all of it came over NIXL.
    delta = moved(
        pd_router, pd_pair, before,
        external=want.prompt_tokens, local=0, prefilled=1, transfers=1,
    )  # fmt: skip
    assert delta["cache_hit"] == 0 and delta["bypasses"] == 0


def test_a_short_prompt_goes_straight_to_the_decode_worker(
    pd_router: RouterServer,
    pd_client: openai.OpenAI,
    pd_pair: dict[str, VllmServer],
    vllm_pair: list[RealWorker],
) -> None:
    register_pd(pd_router, pd_pair)
    prompt = "Short and unshared: the bypass."  # far under the default 256 tokens
    want = ask(colocated(vllm_pair[0]), "completions", prompt, stream=False)
    before = counters(pd_router, pd_pair)
    got = ask(pd_client, "completions", prompt, stream=False)
    assert_same(got, want)
    # No prefill leg, no transfer: the decode server computed the prompt itself.
    delta = moved(
        pd_router, pd_pair, before,
        bypasses=1, transfers=0, prefilled=0, external=0, local=want.prompt_tokens,
    )  # fmt: skip
    assert delta["cache_hit"] == 0
