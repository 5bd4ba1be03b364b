"""The coding agents of ``bench.agents``: their seeded sessions, the cache sized from them,
and the figures of one run (issue 30, item 5).

A library for that script, not a script:

* **Agents** (:data:`AGENTS`): client keys of different weights, each running several Claude
  Code sessions at once (a developer with a few terminals open). Every session is one
  conversation of :data:`TURNS` (20-50, seeded) turns, sent as streamed chat completions:
  each turn re-sends the whole history (the system prompt, every earlier tool result and
  answer) plus the new tool results, so a prompt grows by about a hundred tokens a turn, to
  several thousand. The system prompt is the tool's own instructions (the same for every
  agent, :data:`TOOL_WORDS`) followed by the agent's project context (:data:`PROJECT_WORDS`,
  the same for the agent's sessions). A session names itself as Claude Code does, in
  ``x-claude-code-session-id`` (a seeded UUID), and its agent's key goes in
  ``Authorization`` (:func:`agent_headers`).
* **Cache sizing** (:func:`working_set`): every session's last prompt in full blocks, plus
  the shared prefixes once; each worker holds :data:`CACHE_SHARE` of it, so one worker cannot
  keep every session warm but the fleet can.
* **Figures of one run** (:class:`Record`, :func:`session_figures`, :func:`shares`): TTFT
  p50 / p99 per session, and each agent's and session's share of the completions that ended
  while the pool was saturated by every session: the window opens when every session has had
  its first answer and closes when the first session ends (until then every agent has all of
  its sessions sending).
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass
from typing import Any

from bench.common.output import percentile
from bench.routing.fleet import BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS, N_WORKERS
from bench.routing.workloads import Session, Words, Workload

SEED = 20261207
# name -> fair-share weight (manage.py create_api_key --weight).
AGENTS = {"agent-a": 3.0, "agent-b": 2.0, "agent-c": 1.0, "agent-d": 1.0}
TURNS = (20, 50)
TOOL_WORDS = 768  # Claude Code's instructions and tools: the same for every agent
PROJECT_WORDS = 256  # the agent's project (CLAUDE.md, the repository's layout)
TURN_WORDS = (30, 120)  # the user's message and the tool results of one turn
CACHE_SHARE = 0.40  # of the working set, per worker
SESSION_HEADER = "x-claude-code-session-id"


@dataclass(frozen=True)
class Scale:
    sessions: int  # per agent
    slots: int  # the saturated pool: requests the deployment runs at once


# 16 sessions sending against 6 slots; the weight-3 agent's due share is 2.6 slots, its 4
# sessions keep it waiting for more.
FULL = Scale(sessions=4, slots=6)
QUICK = Scale(sessions=2, slots=3)


@dataclass(frozen=True)
class Agents:
    """The workload (sessions in start order; a session's `group` is its index, which the
    client oracle's first placement uses) and whose each session is."""

    workload: Workload
    agent_of: dict[str, str]  # session key -> agent name

    def due(self) -> dict[str, float]:
        """Each agent's and each session's due share of a saturated pool: its weight over
        all weights, a session its agent's split equally (routing.admission.fair_queue)."""
        total = sum(AGENTS.values())
        per_agent = {a: 0 for a in AGENTS}
        for agent in self.agent_of.values():
            per_agent[agent] += 1
        out = {a: w / total for a, w in AGENTS.items()}
        for key, agent in self.agent_of.items():
            out[key] = AGENTS[agent] / total / per_agent[agent]
        return out


def build_agents(scale: Scale, seed: int = SEED) -> Agents:
    rng = random.Random(f"{seed}-agents")
    words = Words(rng)
    tool = words.text(TOOL_WORDS)
    sessions: list[Session] = []
    agent_of: dict[str, str] = {}
    for agent in AGENTS:
        system = f"{tool} {words.text(PROJECT_WORDS)}"
        for _ in range(scale.sessions):
            key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            turns = tuple(words.between(TURN_WORDS) for _ in range(rng.randint(*TURNS)))
            sessions.append(Session(key, 0, system, turns))
            agent_of[key] = agent
    rng.shuffle(sessions)  # agents interleaved in start order
    sessions = [Session(s.key, i, s.system, s.turns) for i, s in enumerate(sessions)]
    longest = max(last_prompt_tokens(s) for s in sessions)
    assert longest + MAX_TOKENS <= MAX_MODEL_LEN, f"a {longest}-token prompt does not fit"
    n, lo, hi = len(sessions), TURNS[0], TURNS[1]
    workload = Workload(
        "agents",
        f"{len(AGENTS)} agents (weights {', '.join(f'{w:g}' for w in AGENTS.values())}) x "
        f"{scale.sessions} Claude Code sessions = {n} sessions of {lo}-{hi} turns; system "
        f"prompt {TOOL_WORDS} shared + {PROJECT_WORDS} per-agent words, {TURN_WORDS[0]}-"
        f"{TURN_WORDS[1]} words of tool results a turn, every turn re-sends the history "
        f"(up to {longest} tokens)",
        tuple(sessions),
    )
    return Agents(workload, agent_of)


def agent_headers(secrets: dict[str, str], agents: Agents) -> dict[str, dict[str, str]]:
    """Session key -> its request headers: the agent's key and Claude Code's session id."""
    return {
        key: {"Authorization": f"Bearer {secrets[agent]}", SESSION_HEADER: key}
        for key, agent in agents.agent_of.items()
    }


# --------------------------------------------------------------------------- cache sizing


def last_prompt_tokens(s: Session) -> int:
    """The simulator's count of a session's last prompt: a token per role and per word."""
    system = 1 + len((s.system or "").split())
    history = sum(2 + len(t.split()) + MAX_TOKENS for t in s.turns[:-1])
    return system + history + 1 + len(s.turns[-1].split())


def working_set(agents: Agents) -> dict[str, Any]:
    """Full blocks the sessions touch: the tool's prefix once, each agent's project context
    once, each session's own blocks (its last prompt extends all the earlier ones)."""
    tool_blocks = (1 + TOOL_WORDS) // BLOCK_SIZE
    system_blocks = (1 + TOOL_WORDS + PROJECT_WORDS) // BLOCK_SIZE
    sessions = agents.workload.sessions
    private = [last_prompt_tokens(s) // BLOCK_SIZE - system_blocks for s in sessions]
    total = tool_blocks + len(AGENTS) * (system_blocks - tool_blocks) + sum(private)
    per_worker = math.ceil(CACHE_SHARE * total)
    # The oracle (session i to worker i mod N_WORKERS): its busiest worker's blocks.
    load = []
    for w in range(N_WORKERS):
        mine = [(s, p) for s, p in zip(sessions, private, strict=True) if s.group % N_WORKERS == w]
        projects = len({s.system for s, _ in mine}) * (system_blocks - tool_blocks)
        load.append(tool_blocks + projects + sum(p for _, p in mine))
    return {
        "sessions": len(sessions),
        "requests": agents.workload.requests,
        "system_blocks": system_blocks,
        "private_blocks": sum(private),
        "working_set_blocks": total,
        "cache_blocks_per_worker": per_worker,
        "oracle_max_worker_blocks": max(load),
    }


def sizing_line(ws: dict[str, Any]) -> str:
    return (
        f"cache: working set {ws['working_set_blocks']} blocks of {BLOCK_SIZE} tokens "
        f"({ws['private_blocks']} the sessions' own); each worker {CACHE_SHARE:.0%} = "
        f"--cache-blocks {ws['cache_blocks_per_worker']} (the oracle's busiest worker needs "
        f"at most {ws['oracle_max_worker_blocks']})"
    )


# --------------------------------------------------------------------------- one run's figures


@dataclass
class Record:
    """One request: its session, turn, when it was sent and ended (monotonic s), its TTFT."""

    session: str
    turn: int
    sent: float
    ended: float = math.nan
    ttft_ms: float = math.nan
    ok: bool = False


def session_figures(records: list[Record], agents: Agents) -> dict[str, dict[str, float]]:
    """Session key -> its agent's weight, requests, TTFT p50 and p99 (ms) over its turns."""
    out = {}
    for s in agents.workload.sessions:
        ttfts = [r.ttft_ms for r in records if r.session == s.key and r.ok]
        out[s.key] = {
            "turns": len(s.turns),
            "ok": len(ttfts),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99),
        }
    return out


def shares(records: list[Record], agents: Agents) -> dict[str, Any]:
    """Each agent's and session's share of the completions that ended in the window when
    every session was sending: from every session's first answer to the first session's
    last."""
    keys = [s.key for s in agents.workload.sessions]
    ends: dict[str, list[float]] = {k: [] for k in keys}
    for r in records:
        if r.ok:
            ends[r.session].append(r.ended)
    if any(not e for e in ends.values()):
        return {"window_s": 0.0, "completions": 0, "share": {}}
    opens = max(min(e) for e in ends.values())
    closes = min(max(e) for e in ends.values())
    counted = {k: sum(1 for t in e if opens < t <= closes) for k, e in ends.items()}
    total = sum(counted.values())
    share: dict[str, float] = {a: 0.0 for a in AGENTS}
    for k, n in counted.items():
        share[k] = n / total if total else math.nan
        share[agents.agent_of[k]] += share[k]
    return {"window_s": max(0.0, closes - opens), "completions": total, "share": share}
