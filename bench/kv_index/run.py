"""What does the exact KV index (routing.kv.kv_index) cost? Memory at 1 million blocks, the time
to ingest one event, and the lookups a policy makes.

Events are built as vLLM sends them (routing.kv.kv_events decodes current vLLM's msgpack maps):
``BlockStored`` of one full block of 16 token ids, chained to the block before, in prompts of
64 blocks (1,024 tokens) that share nothing; then ``BlockRemoved`` of one block. "Ingesting"
is what the subscriber does per message after the socket: decode the payload (msgspec), check
its sequence number, apply its events.

* **Memory.** One worker's index filled with 1,000,000 blocks (cap raised to fit), measured
  with tracemalloc (Python allocations, so exact for the index's dicts and ints), reported as
  MiB and bytes per block. Integer block hashes (vLLM's default); bytes hashes (sha256) add
  their 33-byte objects.
* **Ingest.** Batches of one event, decoded and applied one at a time, timed in a loop of
  100,000 (store) and 100,000 (remove); the median of 5 repetitions, per event.
* **Lookup.** A 4,096-token prompt (256 blocks, all cached): ``chain_hashes`` once, then
  ``cached_blocks_in_chain`` per worker; and what kv_aware calls, ``cached_blocks_all``: one
  walk for 8 workers, worker i holding the first (i + 1)/8 of the blocks; medians of 5
  repetitions of 2,000 calls.

``python -m bench.kv_index [--quick]``. Prints the machine first.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable

import msgspec

from bench.common.output import machine_info
from routing.kv.kv_events import BlockRemoved, BlockStored, KVEventBatch, apply_batch, decode_batch
from routing.kv.kv_index import KvIndex, chain_hashes

BLOCK = 16
PROMPT_BLOCKS = 64
ENCODER = msgspec.msgpack.Encoder()


def stored_payloads(n_blocks: int, first_hash: int = 1) -> list[bytes]:
    """One payload per block: each a batch with one BlockStored chained to the one before."""
    payloads = []
    for i in range(n_blocks):
        block_hash = first_hash + i
        parent = None if i % PROMPT_BLOCKS == 0 else block_hash - 1
        tokens = list(range(block_hash * BLOCK, (block_hash + 1) * BLOCK))
        event = BlockStored([block_hash], parent, tokens, BLOCK, None, "GPU", None)
        payloads.append(ENCODER.encode(KVEventBatch(time.time(), [event], 0)))
    return payloads


def ingest(index: KvIndex, payloads: list[bytes], first_seq: int) -> float:
    """Seconds to decode, sequence-check and apply every payload."""
    start = time.perf_counter()
    for seq, payload in enumerate(payloads, first_seq):
        index.check_sequence(0, seq)
        apply_batch(index, 0, decode_batch(payload))
    return time.perf_counter() - start


def memory_at(n_blocks: int) -> tuple[float, int]:
    """(MiB, blocks held) of an index filled with n_blocks, by tracemalloc."""
    payloads = stored_payloads(n_blocks)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = KvIndex(max_blocks_per_worker=n_blocks + 1)
    ingest(index, payloads, 0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    status = index.status(0)
    assert status is not None and status.blocks == n_blocks, status
    return used / 2**20, status.blocks


def per_event_ns(reps: int, n: int) -> tuple[float, float]:
    """Median ns per stored and per removed event over `reps` repetitions of `n` events."""
    stores, removes = [], []
    for _ in range(reps):
        index = KvIndex(max_blocks_per_worker=2 * n)
        payloads = stored_payloads(n)
        removals = [
            ENCODER.encode(KVEventBatch(time.time(), [BlockRemoved([h], "GPU")], 0))
            for h in range(1, n + 1)
        ]
        gc.collect()
        stores.append(ingest(index, payloads, 0) / n * 1e9)
        removes.append(ingest(index, removals, n) / n * 1e9)
    return statistics.median(stores), statistics.median(removes)


def lookup_us(reps: int, calls: int) -> tuple[float, float, float]:
    """Median µs of chain_hashes on a 4,096-token prompt, of one worker's match, and of
    the shared walk for 8 workers."""
    index = KvIndex()
    index.check_sequence(0, 0)
    tokens = list(range(4096))
    hashes = list(range(1, 257))
    index.store(0, hashes, None, tokens, BLOCK, None)
    chain = chain_hashes(tokens, None, BLOCK)
    assert index.cached_blocks_in_chain(0, chain, BLOCK) == 256

    def timed(call: Callable[[], object]) -> float:
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            runs.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(runs)

    for w in range(1, 8):
        index.check_sequence(w, 0)
        held = 256 * (w + 1) // 8
        index.store(w, list(range(1000 * w, 1000 * w + held)), None, tokens, BLOCK, None)
    ids = list(range(8))
    assert index.cached_blocks_all(ids, tokens, None, BLOCK)[7] == (256, BLOCK)
    return (
        timed(lambda: chain_hashes(tokens, None, BLOCK)),
        timed(lambda: index.cached_blocks_in_chain(0, chain, BLOCK)),
        timed(lambda: index.cached_blocks_all(ids, tokens, None, BLOCK)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="100k blocks, 3 repetitions")
    args = parser.parse_args()
    blocks, reps, n = (100_000, 3, 20_000) if args.quick else (1_000_000, 5, 100_000)
    print("machine:", machine_info())
    mib, held = memory_at(blocks)
    print(f"memory: {held:,} blocks in {mib:.1f} MiB, {mib * 2**20 / held:.0f} bytes per block")
    store_ns, remove_ns = per_event_ns(reps, n)
    print(f"ingest (decode + sequence + apply), median of {reps} x {n:,}:")
    print(f"  BlockStored of 1 block of {BLOCK} tokens: {store_ns / 1000:.2f} µs per event")
    print(f"  BlockRemoved of 1 block: {remove_ns / 1000:.2f} µs per event")
    chain, match, walk = lookup_us(reps, 2_000)
    print(f"lookup, 4,096-token prompt (256 blocks), median of {reps} x 2,000:")
    print(f"  chain_hashes once per request: {chain:.1f} µs")
    print(f"  cached_blocks_in_chain per worker: {match:.1f} µs")
    print(f"  cached_blocks_all, 8 workers in one walk (kv_aware's): {walk:.1f} µs")
    return 0
