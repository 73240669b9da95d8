"""Batched greedy decoding with Whisper's rules, written once for every backend.

Rules kept from Whisper: an optional prompt after <|startofprev|>, the no-speech probability read
at <|startoftranscript|>, language detection from the language-token logits, non-speech symbols
and special tokens suppressed, no bare space or end-of-text as the first token, and no
timestamps. Rows that reach end-of-text leave the batch at once, so one long utterance does not
make the finished ones keep costing decoder work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from engines.backends import Backend
from engines.tokenizer import WhisperTokenizer

# The decoder sees at most 448 positions; Whisper keeps half of them for the prompt.
MAX_PROMPT_TOKENS = 223


@dataclass
class Decoded:
    tokens: list[int]
    language: str
    no_speech_prob: float
    avg_logprob: float
    hit_budget: bool  # stopped by the token budget, not by end-of-text: likely a repetition loop


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def detect_languages(backend: Backend, state: Any, tok: WhisperTokenizer, n: int) -> list[str]:
    """The most likely language of each of the n rows, from one decoder step on <|startoftranscript|>."""
    logits, _ = backend.step(np.full((n, 1), tok.sot, np.int64), state)
    codes = list(tok.languages)
    ids = np.array([tok.languages[c] for c in codes])
    return [codes[i] for i in logits[:, ids].argmax(axis=1)]


def _suppression(tok: WhisperTokenizer, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    always = np.zeros(n_vocab, bool)
    always[list(tok.suppress_ids)] = True
    always[tok.eot + 1 :] = True  # every special and timestamp token; end-of-text stays allowed
    first = always.copy()
    first[list(tok.suppress_ids_begin)] = True
    return always, first


def greedy_decode(
    backend: Backend,
    state: Any,
    tok: WhisperTokenizer,
    languages: Sequence[str],
    budgets: Sequence[int],
    prompt: list[int] | None = None,
) -> list[Decoded]:
    """Decode every row of `state` (one encoder output each) until end-of-text or its budget."""
    n = len(budgets)
    head = ([tok.sot_prev, *prompt[-MAX_PROMPT_TOKENS:]] if prompt else []) + [tok.sot]
    logits, state = backend.step(np.tile(np.array(head, np.int64), (n, 1)), state)
    no_speech = np.exp(_log_softmax(logits)[:, tok.no_speech])
    task = np.array([tok.task_prefix(lang) for lang in languages], np.int64)
    logits, state = backend.step(task, state)

    always, first = _suppression(tok, logits.shape[1])
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprob = np.zeros(n)
    hit_budget = [False] * n
    active = np.arange(n)
    limit = np.asarray(budgets)
    for step in range(int(limit.max()) + 1):
        masked = np.where(first if step == 0 else always, -np.inf, logits)
        logprobs = _log_softmax(masked)
        chosen = masked.argmax(axis=1)
        logprob[active] += logprobs[np.arange(len(active)), chosen]
        done = chosen == tok.eot
        for slot, row in enumerate(active):
            if done[slot]:
                continue
            tokens[row].append(int(chosen[slot]))
            if len(tokens[row]) >= limit[row]:
                hit_budget[row] = done[slot] = True
        if done.all():
            break
        if done.any():
            keep = np.flatnonzero(~done)
            state, active, chosen = backend.keep(state, keep), active[keep], chosen[keep]
        logits, state = backend.step(chosen[:, None].astype(np.int64), state)

    return [
        Decoded(tokens[i], languages[i], float(no_speech[i]), float(logprob[i] / (len(tokens[i]) + 1)), hit_budget[i])
        for i in range(n)
    ]
