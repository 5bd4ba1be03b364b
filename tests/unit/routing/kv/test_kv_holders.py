"""routing.kv.kv_holders: one map from block key to the bits of the workers holding it, walked
once for all workers, and an emptied worker's old bit swept a step at a time."""

from __future__ import annotations

from routing.kv.kv_holders import Holders, blocks

SEED, SIZE = 7, 4


def chain(token_ids: list[int], seed: int = SEED) -> list[int]:
    """The block keys the walk computes: each full block's hash chained to its parent's."""
    keys, key = [], seed
    for block in blocks(token_ids, SIZE):
        key = hash((key, block))
        keys.append(key)
    return keys


def hold(holders: Holders, bit: int, keys: list[int]) -> None:
    for key in keys:
        holders.map[key] = holders.map.get(key, 0) | bit


def test_blocks_are_the_full_blocks_only() -> None:
    assert list(blocks(range(10), 4)) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert list(blocks([], 4)) == []


def test_one_walk_gives_each_workers_leading_blocks_and_where_each_stops() -> None:
    holders = Holders()
    a, b, c = holders.add_worker(10), holders.add_worker(20), holders.add_worker(30)
    assert (a, b, c) == (1, 2, 4)
    prompt = list(range(18))  # four full blocks and two tokens over
    keys = chain(prompt)
    hold(holders, a, keys)  # all four
    hold(holders, b, keys[:2])
    hold(holders, c, keys[1:])  # not the first: a prefix it does not hold counts nothing
    next_keys: dict[int, int] = {}
    depths = holders.walk(a | b | c, prompt, SEED, SIZE, next_keys)
    assert dict(depths) == {10: 4, 20: 2, 30: 0}
    assert next_keys == {20: keys[2], 30: keys[0]}  # the one holding everything has none
    assert dict(holders.walk(b | c, prompt, SEED, SIZE)) == {20: 2, 30: 0}
    assert holders.walk(a, prompt, SEED + 1, SIZE) == [(10, 0)]  # another seed, another chain
    assert holders.leading(b, keys) == 2 and holders.leading(a, keys) == 4


def test_an_emptied_worker_takes_a_fresh_bit_and_its_old_one_is_swept_in_steps() -> None:
    holders = Holders()
    a, b = holders.add_worker(1), holders.add_worker(2)
    keys = [hash(("k", i)) for i in range(10)]
    hold(holders, a, keys)
    hold(holders, b, keys[:3])
    fresh = holders.retire(a, keys)
    assert fresh not in (a, b) and holders.owner == {b: 2, fresh: 1}
    third = holders.add_worker(3)
    assert third not in (a, b, fresh)  # the bit being swept is not reused
    assert holders.walk(fresh, [], SEED, SIZE) == [(1, 0)]
    assert holders.leading(fresh, keys) == 0  # the old bit never reads as the worker's
    holders.sweep(4)
    assert sum(1 for key in keys if holders.map.get(key, 0) & a) == 6  # four swept
    holders.sweep(100)
    assert not any(holders.map.get(key, 0) & a for key in keys) and not holders.dead
    assert holders.map == {key: b for key in keys[:3]}  # the other worker's bits are kept
    holders.drop_worker(third)
    assert holders.add_worker(4) == a  # swept: free again


def test_the_last_worker_dropped_empties_the_map() -> None:
    holders = Holders()
    a, b = holders.add_worker(1), holders.add_worker(2)
    hold(holders, a | b, [1, 2, 3])
    holders.unhold(a, 3)
    assert holders.map[3] == b  # the other holder's bit is kept
    holders.unhold(b, 3)
    assert 3 not in holders.map  # nobody holds it: the key goes
    holders.drop_worker(a)
    assert holders.map == {1: a | b, 2: a | b}  # dropping one worker sweeps nothing itself
    holders.drop_worker(b)
    assert holders.map == {} and holders.owner == {} and holders.dead == []
