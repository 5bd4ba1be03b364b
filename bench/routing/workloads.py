"""The seeded workloads of ``bench.routing``, and the cache size derived from them.

A library for that script, not a script: :class:`Session` (one user's turns) and
:class:`Workload`, the two sizes (:data:`FULL`, :data:`QUICK`), seeded pseudo-words
(:class:`Words`), the ``prefix``, ``uniform`` and ``skewed`` workloads
(:func:`build_workloads`), and the prefix workload's working set in cache blocks
(:func:`working_set`), which sets each worker's ``--cache-blocks``, with the arithmetic the
report prints (:func:`sizing_lines`).
"""

from __future__ import annotations

import math
import random
import statistics
import string
from collections import Counter
from dataclasses import dataclass
from typing import Any

from bench.routing.fleet import BLOCK_SIZE, MAX_TOKENS, N_WORKERS

SEED = 20261130
WORKLOADS = ("prefix", "uniform", "skewed")
SYSTEM_WORDS = 1024
USER_WORDS = (24, 40)
UNIFORM_WORDS = (256, 512)
VOCAB_SIZE = 4096
CACHE_SHARE = 0.40  # of the prefix workload's working set, per worker


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Session:
    """One user: a session key, its group (system prompt) and its user turns, in order."""

    key: str
    group: int
    system: str | None
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sessions: tuple[Session, ...]  # in start order

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass(frozen=True)
class Scale:
    groups: int
    users: int  # per group, for `prefix`
    turns: int
    affinity_sessions: int
    affinity_turns: int


FULL = Scale(groups=16, users=8, turns=4, affinity_sessions=32, affinity_turns=8)
QUICK = Scale(groups=8, users=4, turns=3, affinity_sessions=16, affinity_turns=6)


class Words:
    """Seeded random pseudo-words; a 16-word block never repeats by accident."""

    def __init__(self, rng: random.Random) -> None:
        letters = string.ascii_lowercase
        vocab: set[str] = set()
        while len(vocab) < VOCAB_SIZE:
            vocab.add("".join(rng.choices(letters, k=rng.randint(3, 9))))
        self.vocab = sorted(vocab)
        self.rng = rng

    def text(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))

    def between(self, bounds: tuple[int, int]) -> str:
        return self.text(self.rng.randint(*bounds))


def chat_sessions(
    name: str, group_of_user: list[int], n_groups: int, turns: int, seed: int
) -> tuple[Session, ...]:
    rng = random.Random(f"{seed}-{name}")
    words = Words(rng)
    systems = [words.text(SYSTEM_WORDS) for _ in range(n_groups)]
    per_group: Counter[int] = Counter()
    sessions = []
    for group in group_of_user:
        user = per_group[group]
        per_group[group] += 1
        user_turns = tuple(words.between(USER_WORDS) for _ in range(turns))
        sessions.append(Session(f"g{group:02d}-u{user:02d}", group, systems[group], user_turns))
    rng.shuffle(sessions)  # all groups are live from the start, not one group after another
    return tuple(sessions)


def build_workloads(scale: Scale, seed: int) -> dict[str, Workload]:
    g, u, t = scale.groups, scale.users, scale.turns
    prefix = Workload(
        "prefix",
        f"{g} groups x {u} users x {t} turns, {SYSTEM_WORDS}-word shared system prompt per group,"
        f" {USER_WORDS[0]}-{USER_WORDS[1]}-word user turns, answers appended to the history",
        chat_sessions("prefix", [grp for grp in range(g) for _ in range(u)], g, t, seed),
    )
    n_users = g * u
    hot = n_users // 2
    skew_groups = [0] * hot + [1 + i % (g - 1) for i in range(n_users - hot)]
    skewed = Workload(
        "skewed",
        f"{n_users} users x {t} turns: {hot} users share the hot system prompt (group 0), "
        f"{n_users - hot} are spread over {g - 1} other groups",
        chat_sessions("skewed", skew_groups, g, t, seed),
    )
    rng = random.Random(f"{seed}-uniform")
    words = Words(rng)
    n = prefix.requests
    uniform = Workload(
        "uniform",
        f"{n} single-turn requests of {UNIFORM_WORDS[0]}-{UNIFORM_WORDS[1]} unrelated random words",
        tuple(Session(f"r{i:04d}", i, None, (words.between(UNIFORM_WORDS),)) for i in range(n)),
    )
    return {"prefix": prefix, "uniform": uniform, "skewed": skewed}


