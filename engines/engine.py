"""The engine: batches of 16 kHz utterances in, transcripts out.

One Engine serves every student of every room. transcribe_batch groups utterances that share an
encoder length (see policy.py) into one encoder call and one decode loop, then applies the
guards that keep text off non-speech: Whisper's no-speech gate and a repetition check that
re-runs a suspicious utterance with the full 30 s window before giving up on it.

Engine holds those guards and leaves the recognition itself (_run) to its subclasses:
StepEngine drives a step-by-step Backend (engines/backends: ONNX Runtime, TensorRT) through
decoding.py; engines/gpu/engine.py runs whole batches on the GPU. engines/loading.py picks one.
"""

from __future__ import annotations

import re
import zlib
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from engines.backends import Backend
from engines.decoding import Decoded, detect_languages, greedy_decode
from engines.features import N_FRAMES, N_MELS, N_SAMPLES, SAMPLE_RATE, as_float, log_mel
from engines.policy import EncoderPolicy
from engines.tokenizer import WhisperTokenizer
from engines.voicing import has_voicing

# Whisper base drifts to traditional characters without a simplified-Chinese prompt.
DEFAULT_PROMPTS = {"zh": "以下是普通话的句子。"}
# No text when the model says "no speech" strongly, or fairly and the text is unsure too.
# Whisper requires both at 0.6 / -1.0, which lets through its confident "you" on music and
# rumble (docs/architecture.md, "The speech engine", No words on non-speech; tests/test_engine.py).
NO_SPEECH_THRESHOLD = 0.6
NO_SPEECH_UNSURE_THRESHOLD = 0.3
LOGPROB_THRESHOLD = -1.0
COMPRESSION_RATIO_THRESHOLD = 2.4  # zlib ratio above this is a repetition loop
MAX_SAMPLE_LEN = 224  # Whisper's default cap on generated tokens
MIN_VOICED_SECONDS = 0.2  # less voicing than this is not speech (a short "yes" has more)


@dataclass
class Transcript:
    text: str
    language: str
    no_speech_prob: float
    avg_logprob: float
    compression_ratio: float
    encoder_frames: int
    rejected: str | None = None  # why the text was withheld: "no_speech" or "repetition"


def token_budget(n_samples: int) -> int:
    """Tokens an utterance may take: generous for fast speech (~10 tokens/s), short enough that
    a loop is cut in a fraction of the time it would otherwise burn."""
    return min(MAX_SAMPLE_LEN, 16 + int(10 * n_samples / SAMPLE_RATE))


