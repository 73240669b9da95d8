"""Cheap text cues that an embedding of a short transcript can miss: is it phrased as a
question, does it ask for repetition or report a problem, is it a bare answer token."""

from __future__ import annotations

import re

import numpy as np

_PATTERNS = [
    # phrased as a question
    r"[?？]\s*$",
    r"^(what|why|how|when|where|who|which|is|are|does|do|can|could|would|will|should)\b",
    r"(吗|呢|么)[?？。.!！]?\s*$|为什么|怎么|什么|哪|是不是|多少|如何",
    # asks for help: repeat, slower, lost, technical trouble
    r"\b(again|repeat|slow(er)?|lost|stuck|confus|don'?t (get|understand)|didn'?t (get|hear|catch)|can'?t (hear|see)|"
    r"mic|microphone|camera|screen|audio|internet|lag|frozen|froze|help)\b",
    r"再(说|讲|来)|没听(懂|清)|听不(懂|清|见|到)|不懂|不明白|慢一点|卡住|卡了|帮帮|看不(见|到|清)|麦克风|网络|声音|屏幕",
    # greeting, thanks, ready, done
    r"\b(hi|hello|good (morning|afternoon)|thanks?|thank you|ok(ay)?|got it|ready|done|finished|sure|yes|yeah)\b",
    r"你好|老师好|谢谢|明白了|懂了|好的|准备好|做完|完成了|知道了",
    # bare answer: a number, a letter option, "the answer is"
    r"^\s*(option\s+)?[a-d]\s*[.!]?\s*$|^\s*-?\d+([.,]\d+)?\s*$|\banswer is\b|\bit'?s\b|答案|是\d|选",
    # an explanation or a statement opens like an answer, not a question
    r"^(um |uh )?(because|cause|so|i think|i guess|it'?s|it is|they|the \w+ (is|are|makes?|has)|maybe)\b",
    r"^(嗯|那个)?(因为|所以|我觉得|我认为|应该是|就是|它是|不知道)",
]
_COMPILED = [re.compile(p, re.IGNORECASE) for p in _PATTERNS]
N_CUES = len(_COMPILED) + 2


def cue_vector(text: str) -> np.ndarray:
    """Binary pattern hits, then length cues (very short; long)."""
    t = text.strip()
    hits = [1.0 if p.search(t) else 0.0 for p in _COMPILED]
    words = len(t.split()) if re.search(r"[A-Za-z]", t) else len(t) / 2  # ~2 Chinese characters a word
    return np.array(hits + [1.0 if words <= 2 else 0.0, 1.0 if words >= 12 else 0.0], np.float32)
