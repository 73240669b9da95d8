"""Audio a page sends again after a break, less what the server already has: the utterances
queued from it before the break, found by their place on the page's own clock
(UtteranceQueue.sent_spans), are silenced before the VAD. Whatever gateway the page comes back
to, and whatever the first connection's utterance ids were, the VAD then cuts only speech that
no utterance holds yet, so none is recognised twice; the speech in progress at the break (never
queued) comes through whole. The check at publication (queue/publication.py) stays for a copy
queued after this looked (the old connection's last utterance, still on its way)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from streamserver.audio.resample import RATE


def silence_sent(pcm: np.ndarray, start: float, spans: Sequence[tuple[float, float]]) -> np.ndarray:
    """`pcm`, whose first sample lies at stream time `start`, with the samples that `spans`
    (start, end on the same clock) hold set to silence: a copy when any is, else `pcm` itself."""
    end = start + pcm.size / RATE
    out = pcm
    for span_start, span_end in spans:
        if span_end <= start or span_start >= end:
            continue
        first = max(0, round((span_start - start) * RATE))
        last = min(pcm.size, round((span_end - start) * RATE))
        if last > first:
            if out is pcm:
                out = pcm.copy()  # a decoder's buffer may be read-only
            out[first:last] = 0
    return out
