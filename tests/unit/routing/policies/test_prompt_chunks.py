"""routing.policies.prompt_chunks: where a prompt's chunks end, and the chained hash that names
each chunk's whole prefix, the same in every process."""

from __future__ import annotations

from zlib import adler32, crc32

from routing.policies.prompt_chunks import PromptChunks
from tests.support.prefix_aware import chunk_ends, make, words


def test_chunks_double_after_chunk_doubling_and_stay_fixed_without() -> None:
    growing = make({"chunk_chars": 100, "chunk_doubling": 2})
    assert chunk_ends(growing, 2000) == [100, 200, 400, 600, 1000, 1400, 2200]
    fixed = make({"chunk_chars": 100, "chunk_doubling": 0})
    assert chunk_ends(fixed, 450) == [100, 200, 300, 400, 500]


def chunks(chunk_chars: int, chunk_doubling: int) -> PromptChunks:
    cutter = PromptChunks()
    cutter._init_chunks(chunk_chars, chunk_doubling)
    return cutter


def test_each_key_names_the_whole_prefix_up_to_its_chunk_end() -> None:
    """crc32 << 32 | adler32 of the UTF-8 prefix: zlib's, so the same in every process."""
    cutter = chunks(8, 2)
    text = "The quick brown fox jumps over the lazy dog, twice over."
    data = text.encode()
    chain = cutter._chain(text)
    # 8, 8, then 16, 16, then 32...: ends at 8, 16, 32, 48 and the text's end (56 bytes).
    ends = [min(end, len(data)) for end in (8, 16, 32, 48, 80)]
    assert len(chain) == len(ends) and ends[-1] == len(data)
    assert chain == [crc32(data[:end]) << 32 | adler32(data[:end]) for end in ends]
    assert cutter._chained_bytes == len(data)


def test_an_extended_prompt_shares_the_chain_of_its_whole_chunks() -> None:
    cutter = chunks(16, 0)
    short = words("a", 10)  # 29 bytes: one whole chunk and a short last one
    longer = short + " " + words("b", 20)
    first, second = cutter._chain(short), cutter._chain(longer)
    assert len(first) == 2 and first[0] == second[0]
    assert first[1] != second[1]  # the short last chunk names a different prefix
    assert cutter._chain(short) == first  # a repeated short prompt matches whole
    assert cutter._chain(words("c", 10))[0] != first[0]


def test_chunks_are_cut_in_utf8_bytes_and_any_text_is_accepted() -> None:
    cutter = chunks(8, 0)
    assert cutter._chain("") == [] and cutter._chained_bytes == 0
    assert len(cutter._chain("é" * 8)) == 2 and cutter._chained_bytes == 16
    assert len(cutter._chain("\ud800 lone surrogate")) == 3  # no UnicodeEncodeError
    # Offsets grow on demand and are kept: a shorter prompt after a long one cuts the same.
    assert cutter._chain("x" * 4000)[:2] == cutter._chain("x" * 16)