def compression_ratio(text: str) -> float:
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class Engine(ABC):
    """What every engine shares: input checks, the voicing gate, the no-speech and repetition
    guards, the 30 s re-run of a loop, simplified Chinese. Subclasses implement _run."""

    # Another utterance in a batch costs little next to the batch itself: true of a GPU, bound by
    # kernel launches at these sizes (benchmarks/README.md, "GPU engine"); not of
    # a CPU, whose encoder costs per utterance. The ASR worker lets speculative work ride along
    # in its batches only where it is cheap.
    batch_rows_cheap = False
    # Live captions are provisional and replaced by their final within seconds: where rows are not
    # cheap (a CPU), they are recognised at a shorter encoder window than finals (policy.py's
    # CAPTION_WINDOWS), which leaves the engine more of its time for finals. None: the same window.
    caption_policy: EncoderPolicy | None = None

    def __init__(self, model: str, tokenizer: WhisperTokenizer, policy: EncoderPolicy) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self._t2s: Callable[[str], str] | None = None

    @property
    def multilingual(self) -> bool:
        return self.tokenizer.multilingual

    def transcribe_batch(
        self,
        audios: Sequence[np.ndarray],
        language: str | None = None,
        prompt: str | None = None,
        fallback: bool = True,
        window: EncoderPolicy | None = None,
    ) -> list[Transcript]:
        """Transcribe utterances of up to 30 s each (mono 16 kHz: float32 in [-1, 1], or int16 PCM
        as the queue carries them), in one batch where their encoder lengths agree. language None
        (or "auto") detects it per utterance. fallback=False skips the 30 s re-run of rejected
        repetitions (for measuring the policy alone). `window`: the encoder lengths of another
        policy than the engine's (its padding stays the engine's)."""
        for i, audio in enumerate(audios):
            if audio.ndim != 1 or audio.size == 0:
                raise ValueError(f"utterance {i}: expected non-empty mono audio, got shape {audio.shape}")
            if audio.size > N_SAMPLES:
                raise ValueError(f"utterance {i}: {audio.size / SAMPLE_RATE:.1f} s is over 30 s; use transcribe_long")
        language = None if language == "auto" else language
        if language is not None and self.multilingual and language not in self.tokenizer.languages:
            raise ValueError(f"unknown language {language!r}")
        voiced = self._voiced(audios, language, prompt)
        unvoiced_language = language or ("en" if not self.multilingual else "")
        results = [Transcript("", unvoiced_language, 1.0, 0.0, 0.0, 0, "no_speech") for _ in audios]
        chosen = [audios[i] for i in voiced]
        for i, r in zip(voiced, self._decode_with_fallback(chosen, language, prompt, fallback, window or self.policy)):
            results[i] = r
        return results

    def _voiced(self, audios: Sequence[np.ndarray], language: str | None, prompt: str | None) -> list[int]:
        """Which utterances have enough voicing to reach the model."""
        return [i for i, a in enumerate(audios) if has_voicing(a, MIN_VOICED_SECONDS)]

    def _decode_with_fallback(
        self, audios: Sequence[np.ndarray], language: str | None, prompt: str | None, fallback: bool,
        window: EncoderPolicy,
    ) -> list[Transcript]:
        frames = [window.frames(a.size) for a in audios]
        results = self._run(audios, frames, language, prompt)
        # A loop at a short window gets one more try with the full 30 s that Whisper was trained on.
        retry = [i for i, r in enumerate(results) if fallback and looks_looped(r) and frames[i] < N_FRAMES]
        if retry:
            again = self._run([audios[i] for i in retry], [N_FRAMES] * len(retry), language, prompt)
            for i, r in zip(retry, again):
                results[i] = r
        return results

    def warmup(self) -> None:
        """One run on 3 s of noise (voiced enough to reach the model), so that the first real
        utterance does not pay for the runtime's first-call allocations."""
        noise = np.random.default_rng(0).normal(0, 0.1, 3 * SAMPLE_RATE).astype(np.float32)
        self.transcribe_batch([noise], "en")

    def transcribe_long(self, audio: np.ndarray, language: str | None = None, prompt: str | None = None) -> list[Transcript]:
        """Audio of any length: cut into windows of at most 30 s at quiet points, batched together."""
        return self.transcribe_batch(split_on_quiet(audio), language, prompt)

    @abstractmethod
    def _run(self, audios: Sequence[np.ndarray], frames: list[int], language: str | None, prompt: str | None) -> list[Transcript]:
        """Recognise utterances at the given encoder frames (language None: detect it per
        utterance), each result through _finish; in input order."""

    def _prompt_ids(self, language: str, prompt: str | None) -> list[int] | None:
        """The prompt's tokens: the given text, else the language's default (DEFAULT_PROMPTS)."""
        text_prompt = prompt if prompt is not None else DEFAULT_PROMPTS.get(language)
        return self.tokenizer.encode(" " + text_prompt.strip()) if text_prompt else None

    def _finish(self, d: Decoded, n_frames: int) -> Transcript:
        text = self.tokenizer.decode(d.tokens).strip()
        if d.language == "zh":
            text = self._simplified(text)
        ratio = compression_ratio(text)
        rejected = None
        unsure = d.no_speech_prob > NO_SPEECH_UNSURE_THRESHOLD and d.avg_logprob < LOGPROB_THRESHOLD
        if d.no_speech_prob > NO_SPEECH_THRESHOLD or unsure:
            rejected = "no_speech"
        elif d.hit_budget or ratio > COMPRESSION_RATIO_THRESHOLD:
            rejected = "repetition"
        return Transcript("" if rejected else text, d.language, d.no_speech_prob, d.avg_logprob, ratio, n_frames, rejected)

    def _simplified(self, text: str) -> str:
        """Any traditional character left over becomes its simplified form (OpenCC's t2s table)."""
        if self._t2s is None:
            from opencc import OpenCC

            self._t2s = OpenCC("t2s").convert
        return self._t2s(text)


