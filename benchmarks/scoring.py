"""Text normalisation and corpus error rates for the benchmarks.

Whisper writes "Mr. Dashwood", "25" and "ill-disposed" where a reference
transcript may say "mister dashwood", "twenty five" and "ill disposed".
Counting those as errors would measure formatting, not recognition, so both
sides are normalised the same way before scoring.  Chinese is scored per
character (it has no word spaces), after mapping Arabic digits to Chinese
numerals so that "180度" and "一百八十度" agree.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache

# ---------------------------------------------------------------- English

_TITLES = {"mr": "mister", "mrs": "missus", "dr": "doctor"}

_UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen"
    " fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_SMALL = {w: i for i, w in enumerate(_UNITS)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
_SCALES = {"thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}

_ORDINAL_SMALL = {
    "first": 1, "second": 2, "third": 3, "fifth": 5, "eighth": 8, "ninth": 9, "twelfth": 12,
}
for _w, _v in _SMALL.items():  # fourth, sixteenth, twentieth, ...
    _ORDINAL_SMALL.setdefault((_w[:-1] + "ieth") if _w.endswith("y") else _w + "th", _v)
_ORDINAL_SCALES = {"hundredth": 100, "thousandth": 1_000, "millionth": 1_000_000}

# a decimal number, or a word/number that may carry inner apostrophes
_TOKEN = re.compile(r"\d+\.\d+|[^\W_]+(?:'[^\W_]+)*")


def _ordinal_suffix(n: int) -> str:
    if n % 100 in (11, 12, 13):
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


class _Number:
    """Accumulates one spelled-out number such as "two thousand and five"."""

    def __init__(self) -> None:
        self.total = 0  # completed thousands/millions part
        self.current = 0  # part below the last scale word
        self.last_scale = 10**12
        self.words = 0

    def can_add(self, value: int) -> bool:
        """Whether a 0..99 value continues this number ("twenty five"), not a new one ("one two")."""
        if self.words == 0:
            return True
        if value == 0 or self.value() == 0:  # "zero five" is two numbers
            return False
        if value >= 100:  # digits such as "250" only follow a scale word
            return self.current == 0
        if value < 10:
            return self.current % 10 == 0 and not 10 <= self.current % 100 < 20
        return self.current % 100 == 0

    def value(self) -> int:
        return self.total + self.current


def _small(tok: str) -> int | None:
    """Value of a cardinal below 1000 written as a word ("twelve") or digits ("250")."""
    if tok.isdigit() and len(tok) < 4:
        return int(tok)
    return _SMALL.get(tok)


def _convert_numbers(tokens: list[str]) -> list[str]:
    """Replace spelled-out cardinals/ordinals/decimals by digits; "1st" stays "1st"."""
    out: list[str] = []
    num = _Number()

    def flush() -> None:
        nonlocal num
        if num.words:
            out.append(str(num.value()))
        num = _Number()

    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        small = _small(tok)
        if small is None and tok[0].isdigit() and tok.replace(".", "").isdigit():
            flush()  # 1990, 7.5: already digits
            out.append(tok)
        elif small is not None:
            if not num.can_add(small):
                flush()
            num.current += small
            num.words += 1
        elif tok == "a" and nxt in ("hundred", *_SCALES) and num.words == 0:
            num.current, num.words = 1, 1
        elif tok == "hundred" and 0 < num.current < 100:
            num.current *= 100
            num.words += 1
        elif tok in _SCALES and num.current and _SCALES[tok] < num.last_scale:
            num.total += num.current * _SCALES[tok]
            num.current, num.last_scale = 0, _SCALES[tok]
            num.words += 1
        elif tok == "and" and num.value() and num.current % 100 == 0 and (_small(nxt) or nxt in _ORDINAL_SMALL):
            pass  # "one hundred and five"
        elif tok == "point" and num.words and (nxt.isdigit() or _SMALL.get(nxt, 10) < 10):
            digits = ""  # "seven point two five" -> 7.25
            while i + 1 < len(tokens) and (tokens[i + 1].isdigit() or _SMALL.get(tokens[i + 1], 10) < 10):
                i += 1
                digits += tokens[i] if tokens[i].isdigit() else str(_SMALL[tokens[i]])
            out.append(f"{num.value()}.{digits}")
            num = _Number()
        elif tok in _ORDINAL_SMALL:
            if not num.can_add(_ORDINAL_SMALL[tok]):
                flush()
            n = num.value() + _ORDINAL_SMALL[tok]
            out.append(f"{n}{_ordinal_suffix(n)}")
            num = _Number()
        elif tok in _ORDINAL_SCALES:
            n = max(num.current, 1) * _ORDINAL_SCALES[tok] + num.total
            out.append(f"{n}{_ordinal_suffix(n)}")
            num = _Number()
        else:
            flush()
            out.append(tok)
        i += 1
    flush()
    return out


def normalize_en(text: str) -> str:
    """Lowercase, strip punctuation, unify titles and write every number in digits."""
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'").replace("\u2018", "'")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,000 -> 1000
    text = re.sub(r"\b(mrs|mr|dr)\b\.?", lambda m: _TITLES[m.group(1)], text)
    text = text.replace("%", " percent ")
    text = re.sub(r"[-\u2010-\u2015]", " ", text)  # twenty-five -> twenty five
    tokens = [t.replace("'", "") for t in _TOKEN.findall(text)]  # don't -> dont
    return " ".join(_convert_numbers(tokens))


# ---------------------------------------------------------------- Chinese

_ZH_DIGITS = "零一二三四五六七八九"


def _zh_below_10000(n: int) -> str:
    out, need_zero = "", False
    for unit_value, unit in ((1000, "千"), (100, "百"), (10, "十"), (1, "")):
        d = n // unit_value % 10
        if d:
            if need_zero:
                out += "零"
            out += _ZH_DIGITS[d] + unit
            need_zero = False
        elif out:
            need_zero = True
    return out


def zh_number(n: int) -> str:
    """Read a non-negative integer in Chinese: 2 -> 二, 15 -> 十五, 105 -> 一百零五, 20000 -> 二万."""
    if n == 0:
        return "零"
    groups = []
    while n:
        groups.append(n % 10000)
        n //= 10000
    out = ""
    for idx in range(len(groups) - 1, -1, -1):
        g = groups[idx]
        if g:
            if out and g < 1000 and not out.endswith("零"):
                out += "零"
            out += _zh_below_10000(g) + ("", "万", "亿", "万亿")[idx]
        elif out and not out.endswith("零"):
            out += "零"
    out = out.rstrip("零")
    return out[1:] if out.startswith("一十") else out  # 十五, not 一十五


def _zh_digits(digits: str) -> str:
    return "".join(_ZH_DIGITS[int(d)] for d in digits)


def _zh_replace_number(m: re.Match[str]) -> str:
    whole, frac, percent = m.groups()
    text = zh_number(int(whole))
    if frac:
        text += "点" + _zh_digits(frac)
    return "百分之" + text if percent else text


def normalize_zh(text: str) -> str:
    """Drop punctuation, symbols and spaces; write Arabic numbers as Chinese numerals."""
    text = unicodedata.normalize("NFKC", text).lower()  # full-width digits/letters -> ASCII
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)
    text = re.sub(r"(?<!\d)(\d{4})年", lambda m: _zh_digits(m.group(1)) + "年", text)  # years digit by digit
    text = re.sub(r"(\d+)(?:\.(\d+))?(%)?", _zh_replace_number, text)
    return "".join(c for c in text if unicodedata.category(c)[0] in "LN")


# ---------------------------------------------------------------- scoring


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Levenshtein distance (substitutions + deletions + insertions)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i]
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1]


def _corpus_rate(refs: list[list[str]], hyps: list[list[str]]) -> float:
    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    edits = sum(edit_distance(r, h) for r, h in zip(refs, hyps))
    total = sum(len(r) for r in refs)
    if total == 0:  # empty references: any output is wholly wrong
        return 0.0 if edits == 0 else 1.0
    return edits / total


def wer(refs: list[str], hyps: list[str]) -> float:
    """Corpus word error rate: all edits over all reference words, after normalize_en.

    Pooling (rather than averaging per-utterance rates) keeps short clips from
    dominating the figure.
    """
    return _corpus_rate([normalize_en(r).split() for r in refs], [normalize_en(h).split() for h in hyps])


def cer(refs: list[str], hyps: list[str]) -> float:
    """Corpus character error rate for Chinese, after normalize_zh."""
    return _corpus_rate([list(normalize_zh(r)) for r in refs], [list(normalize_zh(h)) for h in hyps])


@lru_cache(maxsize=1)
def _t2s():  # building the converter reads dictionaries; do it once
    from opencc import OpenCC

    return OpenCC("t2s")


def has_traditional(text: str) -> bool:
    """True if the text contains traditional characters (opencc t2s would change it).

    Whisper's zh output drifts into traditional script; a classroom in the
    mainland wants simplified, so we count how often that happens.
    """
    return _t2s().convert(text) != text
