"""The prefix_aware policy's cutting of a prompt into chunks, each named by a chained hash.

The prompt text (routing.policies.request_text), as UTF-8, is cut into chunks at fixed
offsets: ``chunk_chars`` bytes each for the first ``chunk_doubling`` chunks, then twice as
long for the next ``chunk_doubling``, and so on (for English text a byte is a character;
``chunk_doubling`` 0 keeps every chunk ``chunk_chars`` long). Chunk *i* gets a chained hash
naming the whole prefix up to its end: CRC-32 and Adler-32 of the prefix, each carried over
from the chunk before (zlib's running checksums, C speed), side by side in one 64-bit key
(``crc << 32 | adler``), the way vLLM chains each block's hash to its parent's. The hash is
the same in every process (Python's own hash() is salted per process), so routers can share
what they learned (routing.peers.fleet_sync); a collision needs both checksums to agree,
which a false prefix match of an approximate index can live with. A short last chunk is
hashed too, so a repeated short prompt matches whole.

The chunk offsets are computed once, as far as the longest prompt seen so far reaches, and
kept on the policy (``_starts``, ``_ends``, ``_slices``), so cutting a prompt is one slice,
two checksums and an append per chunk. Not thread-safe, no I/O: a mix-in of the policy's,
as routing.policies.prefix_trees is.
"""

from __future__ import annotations

from bisect import bisect_left
from zlib import adler32, crc32


class PromptChunks:
    """Chunk offsets grown on demand, and the chain of a text (the last one cut: its UTF-8
    length is ``_chained_bytes``)."""

    chunk_chars: int
    chunk_doubling: int

    def _init_chunks(self, chunk_chars: int, chunk_doubling: int) -> None:
        self.chunk_chars = chunk_chars
        self.chunk_doubling = chunk_doubling
        # Chunk i spans _starts[i] up to _ends[i], sliced by _slices[i]; grown on demand.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._slices: list[slice] = []
        self._chained_bytes = 0  # the UTF-8 length of the text _chain last cut

    def _chain(self, text: str) -> list[int]:
        """The chained hash of every chunk of `text`, in order (the last one may be short)."""
        data = memoryview(text.encode("utf-8", "surrogatepass"))
        n = self._chained_bytes = len(data)
        if not n:
            return []
        if not self._ends or self._ends[-1] < n:
            self._grow_chunks(n)
        m = bisect_left(self._starts, n)  # chunks that start inside the text
        chain: list[int] = []
        crc, adler = 0, 1
        for piece in map(data.__getitem__, self._slices[:m]):
            crc, adler = crc32(piece, crc), adler32(piece, adler)
            chain.append(crc << 32 | adler)
        return chain

    def _grow_chunks(self, n: int) -> None:
        starts, ends, slices = self._starts, self._ends, self._slices
        pos = ends[-1] if ends else 0
        while pos < n:
            i = len(starts)
            size = self.chunk_chars << (i // self.chunk_doubling if self.chunk_doubling else 0)
            starts.append(pos)
            ends.append(pos + size)
            slices.append(slice(pos, pos + size))
            pos += size
