"""The modes of ``bench.routing``: the policies it switches the router to, and the
baselines that bypass it.

A library for that script, not a script: the policy names and their ``policy_config``
(:data:`ALL_POLICIES`, :data:`POLICY_CONFIGS`, :func:`policy_of`, :func:`config_of`), the
client-side and floor-proxy modes (:data:`DIRECT_MODES`), and :class:`PolicySwitch`, which
switches the model's policy through the admin API so that every run starts with a fresh policy
instance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
import orjson

from bench.routing.fleet import BLOCK_SIZE, MAX_BATCH, MODEL, Fleet, admin_headers

POLICY_SETTLE_S = 1.5
POLICY_POLL_S = 5.0


# Policy configurations (policy_config), by mode. prefix_aware's load thresholds are in
# requests and scale with how many requests a worker runs at once: one batch (MAX_BATCH) of
# imbalance, not SGLang's 32, which the whole benchmark (32 in flight) can never reach. The mode
# "prefix_aware@defaults" runs it with {} too, to show what the defaults do here.
DEFAULTS_SUFFIX = "@defaults"
POLICY_CONFIGS: dict[str, dict[str, Any]] = {
    "prefix_aware": {"balance_abs_threshold": MAX_BATCH, "balance_rel_threshold": 1.5},
    # The same guard (its docstring: "about one batch of the workers"), in the workers' block.
    "kv_aware": {
        "balance_abs_threshold": MAX_BATCH,
        "balance_rel_threshold": 1.5,
        "block_size": BLOCK_SIZE,
    },
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prefix-config`` and ``--kv-config``: the two cache policies' policy_config as
    JSON, POLICY_CONFIGS' by default."""
    for flag, policy in (("--prefix-config", "prefix_aware"), ("--kv-config", "kv_aware")):
        parser.add_argument(
            flag,
            type=json.loads,
            default=POLICY_CONFIGS[policy],
            help=f"{policy}'s policy_config as JSON (default {json.dumps(POLICY_CONFIGS[policy])})",
        )


ALL_POLICIES = (
    "round_robin",
    "random",
    "shortest_queue",
    "power_of_two",
    "least_kv",
    "session_affinity",
    "prefix_aware",
    "prefix_aware@defaults",
)
# Needs workers that publish KV events (routing_policies.py --kv); not in the default run.
KV_POLICIES = ("kv_aware",)
KNOWN_POLICIES = (*ALL_POLICIES, *KV_POLICIES)
BASELINES = ("client_rr", "client_oracle")
# The oracle's assignment through bench/common/floor_proxy.py (uvicorn + aiohttp and nothing else):
# what any proxy on this stack adds on this machine, to read the router-vs-oracle target by.
FLOOR_MODES = ("floor_oracle",)
DIRECT_MODES = (*BASELINES, *FLOOR_MODES)  # modes that do not go through the router


DEFAULT_POLICY = "shortest_queue"


def policy_of(mode: str) -> str:
    """The policy name a router mode runs ("prefix_aware@defaults" -> "prefix_aware")."""
    return mode.removesuffix(DEFAULTS_SUFFIX)


def config_of(mode: str) -> dict[str, Any]:
    """The policy_config a router mode runs with."""
    return {} if mode.endswith(DEFAULTS_SUFFIX) else POLICY_CONFIGS.get(mode, {})


class PolicySwitch:
    """Switches MODEL's policy through the admin API, and knows which mode (policy and
    config, see config_of) is in force."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.current = DEFAULT_POLICY
        self.available: bool | None = None  # PATCH /api/models exists
        self.registered: list[str] | None = None  # GET /api/policies, when it exists
        self.notes: list[str] = []

    async def probe(self, session: aiohttp.ClientSession) -> None:
        headers = admin_headers(self.fleet)
        async with session.get(f"{self.fleet.router}/api/policies", headers=headers) as resp:
            if resp.status == 200:
                self.registered = list(orjson.loads(await resp.read()))
        async with session.get(f"{self.fleet.router}/api/models/{MODEL}", headers=headers) as r:
            body = await r.read()
            if r.status == 200:
                self.current = orjson.loads(body).get("policy", DEFAULT_POLICY)
                self.available = True
            else:
                self.available = False
                self.notes.append(
                    f"GET /api/models/{MODEL} answered HTTP {r.status}: policy switching is not "
                    f"available, only the default policy ({DEFAULT_POLICY}) is measured"
                )

    async def patch(self, session: aiohttp.ClientSession, mode: str) -> tuple[int, str]:
        url = f"{self.fleet.router}/api/models/{MODEL}"
        body = {"policy": policy_of(mode), "policy_config": config_of(mode)}
        async with session.patch(url, json=body, headers=admin_headers(self.fleet)) as resp:
            return resp.status, (await resp.text())[:300]

    async def wait_applied(self, session: aiohttp.ClientSession, mode: str) -> None:
        url = f"{self.fleet.router}/api/models/{MODEL}"
        want = {"policy": policy_of(mode), "policy_config": config_of(mode)}
        deadline = time.monotonic() + POLICY_POLL_S
        while time.monotonic() < deadline:
            async with session.get(url, headers=admin_headers(self.fleet)) as resp:
                got = orjson.loads(await resp.read()) if resp.status == 200 else {}
                if all(got.get(k, v) == v for k, v in want.items()):
                    break
            await asyncio.sleep(0.1)
        await asyncio.sleep(POLICY_SETTLE_S)  # the router polls its store every 0.25 s

    async def use(self, session: aiohttp.ClientSession, mode: str) -> str | None:
        """Make `mode` the one in force, as a fresh instance; None, or why it is skipped."""
        policy = policy_of(mode)
        if not self.available:
            return None if mode == DEFAULT_POLICY else "policy switching is not available"
        if self.registered is not None and policy not in self.registered:
            return f"not registered (GET /api/policies: {', '.join(self.registered)})"
        if mode == self.current:
            # Same name and config: the router would keep the old instance and what it learnt.
            other = next(
                (p for p in (self.registered or [DEFAULT_POLICY, "round_robin"]) if p != policy),
                None,
            )
            if other is not None:
                status, text = await self.patch(session, other)
                if status == 200:
                    self.current = other
                    await self.wait_applied(session, other)
        if mode != self.current:
            status, text = await self.patch(session, mode)
            if status != 200:
                return f"PATCH answered HTTP {status}: {text}"
            self.current = mode
            await self.wait_applied(session, mode)
        return None
