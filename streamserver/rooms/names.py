"""A student's display name as the dashboard shows it: what cannot be seen is removed, and what is
left must show something.

Removed first: every format character (Unicode category Cf: the zero-width space, joiners and
non-joiners, the word joiner, the byte order mark, soft hyphens, the bidi marks, embeddings,
overrides and isolates that could reorder the dashboard's text, invisible operators, tags),
control characters (Cc) and lone surrogates (Cs, from JSON "\\ud800" escapes), the combining
grapheme joiner and variation selectors, and the letters and symbols that draw nothing (the Hangul
fillers, the braille blank). A name of spaces and combining marks alone draws nothing either: a
name needs one visible character (a letter, digit, punctuation mark or symbol of any script).
"""

from __future__ import annotations

import unicodedata

MAX_CHARS = 80
_STRIPPED_CATEGORIES = {"Cf", "Cc", "Cs"}
# Invisible characters that Unicode gives another category: Mn (the combining grapheme joiner,
# variation selectors), Lo (the Hangul fillers), So (the braille pattern blank).
_BLANK = {"\u034f", "\u115f", "\u1160", "\u3164", "\uffa0", "\u2800", "\u17b4", "\u17b5",
          *map(chr, range(0xFE00, 0xFE10)), *map(chr, range(0x180B, 0x1810)), *map(chr, range(0xE0100, 0xE01F0))}
_VISIBLE = set("LNPS")  # the first letter of a category that draws a glyph of its own


class BadName(ValueError):
    """The name cannot be shown (the message says why)."""


def clean(name: object, field: str, max_chars: int = MAX_CHARS) -> str:
    """The name without its invisible characters, or BadName."""
    if isinstance(name, str):
        name = "".join(c for c in name if c not in _BLANK and unicodedata.category(c) not in _STRIPPED_CATEGORIES).strip()
    if not isinstance(name, str) or not 0 < len(name) <= max_chars or not any(unicodedata.category(c)[0] in _VISIBLE for c in name):
        raise BadName(f"{field} must be a string of 1 to {max_chars} characters with a visible one (control, format, "
                      "bidi and invisible characters are removed first)")
    return name