# --------------------------------------------------------------------------- cache sizing


def chat_tokens(messages: list[dict[str, str]]) -> int:
    """The simulator's token count: each message's role, then its whitespace-separated words."""
    return sum(1 + len(m["content"].split()) for m in messages)


def working_set(workload: Workload) -> dict[str, Any]:
    """Full blocks the prefix workload touches: shared system-prompt blocks once per group,
    plus each user's private blocks (its last turn's prompt extends all the earlier ones)."""
    reply = " ".join(["w"] * MAX_TOKENS)  # the answer is always MAX_TOKENS words
    shared_blocks = (1 + SYSTEM_WORDS) // BLOCK_SIZE
    groups = sorted({s.group for s in workload.sessions})
    private = []
    for s in workload.sessions:
        assert s.system is not None
        messages = [{"role": "system", "content": s.system}]
        for turn in s.turns[:-1]:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": reply}]
        messages.append({"role": "user", "content": s.turns[-1]})
        private.append(chat_tokens(messages) // BLOCK_SIZE - shared_blocks)
    total = len(groups) * shared_blocks + sum(private)
    per_worker = math.ceil(CACHE_SHARE * total)
    # The oracle's heaviest worker: its groups' system prompts plus their users' private blocks.
    oracle_load = [0] * N_WORKERS
    for g in groups:
        oracle_load[g % N_WORKERS] += shared_blocks
    for s, p in zip(workload.sessions, private, strict=True):
        oracle_load[s.group % N_WORKERS] += p
    return {
        "groups": len(groups),
        "users": len(workload.sessions),
        "system_tokens": 1 + SYSTEM_WORDS,
        "shared_blocks_per_group": shared_blocks,
        "shared_blocks": len(groups) * shared_blocks,
        "private_blocks": sum(private),
        "private_blocks_per_user_mean": statistics.fmean(private),
        "working_set_blocks": total,
        "cache_blocks_per_worker": per_worker,
        "fleet_cache_blocks": N_WORKERS * per_worker,
        "oracle_max_worker_blocks": max(oracle_load),
    }


def sizing_lines(ws: dict[str, Any]) -> list[str]:
    return [
        f"Cache sizing (block size {BLOCK_SIZE} tokens; a chat token is a role or a word):",
        "",
        f"* shared: {ws['groups']} system prompts x {ws['system_tokens']} tokens (role + "
        f"{SYSTEM_WORDS} words) = {ws['groups']} x {ws['shared_blocks_per_group']} full blocks "
        f"= {ws['shared_blocks']} blocks (the partial last block is not cached; it merges with "
        "the user's turn);",
        f"* private: {ws['users']} users x {ws['private_blocks_per_user_mean']:.1f} blocks on "
        f"average (their turns and answers, up to the last turn) = {ws['private_blocks']} "
        "blocks;",
        f"* working set: {ws['shared_blocks']} + {ws['private_blocks']} = "
        f"{ws['working_set_blocks']} blocks;",
        f"* per worker: {CACHE_SHARE:.0%} of it = --cache-blocks {ws['cache_blocks_per_worker']}"
        f" (less than the working set, so one worker cannot hold it); fleet: {N_WORKERS} x "
        f"{ws['cache_blocks_per_worker']} = {ws['fleet_cache_blocks']} blocks "
        f"({ws['fleet_cache_blocks'] / ws['working_set_blocks']:.0%} of the working set, so a "
        "good partition holds it all);",
        f"* the oracle's (group g -> worker g mod {N_WORKERS}) busiest worker needs "
        f"{ws['oracle_max_worker_blocks']} blocks, which fits.",
    ]


def session_words(session: Session) -> list[str]:
    """Every word a session sends (its system prompt and turns): a tokenizer's vocabulary."""
    return " ".join([session.system or "", *session.turns]).split()