class StepEngine(Engine):
    """An Engine over a step-by-step Backend: encoder and decoder steps as numpy calls, Whisper's
    rules in decoding.py."""

    def __init__(self, model: str, backend: Backend, tokenizer: WhisperTokenizer, policy: EncoderPolicy,
                 n_mels: int = N_MELS) -> None:
        super().__init__(model, tokenizer, policy)
        self.backend = backend
        self.n_mels = n_mels  # 80, or 128 (large-v3): read off the model's first convolution
        self.batch_rows_cheap = bool(getattr(backend, "batch_rows_cheap", False))

    def _run(self, audios: Sequence[np.ndarray], frames: list[int], language: str | None, prompt: str | None) -> list[Transcript]:
        results: list[Transcript | None] = [None] * len(audios)
        by_frames: dict[int, list[int]] = defaultdict(list)
        for i, f in enumerate(frames):
            by_frames[f].append(i)
        for n_frames, rows in by_frames.items():
            mel = np.stack([log_mel(audios[i], n_frames, self.policy.pad_value, self.n_mels) for i in rows])
            state = self.backend.encode(mel)
            if not self.multilingual:
                languages = ["en"] * len(rows)
            elif language is None:
                languages = detect_languages(self.backend, state, self.tokenizer, len(rows))
            else:
                languages = [language] * len(rows)
            # Rows with different languages get different prompts, so they decode apart.
            by_language: dict[str, list[int]] = defaultdict(list)
            for slot, lang in enumerate(languages):
                by_language[lang].append(slot)
            for lang, slots in by_language.items():
                sub = state if len(slots) == len(rows) else self.backend.keep(state, np.array(slots))
                budgets = [token_budget(audios[rows[s]].size) for s in slots]
                decoded = greedy_decode(self.backend, sub, self.tokenizer, [lang] * len(slots), budgets, self._prompt_ids(lang, prompt))
                for s, d in zip(slots, decoded):
                    results[rows[s]] = self._finish(d, n_frames)
        return [r for r in results if r is not None]


def looks_looped(result: Transcript) -> bool:
    """A rejected repetition, or text that is one phrase said twice or more ("yes yes", "wait can
    you repeat the question wait can you repeat the question"): the signature of a short encoder
    window whose decoder did not see where the audio ends."""
    if result.rejected == "repetition":
        return True
    words = re.findall(r"\w+", result.text.lower())
    n = len(words)
    return any(n % period == 0 and words[period:] == words[:-period] for period in range(1, n // 2 + 1))


def split_on_quiet(audio: np.ndarray, window_s: float = 30.0, search_s: float = 5.0) -> list[np.ndarray]:
    """Cut long audio into pieces of at most window_s, each cut at the quietest 100 ms of the last
    search_s seconds of its window, so that a cut rarely falls inside a word."""
    window, search, hop = int(window_s * SAMPLE_RATE), int(search_s * SAMPLE_RATE), SAMPLE_RATE // 10
    pieces: list[np.ndarray] = []
    start = 0
    while audio.size - start > window:
        tail = audio[start + window - search : start + window]
        energy = np.square(as_float(tail[: tail.size // hop * hop]).reshape(-1, hop)).mean(axis=1)
        cut = start + window - search + int(energy.argmin()) * hop + hop // 2
        pieces.append(audio[start:cut])
        start = cut
    pieces.append(audio[start:])
    return [p for p in pieces if p.size]
