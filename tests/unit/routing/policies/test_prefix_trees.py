"""routing.policies.prefix_trees, through the prefix_aware policy: what the workers' trees hold
matches a brute-force longest common prefix, stays bounded by max_entries, ages out after
max_age_s, and keeps its indexes exact under random traffic."""

from __future__ import annotations

import random

from tests.support.prefix_aware import Clock, ask, check_invariants, chunk_ends, fleet, make, words


def test_match_agrees_with_a_brute_force_longest_common_prefix() -> None:
    rng = random.Random(5)
    policy = make({"chunk_chars": 16, "chunk_doubling": 4})
    alphabet = "ab"  # few letters, so prompts share prefixes of every length
    stored: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for _ in range(60):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        worker = rng.randrange(3)
        policy.insert(worker, text)
        stored[worker].append(text)
    for _ in range(300):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        ends = chunk_ends(policy, len(query))

        def depth(text: str, query: str = query, ends: list[int] = ends) -> int:
            # Chunk d matches when everything up to its end is equal (clipped to each text).
            d = 0
            while d < len(ends) and query[: ends[d]] == text[: ends[d]]:
                d += 1
            return d

        best, holders = 0, []
        for worker, texts in stored.items():
            got = max(depth(text) for text in texts) if texts else 0
            if got and got > best:
                best, holders = got, [worker]
            elif got and got == best:
                holders.append(worker)
        chars = min(ends[best - 1], len(query)) if best else 0
        assert policy.match(query, [0, 1, 2]) == (chars, holders)
    check_invariants(policy)


def test_total_entries_never_exceed_max_entries() -> None:
    policy, workers = make({"max_entries": 40, "chunk_chars": 8}), fleet(4)
    for i in range(200):
        ask(policy, workers, words(f"t{i % 23}-", 10 + i % 37), {i % 4: 1})
        assert policy.entries <= 40
        assert policy.entries == sum(policy.tree_size(w.id) for w in workers)
        check_invariants(policy)
    assert policy.entries >= 30  # it is bounded, not emptied
    # A single prompt larger than the bound keeps only its (newest) prefix.
    policy.insert(0, words("huge", 500))
    assert policy.entries <= 40
    assert policy.match(words("huge", 500), [0])[0] > 0


def test_entries_unused_for_max_age_are_evicted() -> None:
    clock = Clock()
    policy, workers = make({"max_age_s": 60}, clock), fleet(2)
    old = words("old", 300)
    policy.insert(0, old)
    size = policy.tree_size(0)
    assert size > 0
    clock.now += 59
    for _ in range(2):  # decisions elsewhere sweep every tree in turn
        ask(policy, [workers[1]], "elsewhere")
    assert policy.tree_size(0) == size
    assert policy.match(old, [0, 1])[1] == [0]
    clock.now += 2  # 61 s since its last use
    for _ in range(2):
        ask(policy, [workers[1]], "elsewhere")
    assert policy.tree_size(0) == 0
    assert policy.match(old, [0, 1]) == (0, [])
    assert 0 not in policy._trees
    check_invariants(policy)
    # Sweeping is incremental: a decision sweeps two trees (here twice the same one), at
    # most 32 + its own chunk count items each.
    big = make({"max_age_s": 60, "chunk_chars": 8, "chunk_doubling": 0}, clock)
    big.insert(0, words("bulk", 2000))
    before = big.entries
    clock.now += 100
    ask(big, [workers[0]], "tiny")
    assert before - big.entries == 2 * 33 - 1  # 66 evicted, "tiny" added
    while big.tree_size(0) > 1:
        ask(big, [workers[0]], "tiny")
        assert len(big._marks[0]) <= 2
    assert big.entries == 1  # only "tiny", used all along
    check_invariants(big)


def test_time_marks_stay_few_however_rarely_a_tree_is_swept() -> None:
    clock = Clock()
    policy, workers = make({"max_age_s": 60}, clock), fleet(40)
    for step in range(3000):
        if step % 20 == 0:  # keep 39 other trees alive, so tree 0 is swept 1 time in 40
            for w in workers[1:]:
                policy.insert(w.id, words(f"keep{w.id}-", 30))
        clock.now += 2.0  # each credit of worker 0 adds a mark (every 60/32 s at most)
        ask(policy, workers[:1], words(f"t{step}-", 20))
        # A mark lives max_age_s (here 30 marks, one per 2 s), not one more per credit
        # forever: the credited tree is swept too, not only 1 time in 40.
        assert len(policy._marks[0]) <= 30 + 2
    assert len(policy._trees) == 40
    check_invariants(policy)


def test_a_refreshed_prefix_outlives_its_old_extensions() -> None:
    clock = Clock()
    policy = make({"max_age_s": 60}, clock)
    system = words("sys", 100)
    conv1 = system + " " + words("conv1-", 200)
    conv2 = system + " " + words("conv2-", 10)
    policy.insert(0, conv1)
    clock.now += 50
    policy.insert(0, conv2)  # uses the shared prefix again
    clock.now += 20  # conv1's own chunks are stale now, the system prompt is not
    for _ in range(2):
        ask(policy, [fleet(2)[1]], "elsewhere")
    matched, holders = policy.match(conv1, [0])
    assert holders == [0]
    common = next(i for i, (x, y) in enumerate(zip(conv1, conv2, strict=False)) if x != y)
    assert matched == common // 128 * 128 > 0
    assert policy.match(conv2, [0]) == (len(conv2), [0])
    check_invariants(policy)


def test_random_traffic_keeps_the_indexes_exact() -> None:
    rng = random.Random(11)
    clock = Clock()
    policy = make({"max_entries": 300, "max_age_s": 30, "chunk_chars": 8}, clock)
    workers = fleet(6)
    systems = [words(f"s{i}-", 20) for i in range(4)]
    for step in range(1500):
        present = [w for w in workers if rng.random() < 0.8] or workers[:1]
        text = rng.choice(systems) + " " + words(f"u{rng.randrange(40)}-", rng.randrange(1, 30))
        inflight = {w.id: rng.randrange(0, 50) for w in present}
        # What each tree holds of this prompt's chain is a prefix of it (so binary search
        # is exact), and match() finds the longest one among the workers present.
        chain = policy._chain(text)
        depths = {}
        for w, tree in policy._trees.items():
            has = [key in tree for key in chain]
            depths[w] = has.count(True)
            assert has == [True] * depths[w] + [False] * (len(chain) - depths[w])
        best = max((depths.get(w.id, 0) for w in present), default=0)
        ends = chunk_ends(policy, len(text))
        expected = [w.id for w in present if best and depths.get(w.id) == best]
        chars = min(ends[best - 1], len(text)) if best else 0
        assert policy.match(text, [w.id for w in present]) == (chars, expected)
        assert ask(policy, present, text, inflight) in present
        clock.now += rng.choice((0.0, 0.1, 1.0, 5.0))
        if step % 50 == 0:
            check_invariants(policy)
    check_invariants(policy)
    assert set(policy.decisions) == {"prefix", "load", "miss"}
