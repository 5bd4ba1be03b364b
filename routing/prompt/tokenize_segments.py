"""A chat prompt's token ids from cached pieces: the text between its special tokens.

A rendered chat prompt is mostly what the conversation's earlier requests already sent: the
system prompt, the shared document, the turns before. Encoding it whole costs about a
millisecond per thousand tokens of router CPU, every request. The Hugging Face tokenizer
itself first cuts a text at its added tokens (``<|user|>``, ``<|end|>``, ...) and
normalizes, pre-tokenizes and encodes each piece between them on its own, so encoding the
pieces apart and joining them gives the same ids, and a piece seen before need not be
encoded again.

That holds for the tokenizers whose pieces do not depend on where they stand:

* **Off by construction** when an added token has ``lstrip``, ``rstrip``, ``single_word`` or
  ``normalized`` set (the cut would then not fall where the tokenizer's does), or when a
  ``Metaspace`` pre-tokenizer prepends its marker only to the text's first piece
  (``prepend_scheme: first``), and for requests that ask for special tokens to be added
  (a post-processor acts on the whole). Those tokenizers encode the whole text, as before.
* **Checked on live traffic**: the first CHECK_FIRST prompts and then one in CHECK_EVERY
  are also encoded whole, on the tokenizer's thread, off the request path, and compared.
  One difference turns the cache off for that folder for good, with a warning in the log;
  checks and their outcomes are on /metrics (``controlpanel_router_tokenizer_pieces``).

The cache holds the CACHE_ENTRIES pieces last used (least recently used goes first).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

CACHE_ENTRIES = 4096
CHECK_FIRST, CHECK_EVERY = 32, 256


class Plan:
    """One prompt cut into pieces: the special tokens' ids, the pieces found cached, and
    the texts still to encode."""

    __slots__ = ("found", "missing", "pieces")

    def __init__(self, pieces: list[str], found: dict[str, list[int]], missing: list[str]) -> None:
        self.pieces, self.found, self.missing = pieces, found, missing


class PieceCache:
    """One tokenizer folder's cache of encoded pieces (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_json: Mapping[str, Any]) -> None:
        added = tokenizer.get_added_tokens_decoder()
        self.off = _why_not(added.values(), tokenizer_json)
        self._special_ids = {token.content: i for i, token in added.items()}
        contents = sorted(self._special_ids, key=len, reverse=True)  # leftmost-longest
        self._cut = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents else None
        self._ids: dict[str, list[int]] = {}
        self.prompts = 0
        self.counts: Counter[str] = Counter()  # hit, miss; check_match, check_mismatch

    def plan(self, text: str) -> Plan | None:
        """The prompt's pieces and which need encoding; None while the cache is off."""
        if self.off is not None or self._cut is None:
            return None
        pieces = self._cut.split(text)  # the special tokens at the odd places
        found: dict[str, list[int]] = {}
        missing: list[str] = []
        ids = self._ids
        for piece in pieces[::2]:
            if not piece or piece in found:
                continue
            cached = ids.pop(piece, None)
            if cached is None:
                missing.append(piece)
                continue
            ids[piece] = found[piece] = cached  # now the most recently used
        self.counts["hit"] += len(found)
        self.counts["miss"] += len(missing)
        return Plan(pieces, found, list(dict.fromkeys(missing)))

    def join(self, plan: Plan, encoded: list[list[int]]) -> list[int]:
        """The prompt's ids, from the plan and the missing pieces' ids (in its order)."""
        found = plan.found
        for piece, piece_ids in zip(plan.missing, encoded, strict=True):
            found[piece] = piece_ids
            self._store(piece, piece_ids)
        out: list[int] = []
        special = self._special_ids
        for i, piece in enumerate(plan.pieces):
            if i % 2:
                out.append(special[piece])
            elif piece:
                out.extend(found[piece])
        self.prompts += 1
        return out

    def due_check(self) -> bool:
        return self.prompts <= CHECK_FIRST or self.prompts % CHECK_EVERY == 0

    def check(self, tokenizer: Tokenizer, text: str, ids: list[int]) -> None:
        """Compare with the whole text's encoding (on the tokenizer's thread)."""
        whole = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        if whole == ids:
            self.counts["check_match"] += 1
            return
        self.counts["check_mismatch"] += 1
        self.off = "its pieces encoded apart did not match the whole prompt's encoding"
        log.warning("tokenizer piece cache turned off: %s", self.off)

    def _store(self, piece: str, piece_ids: list[int]) -> None:
        if self.off is not None:
            self._ids.clear()
            return
        self._ids[piece] = piece_ids
        if len(self._ids) > CACHE_ENTRIES:
            del self._ids[next(iter(self._ids))]  # the least recently used


def _why_not(added: Any, tokenizer_json: Mapping[str, Any]) -> str | None:
    """Why this tokenizer's pieces cannot be encoded apart, or None when they can."""
    for token in added:
        flags = [f for f in ("lstrip", "rstrip", "single_word", "normalized") if getattr(token, f)]
        if flags:
            return f"the added token {token.content!r} has {', '.join(flags)} set"
    for node in _nodes(tokenizer_json.get("pre_tokenizer")):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return "its Metaspace pre-tokenizer marks only the text's first piece"
    return None


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    """A pre-tokenizer and, for a Sequence, every one in it."""
    if isinstance(node, dict):
        yield node
        for inner in node.get("pretokenizers") or ():
            yield from _nodes(inner)


def tokenizer_json(text: str) -> dict[str, Any]:
    loaded = json.loads(text)
    return loaded if isinstance(loaded, dict) else {}
